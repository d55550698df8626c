"""Make CUDA-specific placement in a cell follow the device ``%%ondevice`` chose.

A notebook written for one GPU says ``x.cuda()``, ``torch.device('cuda')``,
``device='cuda:0'`` or ``torch.cuda.FloatTensor([1., 2.])``. Run under
``%%ondevice cpu`` (or ``cuda:1``, ``meta``), the cell's code is rewritten so
that every such spelling lands on that device instead, with the right dtype,
and the factories the cell calls (``torch.zeros``, ``torch.randn``,
``nn.Linear(...)``...) get ``device=`` passed explicitly.

Why a rewrite rather than ``with torch.device(DEVICE):``: torch's
default-device context is a ``TorchFunctionMode`` that intercepts *every*
torch call, which made a loop of small ops about 80% slower on the CPU; an
explicit ``device=`` costs nothing measurable (``benchmarks/ondevice.py``).

Two parts live here, because they change together:

* :class:`PlacementRewriter`, an ``ast.NodeTransformer``. Rewritten calls go
  through one helper name, :data:`HELPER`, so the cell's own names are never
  touched; new nodes carry the user's line numbers.
* :class:`Placement`, the object bound to :data:`HELPER` while the cell runs.
  ``Placement(None)`` passes every call through unchanged; it is what a
  function defined in such a cell finds (in ``builtins``) when called after
  the cell, so such functions keep their original behaviour outside
  ``%%ondevice`` and follow the device again inside a later ``%%ondevice``
  cell (whose own helper shadows the builtin).

What "CUDA follows DEVICE" means for the rest of ``torch.cuda`` while the
cell runs (the device stands in for "the GPU" of the notebook's author):

==================================  ==================  =====================
call                                DEVICE is cuda:k    DEVICE is cpu / meta
==================================  ==================  =====================
``torch.cuda.is_available()``       True                True
``torch.cuda.device_count()``       real count          1
``torch.cuda.current_device()``     k                   0
``torch.cuda.set_device(i)``        stays on k          nothing
``torch.cuda.synchronize()``        synchronises k      nothing
``with torch.cuda.device(i):``      device k            nothing
``x.is_cuda``                       on CUDA or DEVICE   on CUDA or DEVICE
``x.pin_memory()`` / ``pin_memory=``  unchanged           skipped (no pinning)
==================================  ==================  =====================

None of these touch ``torch.cuda`` when DEVICE is not a GPU, so CUDA is never
initialised by them. All CUDA indices map to DEVICE (``cuda:1`` too): a cell
runs on one device. ``*_like`` factories follow their input, as under
torch's own default device, except that an input on another CUDA device
is followed to DEVICE. Explicit CPU placement (``device='cpu'``,
``torch.FloatTensor(...)`` without ``.cuda()``) is left alone.

Examples
--------
In a notebook::

    %%ondevice cpu
    a = torch.cuda.FloatTensor([1., 2.])     # float32 on cpu
    model = sq.cuda()                        # sq stays usable on cpu
    next(model.parameters()).is_cuda         # True: cpu stands in for CUDA
"""
from __future__ import annotations

import ast
import builtins
import contextlib
import numbers
import sys
from functools import lru_cache
from types import ModuleType

__all__ = ["HELPER", "PlacementRewriter", "Placement", "rewrite_placement", "passthrough",
           "install_passthrough", "modules_on"]

#: The one name the rewritten code uses; bound in the cell's namespace while it runs.
HELPER = "__gpumagic_device__"

LEGACY_TYPES = ("FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "LongTensor",
                "IntTensor", "ShortTensor", "CharTensor", "ByteTensor", "BoolTensor")
_LEGACY_CUDA = frozenset(f"torch.cuda.{t}" for t in LEGACY_TYPES)
_LEGACY_CPU = frozenset([f"torch.{t}" for t in LEGACY_TYPES] + ["torch.Tensor"])

