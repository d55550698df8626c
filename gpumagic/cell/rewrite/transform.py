"""The AST half of the placement rewrite: CUDA-specific spellings -> calls on :data:`HELPER`.

:class:`PlacementRewriter` rewrites a cell's tree so that ``.cuda()``,
``'cuda:0'``, ``torch.device('cuda')``, ``torch.cuda.FloatTensor(...)`` (and
the bare ``torch.cuda.FloatTensor``) and the ``torch.cuda`` calls go through
one helper name (so do ``getattr(x, 'cuda')``, ``torch.Tensor.cuda`` and ``x.cuda`` taken as values,
and a ``torch.load`` without ``map_location``), and gives factories an explicit ``device=`` (what a factory or ``nn``
layer makes on a device it is given goes through ``on_cuda``/``factory``, so that a CPU
target can remember it as on CUDA: :mod:`.placed`); the code of
``%time``/``%timeit``/``%prun`` inside the cell is rewritten the same way
(:mod:`.magics`); :mod:`.helper` explains what each
rewritten spot means and holds the :class:`~gpumagic.cell.rewrite.helper.Placement`
object the helper name is bound to. Nothing here imports torch.
"""
from __future__ import annotations

import ast
import sys
from types import ModuleType

from .magics import rewrite_magic_call
from .names import lookup, takes_device
from .parallel import PARALLEL_CALLS

__all__ = ["HELPER", "LEGACY_TYPES", "FACTORIES", "LIKE_FACTORIES", "PlacementRewriter", "rewrite_placement",
           "is_cuda_name", "is_cuda_type_name", "lookup"]

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
# Factories that may return their input (a CPU tensor or array) rather than a new tensor.
_MAY_ALIAS = frozenset({"torch.as_tensor", "torch.asarray"})
# Arguments that make an added ``device=`` wrong or redundant.
_NO_DEVICE_WITH = frozenset({"device", "out", "generator", "pin_memory", None})

# ``torch.cuda`` and ``torch.accelerator`` calls -> the helper method that answers them. The original
# function is passed first; what each call means on DEVICE is in gpumagic.cell.rewrite.cuda_calls.
_QUERIES = ("get_device_name", "get_device_properties", "get_device_capability", "mem_get_info", "get_memory_info",
            "memory_allocated", "memory_reserved", "memory_cached", "max_memory_allocated", "max_memory_reserved",
            "max_memory_cached", "memory_stats", "memory_summary", "empty_cache", "empty_host_cache",
            "reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached",
            "reset_accumulated_memory_stats")
_CUDA_CALLS = {
    **{f"torch.cuda.{n}": f"cuda_{n}" for n in (
        "is_available", "device_count", "current_device", "set_device", "synchronize", "device")},
    "torch.cuda.Stream": "stream_new", "torch.cuda.Event": "event_new", "torch.cuda.stream": "stream_use",
    "torch.cuda.current_stream": "stream_current", "torch.cuda.default_stream": "stream_current",
    "torch.cuda.set_stream": "stream_set",
    "torch.accelerator.is_available": "cuda_is_available", "torch.accelerator.device_count": "cuda_device_count",
    "torch.accelerator.current_device_index": "cuda_current_device",
    "torch.accelerator.current_device_idx": "cuda_current_device",
    "torch.accelerator.set_device_index": "cuda_set_device", "torch.accelerator.set_device_idx": "cuda_set_device",
    "torch.accelerator.synchronize": "cuda_synchronize", "torch.accelerator.device_index": "cuda_device",
    "torch.accelerator.current_accelerator": "accelerator", "torch.accelerator.current_stream": "stream_current",
    "torch.accelerator.set_stream": "stream_set",
    "torch.set_default_tensor_type": "default_tensor_type",   # the pre-2.1 way to make CUDA the default
    "torch.typename": "typename",   # ``x.type()`` for a tensor: the same answer (CudaCalls.type_name)
    # Mixed precision names a device type: 'cuda' means DEVICE's (see CudaCalls.amp).
    "torch.autocast": "amp", "torch.amp.autocast": "amp", "torch.amp.GradScaler": "amp",
    "torch.cuda.amp.autocast": "amp_cuda_autocast", "torch.cuda.amp.GradScaler": "amp_cuda_scaler",
    # A name one of the two lacks still fails as written: the original is looked up first.
    **{f"torch.{api}.{n}": "query" for api in ("cuda", "accelerator") for n in _QUERIES},
    # replicate / scatter / parallel_apply / gather, nn.DataParallel: on one device (parallel).
    **PARALLEL_CALLS,
}
_ACCELERATOR = "torch.accelerator.current_accelerator"
_DEVICE_KEYWORDS = ("device", "map_location")
# ``x.to(torch.float16)`` needs no help: these keywords and dtype names never name a device.
_TO_HARMLESS_KEYWORDS = frozenset({"dtype", "non_blocking", "copy", "memory_format"})
_CONVENTIONAL = {"torch": "torch", "nn": "torch.nn"}
_METHOD_VALUES = ("cuda", "to")   # methods that place, also when taken as values (Placement.method)
_UNBOUND = {"torch.Tensor.cuda": "cuda", "torch.nn.Module.cuda": "base_cuda",
            "torch.Tensor.to": "to", "torch.nn.Module.to": "to"}


def is_cuda_name(value) -> bool:
    """``'cuda'``, ``'cuda:1'`` (what torch.device parses as CUDA)."""
    return isinstance(value, str) and (value == "cuda" or value.startswith("cuda:"))


def is_cuda_type_name(name) -> bool:
    """``'torch.cuda.FloatTensor'`` and the other CUDA typed-tensor names."""
    return name in _LEGACY_CUDA


def _is_cuda_constant(value) -> bool:
    # An int device is a CUDA index for torch (``device=0`` is cuda:0).
    return is_cuda_name(value) or (isinstance(value, int) and not isinstance(value, bool))


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
        obj = lookup(name)
        if obj is not None:
            known[id(obj)] = name
    _KNOWN = known
    return known


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
        self._kept: set[int] = set()   # ids of typed-tensor names a call rewrites itself (see visit_Call)
        self._called: set[int] = set()  # ids of ``x.cuda`` / ``x.to`` a call rewrites itself

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
    def _typed_tensor(self, node):
        """A bare ``torch.cuda.FloatTensor`` (``T = torch.cuda.FloatTensor``, ``x.type(dtype)``) -> a stand-in."""
        if isinstance(node.ctx, ast.Load) and id(node) not in self._kept and self._dotted(node) in _LEGACY_CUDA:
            return self._call("tensor_type", [node], [], node)
        return node

    def visit_Name(self, node: ast.Name):
        return self._typed_tensor(node)

    def visit_Attribute(self, node: ast.Attribute):
        inner = node.value
        if node.attr == "type" and isinstance(node.ctx, ast.Load) and isinstance(inner, ast.Call) \
                and self._dotted(inner.func) == _ACCELERATOR:
            # The quickstart's ``current_accelerator().type``: a device name that stays the cell's device.
            args = [self.visit(a) for a in inner.args]
            for kw in inner.keywords:
                kw.value = self.visit(kw.value)
            return self._call("accelerator_type", [inner.func, *args], inner.keywords, node)
        self.generic_visit(node)
        if node.attr == "is_cuda" and isinstance(node.ctx, ast.Load) and self._dotted(node.value) is None:
            return self._call("is_cuda", [node.value], [], node)
        if node.attr in _METHOD_VALUES and isinstance(node.ctx, ast.Load) and id(node) not in self._called:
            # ``map(torch.Tensor.cuda, batch)``, ``move = x.cuda``: taken as a value, not called here.
            dotted = self._dotted(node)
            if dotted in _UNBOUND or self._dotted(node.value) is None:
                return self._call("method", [node.value, ast.copy_location(ast.Constant(node.attr), node)], [], node)
        return self._typed_tensor(node)

    def visit_Call(self, node: ast.Call):
        folded = self._fold(node)
        if folded is not None:
            return folded
        name = self._dotted(node.func)
        self._keep_cuda_types(node, name)
        magic = self._magic(node)
        if magic is not None:
            return magic
        if isinstance(node.func, ast.Attribute) and node.func.attr in _METHOD_VALUES:
            self._called.add(id(node.func))
        if self._getattr_method(node):
            self.generic_visit(node)
            return self._call("method", node.args, [], node)
        self.generic_visit(node)
        func = node.func
        # ``.to(device=...)`` maps its own device keyword, seeing what the user asked for (Placement.to).
        to_call = _UNBOUND.get(name) == "to" if name is not None else \
            isinstance(func, ast.Attribute) and func.attr == "to"
        # What a factory, ``nn`` layer or typed constructor makes on a device it is given is remembered
        # as on CUDA when that device is (gpumagic.cell.rewrite.placed); they see the device as written.
        own = name is not None and self._kw(node, "device") is not None and (
            name in _LEGACY_CUDA or name in _LEGACY_CPU or name in FACTORIES or name in LIKE_FACTORIES
            or (name.startswith("torch.nn.") and takes_device(name)))
        if not to_call:
            self._rewrite_keywords(node, device=not own)
        if name is None:
            return self._method(node, func) if isinstance(func, ast.Attribute) else node
        return self._named_call(node, name, own)

    def _keep_cuda_types(self, node: ast.Call, name: str | None) -> None:
        """``torch.cuda.FloatTensor(...)`` and ``x.type(torch.cuda.HalfTensor)`` are rewritten as calls: their
        CUDA type names are kept as they are written."""
        func = node.func
        if name in _LEGACY_CUDA:
            self._kept.add(id(func))
        elif isinstance(func, ast.Attribute) and func.attr == "type" and len(node.args) == 1 \
                and self._is_cuda_type(node.args[0]):
            self._kept.add(id(node.args[0]))

    def _named_call(self, node: ast.Call, name: str, own: bool):
        """A call of a torch name (``torch.device(...)``, a factory, a ``torch.cuda`` call...), rewritten;
        ``own``: a maker given a device of its own (:meth:`_made_on`)."""
        func = node.func
        if name in _UNBOUND and node.args:
            return self._call(_UNBOUND[name], node.args, node.keywords, node)
        if name == "torch.device":
            return self._call("device", node.args, node.keywords, node)
        if name in _LEGACY_CUDA or (name in _LEGACY_CPU and self._kw(node, "device")):
            return self._call("legacy", [func, *node.args], node.keywords, node)
        if own:
            return self._made_on(node, name)
        if name in _CUDA_CALLS:
            return self._call(_CUDA_CALLS[name], [func, *node.args], node.keywords, node)
        if name in LIKE_FACTORIES:
            if node.args and not any(k.arg in ("device", None) for k in node.keywords):
                return self._call("like", [func, *node.args], node.keywords, node)
            return node
        if name in FACTORIES or (name.startswith("torch.nn.") and takes_device(name)):
            if not any(k.arg in _NO_DEVICE_WITH for k in node.keywords):
                self._add_device(node)
            return node
        self._map_locations(node, name)
        return node

    def _map_locations(self, node: ast.Call, name: str) -> None:
        """``torch.set_default_device(d)`` and ``torch.load(f, map_location)`` map their device; a ``torch.load``
        without one loads onto DEVICE (a checkpoint saved on a GPU would come back on that GPU)."""
        if name == "torch.set_default_device" and node.args:
            node.args[0] = ast.copy_location(ast.Call(self._h("map"), [node.args[0]], []), node.args[0])
        elif name == "torch.load" and len(node.args) > 1:
            node.args[1] = ast.copy_location(ast.Call(self._h("map"), [node.args[1]], []), node.args[1])
        elif name == "torch.load" and not any(k.arg is None for k in node.keywords):
            given = self._kw(node, "map_location")
            value = ast.copy_location(self._h("load_location"), node)
            if given is None:
                node.keywords.append(ast.copy_location(ast.keyword(arg="map_location", value=value), node))
            elif isinstance(given.value, ast.Constant) and given.value.value is None:
                given.value = value

    def _getattr_method(self, node: ast.Call) -> bool:
        """``getattr(x, 'cuda')`` or ``getattr(x, 'to', None)``, with the builtin ``getattr``."""
        func = node.func
        if not (isinstance(func, ast.Name) and func.id == "getattr" and 2 <= len(node.args) <= 3
                and not node.keywords and (self.namespace is None or "getattr" not in self.namespace)):
            return False
        name = node.args[1]
        return isinstance(name, ast.Constant) and name.value in _METHOD_VALUES \
            and not any(isinstance(a, ast.Starred) for a in node.args)

    def _made_on(self, node: ast.Call, name: str):
        """``torch.ones(2, device='cuda')`` -> ``H.on_cuda(torch.ones(2, device=H.target or 'cuda'))``;
        ``torch.ones(2, device=dev)`` -> ``H.factory(torch.ones, 2, device=dev)``; ``device='cpu'`` stays."""
        value = self._kw(node, "device").value
        if isinstance(value, ast.Constant) and (name not in _MAY_ALIAS or not _is_cuda_constant(value.value)):
            self._rewrite_keywords(node)
            return self._call("on_cuda", [node], [], node) if _is_cuda_constant(value.value) else node
        return self._call("factory", [node.func, *node.args], node.keywords, node)

    def _method(self, node: ast.Call, func: ast.Attribute):
        """``obj.cuda()``, ``obj.to(...)``, ``obj.type(torch.cuda.X)``, ``obj.type()``, ``obj.pin_memory()``,
        ``obj.get_device()``, ``obj.record_stream(s)``."""
        attr, receiver = func.attr, func.value
        if attr == "cuda":
            return self._call("cuda", [receiver, *node.args], node.keywords, node)
        if attr == "to" and self._to_may_move(node):
            return self._call("to", [receiver, *node.args], node.keywords, node)
        if attr == "type" and len(node.args) == 1 and not node.keywords and self._type_may_be_cuda(node.args[0]):
            return self._call("retype", [receiver, node.args[0]], [], node)
        if attr == "type" and not node.args and not node.keywords:
            return self._call("type_name", [receiver], [], node)
        if attr == "pin_memory" and not node.args and not node.keywords:
            return self._call("pin_memory", [receiver], [], node)
        if attr == "get_device" and not node.args and not node.keywords:
            return self._call("get_device", [receiver], [], node)
        if attr == "record_stream" and len(node.args) == 1 and not node.keywords:
            return self._call("record_stream", [receiver, node.args[0]], [], node)
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
            if torch is not None and isinstance(lookup(dotted), torch.dtype):
                return False
        return True

    def _is_cuda_type(self, node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in _LEGACY_CUDA
        return self._dotted(node) in _LEGACY_CUDA

    def _type_may_be_cuda(self, node) -> bool:
        """``x.type(T)``: T may be a CUDA type held in a name (``dtype = torch.cuda.FloatTensor``)."""
        if isinstance(node, ast.Constant):
            return node.value in _LEGACY_CUDA
        dotted = self._dotted(node)
        if dotted is None or dotted in _LEGACY_CUDA:
            return True
        if dotted in _LEGACY_CPU:
            return False
        torch = sys.modules.get("torch")
        return not (torch is not None and isinstance(lookup(dotted), torch.dtype))

    def _magic(self, node: ast.Call):
        """``%timeit``, ``%time``, ``%prun`` (and their cell forms) inside the cell: their code too."""
        changed = rewrite_magic_call(node, self._rewrite_code)
        if changed is None:
            return None
        self.rewrites += 1
        self.nested = self.nested or bool(self._depth)
        return changed

    def _rewrite_code(self, tree: ast.Module) -> int:
        inner = PlacementRewriter(self.namespace, self.helper)
        inner._resolver = _Resolver(tree, self.namespace)
        if self._resolver is not None:   # the cell's imports hold in the magic's code too
            inner._resolver.imports = {**self._resolver.imports, **inner._resolver.imports}
        inner.visit(tree)
        self.nested = self.nested or inner.nested
        return inner.rewrites

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
        if name in FACTORIES and name not in _MAY_ALIAS and not any(k.arg in _NO_DEVICE_WITH for k in inner.keywords):
            self.generic_visit(inner)
            self._rewrite_keywords(inner)
            self._add_device(inner, "cuda_target")
            return self._call("on_cuda", [inner], [], node)
        return None

    def _rewrite_keywords(self, node: ast.Call, device: bool = True) -> None:
        for kw in node.keywords:
            value = kw.value
            if kw.arg == "device" and not device:
                continue
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