# Factories that take ``device=`` and otherwise use the default device; the
# same set torch's own default-device context redirects (torch/utils/_device.py).
FACTORIES = frozenset(f"torch.{f}" for f in (
    "zeros", "ones", "empty", "full", "rand", "randn", "randint", "randperm", "arange", "range",
    "linspace", "logspace", "eye", "tensor", "as_tensor", "asarray", "scalar_tensor",
    "empty_strided", "empty_permuted", "tril_indices", "triu_indices", "bartlett_window",
    "blackman_window", "hamming_window", "hann_window", "kaiser_window", "sparse_coo_tensor",
    "sparse_csr_tensor", "sparse_csc_tensor", "sparse_bsr_tensor", "sparse_bsc_tensor",
    "sparse_compressed_tensor",
))
LIKE_FACTORIES = frozenset(f"torch.{f}" for f in (
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
))
# Arguments that make an added ``device=`` wrong or redundant.
_NO_DEVICE_WITH = frozenset({"device", "out", "generator", "pin_memory", None})

_CUDA_CALLS = {f"torch.cuda.{n}": f"cuda_{n}" for n in (
    "is_available", "device_count", "current_device", "set_device", "synchronize", "device")}
_DEVICE_KEYWORDS = ("device", "map_location")
# ``x.to(torch.float16)`` needs no help: these keywords and dtype names never name a device.
_TO_HARMLESS_KEYWORDS = frozenset({"dtype", "non_blocking", "copy", "memory_format"})
_CONVENTIONAL = {"torch": "torch", "nn": "torch.nn"}
_UNBOUND = {"torch.Tensor.cuda": "cuda", "torch.nn.Module.cuda": "cuda",
            "torch.Tensor.to": "to", "torch.nn.Module.to": "to"}


def _is_cuda_name(value) -> bool:
    """``'cuda'``, ``'cuda:1'`` (what torch.device parses as CUDA)."""
    return isinstance(value, str) and (value == "cuda" or value.startswith("cuda:"))


def _is_cuda_constant(value) -> bool:
    # An int device is a CUDA index for torch (``device=0`` is cuda:0).
    return _is_cuda_name(value) or (isinstance(value, int) and not isinstance(value, bool))


_KNOWN: dict | None = None


def _known_objects() -> dict:
    """id -> dotted name for torch objects a notebook may have imported by name."""
    global _KNOWN
    if _KNOWN is not None:
        return _KNOWN
    if "torch" not in sys.modules:
        return {}
    names = ["torch.device", "torch.Tensor", "torch.nn.Module", "torch.set_default_device", "torch.load"]
    names += list(FACTORIES) + list(LIKE_FACTORIES) + list(_LEGACY_CPU) + list(_LEGACY_CUDA) + list(_CUDA_CALLS)
    known = {}
    for name in names:
        obj = _lookup(name)
        if obj is not None:
            known[id(obj)] = name
    _KNOWN = known
    return known


def _lookup(dotted: str):
    """The object a dotted torch name refers to, or None (imports nothing)."""
    parts = dotted.split(".")
    obj = sys.modules.get(parts[0])
    for part in parts[1:]:
        if obj is None:
            return None
        obj = getattr(obj, part, None)
    return obj


def _takes_device(dotted: str) -> bool:
    """True for a ``torch.nn`` module class whose constructor accepts ``device=``."""
    if "torch" not in sys.modules:
        return False   # not cached: torch may be imported later
    return _class_takes_device(dotted)


@lru_cache(maxsize=512)
def _class_takes_device(dotted: str) -> bool:
    torch = sys.modules["torch"]
    cls = _lookup(dotted)
    if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        return False
    import inspect
    for klass in cls.__mro__:
        if klass is torch.nn.Module:
            break
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params = inspect.signature(init).parameters
        except (TypeError, ValueError):
            return False
        if "device" in params:
            return True
        # ``LSTM(*args, **kwargs)`` hands everything to its base; keep looking there.
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return False
    return False


class _Resolver:
    """Dotted names for the cell's expressions: ``th.cuda.FloatTensor`` -> ``torch.cuda.FloatTensor``.

    A name is resolved through the cell's own imports first, then the
    notebook's namespace (modules by ``__name__``, torch objects by identity),
    then the conventional ``torch`` and ``nn``.
    """

    def __init__(self, tree: ast.AST, namespace: dict | None):
        self.namespace = namespace if namespace is not None else {}
        self.imports: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.imports[alias.asname] = alias.name
                    else:
                        first = alias.name.split(".")[0]
                        self.imports[first] = first
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    if alias.name != "*":
                        self.imports[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        self._cache: dict[str, str | None] = {}

    def name(self, ident: str) -> str | None:
        if ident in self._cache:
            return self._cache[ident]
        resolved = None
        if ident in self.imports:
            resolved = self.imports[ident]
        elif ident in self.namespace:
            value = self.namespace[ident]
            if isinstance(value, ModuleType):
                resolved = value.__name__
            else:
                resolved = _known_objects().get(id(value))
                torch = sys.modules.get("torch")
                if resolved is None and torch is not None and isinstance(value, type) \
                        and issubclass(value, torch.nn.Module) and value.__module__.startswith("torch."):
                    resolved = f"{value.__module__}.{value.__qualname__}"
        else:
            resolved = _CONVENTIONAL.get(ident)
        self._cache[ident] = resolved
        return resolved

    def dotted(self, node: ast.AST) -> str | None:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        base = self.name(node.id)
        if base is None:
            return None
        return ".".join([base, *reversed(parts)])


class PlacementRewriter(ast.NodeTransformer):
    """Rewrite CUDA-specific placement so that it goes through :data:`HELPER`.

    ``namespace`` (the notebook's ``user_ns``) resolves aliases such as
    ``import torch as th``. After ``visit``, ``rewrites`` counts rewritten
    spots and ``nested`` tells whether any is inside a function, lambda or
    generator, which may run after the cell.

    Examples
    --------
    >>> tree = ast.parse("a = torch.zeros(2).cuda()")
    >>> print(ast.unparse(PlacementRewriter().visit(tree)))
    a = torch.zeros(2, device=__gpumagic_device__.cuda_target)
    """

    def __init__(self, namespace: dict | None = None, helper: str = HELPER):
        self.namespace = namespace
        self.helper = helper
        self.rewrites = 0
        self.nested = False
        self._depth = 0
        self._resolver: _Resolver | None = None

    # -- entry points and scopes ------------------------------------------
    def visit(self, node):
        if self._resolver is None:
            self._resolver = _Resolver(node, self.namespace)
        return super().visit(node)

    def _scoped(self, node):
        self._depth += 1
        try:
            self.generic_visit(node)
        finally:
            self._depth -= 1
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = visit_GeneratorExp = _scoped

    # -- building blocks ---------------------------------------------------
    def _h(self, attr: str | None = None):
        self.rewrites += 1
        if self._depth:
            self.nested = True
        name = ast.Name(id=self.helper, ctx=ast.Load())
        return ast.Attribute(value=name, attr=attr, ctx=ast.Load()) if attr else name

    def _call(self, method: str, args, keywords, like: ast.AST) -> ast.Call:
        call = ast.Call(func=self._h(method), args=list(args), keywords=list(keywords))
        return ast.copy_location(call, like)

    def _dotted(self, node) -> str | None:
        return self._resolver.dotted(node) if self._resolver else None

    def _kw(self, node: ast.Call, name):
        return next((k for k in node.keywords if k.arg == name), None)

    def _add_device(self, node: ast.Call, attr: str = "target") -> None:
        value = ast.copy_location(self._h(attr), node)
        node.keywords.append(ast.copy_location(ast.keyword(arg="device", value=value), node))

    # -- the rewrite -------------------------------------------------------
    def visit_Attribute(self, node: ast.Attribute):
        self.generic_visit(node)
        if node.attr == "is_cuda" and isinstance(node.ctx, ast.Load) and self._dotted(node.value) is None:
            return self._call("is_cuda", [node.value], [], node)
        return node

    def visit_Call(self, node: ast.Call):
        folded = self._fold(node)
        if folded is not None:
            return folded
        self.generic_visit(node)
        self._rewrite_keywords(node)
        func = node.func
        name = self._dotted(func)

        if name is None and isinstance(func, ast.Attribute):
            return self._method(node, func)
        if name is None:
            return node
        if name in _UNBOUND and node.args:
            return self._call(_UNBOUND[name], node.args, node.keywords, node)
        if name == "torch.device":
            return self._call("device", node.args, node.keywords, node)
        if name in _LEGACY_CUDA or (name in _LEGACY_CPU and self._kw(node, "device")):
            return self._call("legacy", [func, *node.args], node.keywords, node)
        if name in _CUDA_CALLS:
            return self._call(_CUDA_CALLS[name], node.args, node.keywords, node)
        if name in LIKE_FACTORIES:
            if node.args and not any(k.arg in ("device", None) for k in node.keywords):
                return self._call("like", [func, *node.args], node.keywords, node)
            return node
        if name in FACTORIES or (name.startswith("torch.nn.") and _takes_device(name)):
            if not any(k.arg in _NO_DEVICE_WITH for k in node.keywords):
                self._add_device(node)
            return node
        if name == "torch.set_default_device" and node.args:
            node.args[0] = ast.copy_location(ast.Call(self._h("map"), [node.args[0]], []), node.args[0])
        elif name == "torch.load" and len(node.args) > 1:
            node.args[1] = ast.copy_location(ast.Call(self._h("map"), [node.args[1]], []), node.args[1])
        return node

    def _method(self, node: ast.Call, func: ast.Attribute):
        """``obj.cuda()``, ``obj.to(...)``, ``obj.type(torch.cuda.X)``, ``obj.pin_memory()``."""
        attr, receiver = func.attr, func.value
        if attr == "cuda":
            return self._call("cuda", [receiver, *node.args], node.keywords, node)
        if attr == "to" and self._to_may_move(node):
            return self._call("to", [receiver, *node.args], node.keywords, node)
        if attr == "type" and len(node.args) == 1 and not node.keywords and self._is_cuda_type(node.args[0]):
            return self._call("retype", [receiver, node.args[0]], [], node)
        if attr == "pin_memory" and not node.args and not node.keywords:
            return self._call("pin_memory", [receiver], [], node)
        return node

    def _to_may_move(self, node: ast.Call) -> bool:
        if any(k.arg not in _TO_HARMLESS_KEYWORDS for k in node.keywords):
            return True
        if not node.args:
            return False
        first = node.args[0]
        if isinstance(first, ast.Constant) and not _is_cuda_constant(first.value):
            return False
        dotted = self._dotted(first)
        if dotted and dotted.startswith("torch.") and "." not in dotted[6:]:
            torch = sys.modules.get("torch")
            if torch is not None and isinstance(_lookup(dotted), torch.dtype):
                return False
        return True

    def _is_cuda_type(self, node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in _LEGACY_CUDA
        return self._dotted(node) in _LEGACY_CUDA

    def _fold(self, node: ast.Call):
        """``torch.FloatTensor(d).cuda()`` and ``torch.zeros(n).cuda()`` allocate on DEVICE directly."""
        func = node.func
        if not (isinstance(func, ast.Attribute) and func.attr == "cuda" and isinstance(func.value, ast.Call)):
            return None
        if node.args or any(k.arg != "non_blocking" for k in node.keywords):
            return None
        inner = func.value
        name = self._dotted(inner.func)
        if name is None or any(isinstance(a, ast.Starred) for a in inner.args):
            return None
        if name in _LEGACY_CPU and not inner.keywords:
            inner.args = [self.visit(a) for a in inner.args]
            return self._call("legacy_cuda", [inner.func, *inner.args], [], node)
        if name in FACTORIES and not any(k.arg in _NO_DEVICE_WITH for k in inner.keywords):
            self.generic_visit(inner)
            self._rewrite_keywords(inner)
            self._add_device(inner, "cuda_target")
            return ast.copy_location(inner, node)
        return None

    def _rewrite_keywords(self, node: ast.Call) -> None:
        for kw in node.keywords:
            value = kw.value
            if kw.arg in _DEVICE_KEYWORDS:
                if isinstance(value, ast.Constant):
                    if _is_cuda_constant(value.value):
                        # ``(H.target or 'cuda:0')``: DEVICE while a cell runs, the original after.
                        kw.value = ast.copy_location(ast.BoolOp(op=ast.Or(), values=[self._h("target"), value]), value)
                else:
                    kw.value = ast.copy_location(ast.Call(self._h("map"), [value], []), value)
            elif kw.arg == "pin_memory" and not (isinstance(value, ast.Constant) and not value.value):
                kw.value = ast.copy_location(ast.Call(self._h("pin"), [value], []), value)


def rewrite_placement(tree: ast.AST, namespace: dict | None = None, helper: str = HELPER):
    """Rewrite ``tree`` in place; returns ``(tree, rewriter)`` (the rewriter holds the counts)."""
    rewriter = PlacementRewriter(namespace, helper)
    tree = ast.fix_missing_locations(rewriter.visit(tree))
    return tree, rewriter


# ---------------------------------------------------------------------------
# Runtime: what the rewritten code calls.
# ---------------------------------------------------------------------------

class Placement:
    """Where rewritten code puts things: ``Placement('cuda:1')``, or ``Placement(None)`` to pass through.

    Every method mirrors one CUDA spelling; with a target it lands on the
    target, without one it does exactly what the original code did.
    """

    __slots__ = ("target", "cuda_target", "_torch", "_kind")

    def __init__(self, target=None):
        import torch
        self._torch = torch
        if target is None:
            self.target = None
            self.cuda_target = "cuda"   # what ``.cuda()`` means without a target
            self._kind = None
        else:
            self.target = torch.device(target)
            if self.target.type == "cuda" and self.target.index is None:
                raise ValueError("Placement needs an indexed CUDA device, e.g. 'cuda:0'")
            self.cuda_target = self.target
            self._kind = self.target.type

    def __repr__(self):
        return f"Placement({str(self.target) if self.target is not None else None!r})"

    def __reduce__(self):
        # Functions from a cell may be pickled into other processes: there they pass through.
        return (passthrough, ())

    # -- devices -------------------------------------------------------------
    def map(self, device):
        """A CUDA device (``'cuda'``, ``'cuda:1'``, ``1``, ``torch.device('cuda')``) -> the target."""
        __tracebackhide__ = True  # noqa: F841
        target = self.target
        if target is None or device is None:
            return device
        if isinstance(device, self._torch.device):
            return target if device.type == "cuda" else device
        if isinstance(device, str):
            return target if _is_cuda_name(device) else device
        if isinstance(device, int) and not isinstance(device, bool):
            return target
        if isinstance(device, dict):  # torch.load(map_location={'cuda:1': 'cuda:0'})
            return {k: self.map(v) for k, v in device.items()}
        return device

    def device(self, *args, **kwargs):
        """``torch.device(...)``."""
        __tracebackhide__ = True  # noqa: F841
        made = self._torch.device(*args, **kwargs)
        if self.target is not None and made.type == "cuda":
            return self.target
        return made

    def _copy_from_cpu(self, tensor) -> bool:
        # ``.cuda()`` of a CPU tensor is a new tensor; on a CPU target keep it one.
        return self._kind == "cpu" and tensor.device.type == "cpu"

    # -- moving ---------------------------------------------------------------
    def cuda(self, obj, *args, **kwargs):
        """``obj.cuda(...)``: tensors and modules go to the target (modules in place)."""
        __tracebackhide__ = True  # noqa: F841
        torch = self._torch
        if self.target is None:
            return obj.cuda(*args, **kwargs)
        if isinstance(obj, torch.Tensor):
            non_blocking = kwargs.get("non_blocking", args[1] if len(args) > 1 else False)
            extra = {}
            if kwargs.get("memory_format") is not None:
                extra["memory_format"] = kwargs["memory_format"]
            return obj.to(self.target, non_blocking=bool(non_blocking), copy=self._copy_from_cpu(obj), **extra)
        if isinstance(obj, torch.nn.Module):
            return obj.to(self.target)
        to = getattr(obj, "to", None)
        if callable(to):
            return to(self.target)
        return obj.cuda(*args, **kwargs)

    def to(self, obj, *args, **kwargs):
        """``obj.to(...)``: CUDA devices among the arguments become the target."""
        __tracebackhide__ = True  # noqa: F841
        torch = self._torch
        if self.target is None:
            return obj.to(*args, **kwargs)
        is_tensor = isinstance(obj, torch.Tensor)
        is_torch = is_tensor or isinstance(obj, torch.nn.Module)
        moved = False
        if args:
            first = args[0]
            if isinstance(first, torch.Tensor):
                if is_torch and first.device.type == "cuda" and first.device != self.target:
                    # ``to(other)`` means other's device and dtype.
                    args = (self.target, first.dtype, *args[1:])
                    moved = True
            elif isinstance(first, int) and not isinstance(first, bool):
                if is_torch:
                    args = (self.target, *args[1:])
                    moved = True
            else:
                mapped = self.map(first)
                if mapped is not first:
                    args = (mapped, *args[1:])
                    moved = True
        if "device" in kwargs:
            mapped = self.map(kwargs["device"])
            if mapped is not kwargs["device"]:
                kwargs["device"] = mapped
                moved = True
        if moved and is_tensor and "copy" not in kwargs and len(args) < 4 and self._copy_from_cpu(obj):
            kwargs["copy"] = True
        return obj.to(*args, **kwargs)

    def retype(self, obj, kind):
        """``x.type(torch.cuda.HalfTensor)`` / ``x.type('torch.cuda.HalfTensor')``."""
        __tracebackhide__ = True  # noqa: F841
        if self.target is None:
            return obj.type(kind)
        name = kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__name__}"
        dtype = getattr(_lookup(name.replace("torch.cuda.", "torch.", 1)), "dtype", None)
        return obj.to(self.target, dtype)

    # -- making ---------------------------------------------------------------
    def legacy(self, cls, *args, **kwargs):
        """``torch.cuda.FloatTensor(...)`` and ``torch.FloatTensor(..., device=d)``."""
        __tracebackhide__ = True  # noqa: F841
        if self.target is None:
            return cls(*args, **kwargs)
        device = self.target
        if "device" in kwargs:
            wanted = self.map(kwargs.pop("device"))
            if wanted is not None and getattr(cls, "is_cuda", None) is not True:
                device = wanted
        if kwargs:
            return cls(*args, **kwargs)  # let torch report the unexpected keyword
        return self._legacy_new(cls, device, args)

    def legacy_cuda(self, cls, *args):
        """``torch.FloatTensor(...).cuda()`` in one step."""
        __tracebackhide__ = True  # noqa: F841
        if self.target is None:
            return cls(*args).cuda()
        return self._legacy_new(cls, self.target, args)

    def _legacy_new(self, cls, device, args):
        __tracebackhide__ = True  # noqa: F841
        torch = self._torch
        dtype = getattr(cls, "dtype", None)
        if not isinstance(dtype, torch.dtype):  # torch.Tensor: the default dtype
            dtype = torch.get_default_dtype()
        if not args:
            return torch.empty(0, dtype=dtype, device=device)
        if len(args) == 1 and isinstance(args[0], torch.Size):
            return torch.empty(args[0], dtype=dtype, device=device)
        if all(isinstance(a, numbers.Integral) and not isinstance(a, (bool, torch.Tensor)) for a in args):
            return torch.empty(tuple(int(a) for a in args), dtype=dtype, device=device)
        if len(args) == 1:
            data = args[0]
            if isinstance(data, torch.Tensor):
                return data.to(device=device, dtype=dtype)
            return torch.tensor(data, dtype=dtype, device=device)
        return cls(*args)  # torch's own error for a malformed call

    def like(self, fn, *args, **kwargs):
        """``torch.zeros_like(x)``: follows x, unless x is on another CUDA device."""
        __tracebackhide__ = True  # noqa: F841
        if self.target is not None and args:
            first = args[0]
            if isinstance(first, self._torch.Tensor) and first.device.type == "cuda" and first.device != self.target:
                kwargs["device"] = self.target
        return fn(*args, **kwargs)

    def pin_memory(self, obj):
        """``x.pin_memory()``: pinning needs CUDA; elsewhere the tensor is returned as is."""
        __tracebackhide__ = True  # noqa: F841
        if self.target is None or self._kind == "cuda":
            return obj.pin_memory()
        return obj

    def pin(self, flag):
        """``pin_memory=flag``."""
        return flag if self.target is None or self._kind == "cuda" else False

    def is_cuda(self, obj) -> bool:
        """``x.is_cuda``: true on CUDA or on the target."""
        __tracebackhide__ = True  # noqa: F841
        if self.target is None:
            return obj.is_cuda
        return bool(getattr(obj, "is_cuda", False)) or getattr(obj, "device", None) == self.target

    # -- torch.cuda -------------------------------------------------------------
    def cuda_is_available(self) -> bool:
        __tracebackhide__ = True  # noqa: F841
        return self._torch.cuda.is_available() if self.target is None else True

    def cuda_device_count(self) -> int:
        __tracebackhide__ = True  # noqa: F841
        if self.target is None or self._kind == "cuda":
            return self._torch.cuda.device_count()
        return 1

    def cuda_current_device(self) -> int:
        __tracebackhide__ = True  # noqa: F841
        if self.target is None:
            return self._torch.cuda.current_device()
        return self.target.index if self._kind == "cuda" else 0

    def cuda_set_device(self, device) -> None:
        __tracebackhide__ = True  # noqa: F841
        if self.target is None:
            return self._torch.cuda.set_device(device)
        if self._kind == "cuda":
            self._torch.cuda.set_device(self.target)
        return None

    def cuda_synchronize(self, device=None) -> None:
        __tracebackhide__ = True  # noqa: F841
        if self.target is None:
            return self._torch.cuda.synchronize(device)
        if self._kind == "cuda":
            self._torch.cuda.synchronize(self.target)
        elif self._kind == "mps":
            self._torch.mps.synchronize()
        return None

    def cuda_device(self, device):
        """``with torch.cuda.device(i):``."""
        __tracebackhide__ = True  # noqa: F841
        if self.target is None:
            return self._torch.cuda.device(device)
        if self._kind == "cuda":
            return self._torch.cuda.device(self.target)
        return contextlib.nullcontext()


_PASSTHROUGH: Placement | None = None


def passthrough() -> Placement:
    """The shared pass-through helper, installed in ``builtins`` (see the module notes)."""
    global _PASSTHROUGH
    if _PASSTHROUGH is None:
        _PASSTHROUGH = Placement(None)
    install_passthrough()
    return _PASSTHROUGH


def install_passthrough(name: str = HELPER) -> None:
    """Make ``name`` resolve to the pass-through helper where no cell binds it.

    Functions defined in a rewritten cell look the helper up as a global when
    they are called; after the cell the notebook no longer binds it, and the
    lookup falls through to ``builtins``.
    """
    global _PASSTHROUGH
    if _PASSTHROUGH is None:
        _PASSTHROUGH = Placement(None)
    if getattr(builtins, name, None) is not _PASSTHROUGH:
        setattr(builtins, name, _PASSTHROUGH)


@contextlib.contextmanager
def modules_on(target):
    """While active, parameters and buffers registered on any ``nn.Module`` move to ``target``.

    This places modules built by code the rewrite cannot see (a class
    defined in an earlier cell, a library's model) without a default-device
    context, so small ops pay nothing. Parameters that arrive twice (tied
    weights) stay one parameter. A no-op on torch without the global
    registration hooks.
    """
    import torch
    from torch.nn.modules import module as module_mod
    register_param = getattr(module_mod, "register_module_parameter_registration_hook", None)
    register_buffer = getattr(module_mod, "register_module_buffer_registration_hook", None)
    if register_param is None or register_buffer is None:
        yield
        return
    target = torch.device(target)
    moved: dict[int, tuple] = {}   # id(original) -> (original kept alive, replacement)

    def on_parameter(module, name, param):
        if param is None or type(param) is not torch.nn.Parameter or param.device == target:
            return None
        hit = moved.get(id(param))
        if hit is not None:
            return hit[1]
        new = torch.nn.Parameter(param.detach().to(target), requires_grad=param.requires_grad)
        moved[id(param)] = (param, new)
        return new

    def on_buffer(module, name, buffer):
        if not isinstance(buffer, torch.Tensor) or buffer.device == target:
            return None
        hit = moved.get(id(buffer))
        if hit is not None:
            return hit[1]
        new = buffer.to(target)
        moved[id(buffer)] = (buffer, new)
        return new

    handles = [register_param(on_parameter), register_buffer(on_buffer)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        moved.clear()
