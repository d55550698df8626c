"""Which tensor storages an object reaches, for ``%gpumem --vars`` (:mod:`.variables`).

The walk reads what objects hold: dict values, list and deque items,
``__dict__`` and slots, never a property, ``__getattr__`` or an overridden
method (they may compute, load or count): a module's parameters come from
its registries, an optimizer's state from its ``__dict__``, a tensor
subclass is read with its ``__torch_function__`` switched off. Callables
hold what they will use: a function its closure cells, defaults and
attributes (never its globals: that is the notebook itself), a bound method
its ``__self__``, a ``functools.partial`` its function and arguments; a
class defined in the notebook its class attributes; a kept error its
traceback's frames. A tensor with a ``grad_fn`` holds its autograd graph's saved
tensors (:mod:`.autograd_graph`): they go to ``via_graph``, part ``autograd``.
numpy arrays count their buffer on the cpu. Nothing
here imports torch or numpy: the caller passes torch in, and numpy is read
only where the notebook imported it.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import sys
import types
from collections import deque
from collections.abc import Iterable
from typing import Any

from . import autograd_graph
from .autograd_graph import GraphWalk

logger = logging.getLogger(__name__)

__all__ = ["Collector", "AUTOGRAD"]

# The part of what an autograd graph keeps alive: tensors saved for backward (activations), the
# leaves it accumulates into, what a custom Function's ctx holds.
AUTOGRAD = "autograd"


class Collector:
    """Storages one variable reaches: key -> (device, bytes, part).

    ``via_optimizer`` holds the parameters (and gradients) an optimizer reaches
    through its param groups, ``via_graph`` what the autograd graphs of the tensors
    reached keep alive (at most ``max_nodes`` nodes read): both count for it only
    where no variable holds them. ``via_optimizer_graph`` holds what the graphs of an
    optimizer's gradients keep (``backward(create_graph=True)``): it counts where no
    variable holds it nor reaches it through a graph of its own (the model's gradients').
    ``skip`` holds ids of objects the walk never enters.
    """

    def __init__(self, torch, max_depth: int, max_items: int, slots: dict | None = None,
                 skip: frozenset[int] = frozenset(), max_nodes: int | None = None):
        self.torch = torch
        self.max_depth = max_depth
        self.max_items = max_items
        self.storages: dict[tuple, tuple[str, int, str]] = {}
        self.via_optimizer: dict[tuple, tuple[str, int, str]] = {}
        self.via_graph: dict[tuple, tuple[str, int, str]] = {}
        self.via_optimizer_graph: dict[tuple, tuple[str, int, str]] = {}
        self._into_graph = self.via_graph   # where part `autograd` goes now: see walk()
        self.graph = GraphWalk(torch, autograd_graph.MAX_NODES if max_nodes is None else max_nodes)
        self._roots: list = []         # grad_fns of tensors reached, read after the objects: see walk()
        self._optimizer_roots: list = []   # grad_fns of an optimizer's gradients, read last
        # ids of objects never entered: the namespace itself and what holds it (the shell), whose
        # contents are every variable's, listed under their own names
        self.visited: set[int] = set(skip)
        self._queue: deque = deque()   # (object, depth, part) to read: see walk()
        self.truncated = False
        # id(class) -> its slot descriptors, shared by a scan. Classes are looked up by id, never
        # hashed: a metaclass's __hash__ is notebook code (and may raise).
        self.slots = {} if slots is None else slots
        self.compressed = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
        self.uninitialized = getattr(torch.nn.parameter, "UninitializedTensorMixin", ())
        numpy = sys.modules.get("numpy")   # never imported here: without it no array exists
        self.ndarray = numpy.ndarray if numpy is not None else None
        # ndarray's own getters, looked up once: a subclass's properties of the same names are not asked
        self._array_get = {k: vars(self.ndarray)[k] for k in _ARRAY_GETTERS} if numpy is not None else {}

    @property
    def graph_truncated(self) -> bool:
        """True where an autograd graph had more than ``max_nodes`` nodes: the rest were not read."""
        return self.graph.truncated

    def add_tensor(self, t, part: str, into: dict | None = None) -> None:
        if into is None:
            into = self._into_graph if part == AUTOGRAD else self.storages
        if isinstance(t, self.uninitialized):  # a lazy module's parameter: no memory before its first call
            return
        device = t.device
        if device.type == "meta":  # shapes only, no bytes anywhere
            return
        device = "mps" if device.type == "mps" else str(device)
        try:
            layout = t.layout
            if layout is not self.torch.strided:
                self._seen(t, None)
                if t.is_sparse:
                    self.add_tensor(t._indices(), part, into)
                    self.add_tensor(t._values(), part, into)
                    return
                if layout in self.compressed:
                    compressed, plain = ((t.crow_indices(), t.col_indices())
                                         if layout in (self.torch.sparse_csr, self.torch.sparse_bsr)
                                         else (t.ccol_indices(), t.row_indices()))
                    for piece in (compressed, plain, t.values()):
                        self.add_tensor(piece, part, into)
                    return
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            key: tuple = (device, ptr)
            nbytes = int(storage.nbytes())
            if ptr == 0:  # empty storages all sit at 0
                key = (device, "empty", id(storage))
            self._seen(t, key)
        except Exception:
            # Wrapper subclasses without a storage: count the elements they expose.
            logger.debug("a %s has no storage to read; counting its elements", type(t).__name__, exc_info=True)
            key = (device, "tensor", id(t))
            try:
                nbytes = int(t.numel() * t.element_size())
            except Exception:  # one unreadable tensor must not hide the rest of the variable
                logger.debug("a %s has no size to read; skipping it", type(t).__name__, exc_info=True)
                return
            self._seen(t, None)
        self._add(into, key, device, nbytes, part)

    def _seen(self, t, key: tuple | None) -> None:
        """Called for each tensor object counted, with its storage's key (None: no plain storage to
        count it by: sparse, a wrapper subclass). A subclass that must act on tensors records them."""

    @staticmethod
    def _add(into: dict, key: tuple, device: str, nbytes: int, part: str) -> None:
        known = into.get(key)
        # Two storages can start at one address (torch.from_numpy of an array and of its first half).
        if known is None or nbytes > known[1]:
            into[key] = (device, nbytes, known[2] if known else part)

    def add_array(self, a, depth: int, part: str) -> None:
        """A numpy array: the buffer it keeps alive, read through ndarray's own getters (a subclass's
        properties are not asked). A view counts its whole base, as a tensor view its storage; an
        array over a tensor (``t.numpy()``) counts the tensor's storage; one over a file (``np.memmap``)
        counts nothing: its pages are the file's, not the kernel's memory."""
        nd: Any = self.ndarray   # set: only arrays get here
        getter = self._array_get
        root, base = a, getter["base"].__get__(a, nd)
        while base is not None and issubclass(type(base), nd):
            root, base = base, getter["base"].__get__(base, nd)
        if issubclass(type(base), self.torch.Tensor):
            self.add_tensor(base, part)
        elif not issubclass(type(base), mmap.mmap):
            ptr = getter["__array_interface__"].__get__(root, nd)["data"][0]
            nbytes = int(getter["nbytes"].__get__(root, nd))
            self._add(self.storages, ("cpu", ptr) if ptr else ("cpu", "empty", id(root)), "cpu", nbytes, part)
        if getter["dtype"].__get__(a, nd).hasobject and depth < self.max_depth and id(a) not in self.visited:
            # An array of Python objects holds them (tensors among them, sometimes).
            self.visited.add(id(a))
            for i, item in enumerate(getter["flat"].__get__(a, nd)):
                if i >= self.max_items:
                    self.truncated = True
                    break
                self._reach(item, depth + 1, "tensors" if part == "arrays" else part)

    def walk(self, obj, depth: int = 0, part: str = "tensors") -> None:
        """Read ``obj`` and what it holds, breadth first: each object where it is nearest the top
        (first reached deep, through a back reference, its contents were cut at ``max_depth``)."""
        self._queue.clear()
        # A tensor subclass's __torch_function__ is notebook code, run by every attribute read
        # (t.device, t.grad): switched off for the walk, the reads answer what torch holds.
        plain = getattr(self.torch._C, "DisableTorchFunctionSubclass", contextlib.nullcontext)
        try:
            with plain():
                self._reach(obj, depth, part)
                self._drain()
                if self._optimizer_roots:
                    # Read apart and last: a node read before (the model's gradients') stays there.
                    self._roots, self._optimizer_roots = self._optimizer_roots, []
                    self._into_graph = self.via_optimizer_graph
                    self._drain()
        finally:
            self._into_graph = self.via_graph
            self._roots.clear()
            self._optimizer_roots.clear()
            self.graph.release()   # the nodes read: nothing of a graph stays alive through the report

    def _drain(self) -> None:
        """Read the queued objects, then the graphs. Graphs are read once the objects are (a graph
        adds objects, never nests a graph's walk in another's: a deep graph cannot exhaust the stack)."""
        while self._queue or self._roots:
            while self._queue:
                self._visit(*self._queue.popleft())
            if self._roots:
                self._graph(self._roots.pop())

    def _graph(self, grad_fn) -> None:
        """What the graph under ``grad_fn`` keeps alive, into ``via_graph`` (part ``autograd``), or
        ``via_optimizer_graph`` for an optimizer's gradients."""
        self._held(self.graph.held(grad_fn))

    def _held(self, held: Iterable) -> None:
        """Count what a graph (or a ``SavedTensor`` outside one) holds: ``(kind, value)`` pairs.

        Its objects (hooks' closures, a checkpoint's frame, ctx attributes) are read from depth 1
        wherever the result sits: the graph is bounded by ``max_nodes``, and a loss kept deep in a
        history must cost what it costs as a variable."""
        for kind, value in held:
            if kind == "tensor":
                self.add_tensor(value, AUTOGRAD)
                self._add_grad(self._grad(value), AUTOGRAD)
            else:
                self._reach(value, 1, AUTOGRAD)

    def _add_grad(self, grad, part: str, into: dict | None = None) -> None:
        """A gradient, and the graph it keeps where ``backward(create_graph=True)`` made it."""
        if grad is None:
            return
        self.add_tensor(grad, part, into)
        try:
            grad_fn = grad.grad_fn
        except Exception:   # a wrapper subclass without autograd metadata
            logger.debug("a %s gradient has no grad_fn to read", type(grad).__name__, exc_info=True)
            return
        if grad_fn is not None:
            (self._optimizer_roots if into is self.via_optimizer else self._roots).append(grad_fn)

    def _grad(self, t):
        """``t.grad`` where torch keeps one (a leaf's, or a tensor that retains it)."""
        try:
            return t.grad if t.is_leaf or t.retains_grad else None
        except Exception:   # a wrapper subclass without autograd metadata
            logger.debug("a %s has no gradient to read", type(t).__name__, exc_info=True)
            return None

    def _add_graph_root(self, t) -> None:
        """A non-leaf tensor keeps its graph: read it once the walk's objects are read."""
        try:
            grad_fn = t.grad_fn
        except Exception:
            logger.debug("a %s has no grad_fn to read", type(t).__name__, exc_info=True)
            return
        if grad_fn is not None:
            self._roots.append(grad_fn)

    def _reach(self, obj, depth: int, part: str) -> None:
        """A tensor is counted now; a holder is read once its turn comes."""
        # type(), never isinstance(): isinstance reads obj.__class__, which a proxy answers with code
        # of its own (a lazy object loads itself); the scan must run nothing of the notebook's.
        cls = type(obj)
        if issubclass(cls, self.torch.Tensor):
            self.add_tensor(obj, part)
            # One read tells both (a leaf is a tensor without grad_fn): this runs for every tensor reached.
            grad_fn = obj.grad_fn
            if grad_fn is None:
                grad = obj.grad
            else:
                grad = obj.grad if obj.retains_grad else None
                self._roots.append(grad_fn)   # it keeps its graph: read once the objects are
            self._add_grad(grad, AUTOGRAD if part == AUTOGRAD else "grads")
        elif self.ndarray is not None and issubclass(cls, self.ndarray):
            self.add_array(obj, depth, "arrays" if part == "tensors" else part)
        elif self.graph.is_saved(obj):
            # A checkpoint keeps its inputs as SavedTensors in a plain list, outside any node.
            self._held(self.graph.saved(obj))
        elif id(cls) not in _ATOMS and depth <= self.max_depth and id(obj) not in self.visited:
            self._queue.append((obj, depth, part))

    def _visit(self, obj, depth: int, part: str) -> None:
        if id(obj) in self.visited:
            return
        self.visited.add(id(obj))
        torch = self.torch
        cls = type(obj)
        if issubclass(cls, torch.nn.Module):
            self._module(obj, depth, part)
            return
        if issubclass(cls, torch.optim.Optimizer):
            self._optimizer(obj, depth, part)
            return
        if self.graph.is_node(cls):
            # A graph node kept itself (`node = loss.grad_fn`, a custom Function's ctx): it is the graph.
            self._roots.append(obj)
            return
        for i, item in enumerate(self._contents(obj, cls)):
            if i >= self.max_items:
                self.truncated = True
                break
            self._reach(item, depth + 1, part)

    def _contents(self, obj, cls) -> Iterable:
        """What ``obj`` holds, read through its base type's own machinery (never notebook code)."""
        if issubclass(cls, dict):
            return dict.values(obj)  # the stored values, not what an overridden values() computes
        if issubclass(cls, _SEQUENCES):
            # the base type's iterator: a subclass's __iter__ is notebook code. A deque (a replay
            # buffer, the last losses) is copied first: iterating one that grows raises.
            base = next(b for b in _SEQUENCES if issubclass(cls, b))
            return list(deque.__iter__(obj)) if base is deque else base.__iter__(obj)
        if id(cls) in _CALLABLES:
            return _callable_parts(obj, cls)
        if issubclass(cls, functools.partial):
            return [*_partial_parts(obj), *self._attributes(obj, cls)]
        if issubclass(cls, types.GeneratorType):
            # A started generator keeps its locals (a batch, a model) alive; never iterate it.
            frame = obj.gi_frame
            return list(frame.f_locals.values()) if frame is not None else ()
        if issubclass(cls, BaseException):
            # A kept error keeps its traceback's frames, and their locals (a batch, activations), alive.
            return [*(_BASE_ERROR[k].__get__(obj) for k in ("__traceback__", "__cause__", "__context__")),
                    *_BASE_ERROR["args"].__get__(obj), *self._attributes(obj, cls)]
        if cls is types.TracebackType or cls is types.FrameType:
            return self._trace_contents(obj, cls)
        if issubclass(cls, type):
            # A notebook's class keeps its class attributes (a cache shared by every instance);
            # a library's classes hold no notebook memory and would only slow the scan.
            attrs = _CLASS_DICT.__get__(obj)
            return list(attrs.values()) if attrs.get("__module__") == "__main__" else ()
        if not issubclass(cls, _NOT_HOLDERS):
            # an object's attributes (a dataset, a loader, a Trainer, an instance of a notebook class)
            return self._attributes(obj, cls)
        return ()

    def _trace_contents(self, obj, cls) -> list:
        """A traceback's frames, or a frame's locals."""
        if cls is types.TracebackType:
            # every frame of the chain one level down: a deep traceback is one list, not a nesting
            frames: list = []
            while obj is not None and len(frames) <= self.max_items:
                frames.append(obj.tb_frame)
                obj = obj.tb_next
            return frames
        # its locals, not f_back: the frames that called it are alive anyway, or in this traceback.
        # A module-level frame (a cell's own) has its module's globals, the notebook's namespace,
        # as locals: those live on without the frame and are the variables' to count.
        locals_ = obj.f_locals
        return [] if locals_ is obj.f_globals else list(locals_.values())

    def _module(self, module, depth: int, part: str = "tensors") -> None:
        # The registries themselves, read from each module's __dict__: parameters(), buffers() and
        # modules() are methods a subclass may override (notebook code), and they raise on a module
        # whose __init__ never called Module.__init__, whose tensors are memory all the same.
        Tensor = self.torch.Tensor
        params: list = []
        buffers: list = []
        others: list = []
        todo, seen = [module], set()
        while todo:
            m = todo.pop()
            if id(m) in seen:
                continue
            seen.add(id(m))
            attrs = _instance_dict(m)
            registries = [attrs.get(k) for k in _MODULE_REGISTRIES]
            found = self._registries(m, registries)
            params.extend(t for t in found[0] if issubclass(type(t), Tensor))
            buffers.extend(t for t in found[1] if issubclass(type(t), Tensor))
            todo.extend(sub for sub in found[2] if issubclass(type(sub), self.torch.nn.Module))
            # Tensors kept as plain attributes (a cache, a mask not registered as a buffer, layers
            # in a plain list) hold memory too.
            others.extend(v for v in self._attributes(m, type(m)) if not any(v is r for r in registries))
        self.visited.update(seen)
        for p in params:
            self.add_tensor(p, _within(part, "params"))
        for b in buffers:
            self.add_tensor(b, _within(part, "buffers"))
            self._add_graph_root(b)   # a buffer assigned an undetached result keeps its graph
        for p in params:
            self._add_grad(p.grad, _within(part, "grads"))
        for value in others:
            self._reach(value, depth + 1, _within(part, "tensors"))

    def _registries(self, m, registries: list) -> tuple[list, list, list]:
        """``m``'s own parameters, buffers and submodules.

        A TorchScript module keeps them in C++ (wrappers, or nothing, in its ``__dict__``): torch's
        own API reads them there, and no notebook class can stand behind it.
        """
        if all(issubclass(type(r), dict) for r in registries) or \
                not issubclass(type(m), self.torch.jit.ScriptModule):
            return _dict_values(registries[0]), _dict_values(registries[1]), _dict_values(registries[2])
        try:
            return (list(m.parameters(recurse=False)), list(m.buffers(recurse=False)),
                    [sub for _, sub in m.named_children()])
        except Exception:  # a half-built script module; its plain attributes are still read
            logger.debug("a %s does not list its parameters; reading its attributes only",
                         type(m).__name__, exc_info=True)
            return [], [], []

    def _optimizer(self, opt, depth: int, part: str = "tensors") -> None:
        # Its own memory is the state; its parameters belong to their model (see variable_memory).
        # state and param_groups come from its __dict__ (a wrapper may make them properties); its
        # other attributes are read too: a wrapper keeps the optimizer it wraps there.
        attrs = _instance_dict(opt)
        for state in list(_dict_values(attrs.get("state"))):
            for value in (_dict_values(state) if issubclass(type(state), dict) else (state,)):
                self._reach(value, depth + 1, _within(part, "state"))
        via = None if part == AUTOGRAD else self.via_optimizer   # a graph's: via_graph already
        groups: Any = attrs.get("param_groups")
        for group in list(groups) if issubclass(type(groups), list) else ():
            params = dict.get(group, "params", ()) if issubclass(type(group), dict) else ()
            for p in list(params) if issubclass(type(params), (list, tuple)) else ():
                if issubclass(type(p), self.torch.Tensor):
                    self.add_tensor(p, _within(part, "params"), via)
                    self._add_grad(p.grad, _within(part, "grads"), via)
        for key, value in attrs.items():
            if key not in ("state", "param_groups"):
                self._reach(value, depth + 1, _within(part, "tensors"))

    def _attributes(self, obj, cls) -> list:
        """The values in ``obj.__dict__`` and its slots, read without running the notebook's code.

        ``getattr(obj, "__dict__")`` would call a class's ``__getattr__`` where there is no
        ``__dict__``; properties are never read (they may compute, or have side effects).
        """
        values: list = []
        try:
            attrs = object.__getattribute__(obj, "__dict__")
        except (AttributeError, TypeError):  # no __dict__: __slots__ only, or a builtin
            attrs = None
        if type(attrs) is dict:
            values.extend(attrs.values())
        slots = self.slots.get(id(cls))
        if slots is None:
            slots = self.slots[id(cls)] = tuple(
                d for k in cls.__mro__ if "__slots__" in vars(k)
                for d in vars(k).values() if type(d) is types.MemberDescriptorType)
        for descriptor in slots:
            try:
                values.append(descriptor.__get__(obj, cls))
            except AttributeError:  # a slot never set
                pass
        return values


def _within(part: str, kind: str) -> str:
    """The part of a module's or optimizer's ``kind`` of tensor: ``autograd`` inside what a graph holds
    (a checkpointed block's module), so it counts only where no variable holds it."""
    return AUTOGRAD if part == AUTOGRAD else kind


def _instance_dict(obj) -> dict:
    """``obj.__dict__`` without asking ``__getattr__`` (empty where there is none)."""
    try:
        attrs = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return {}
    return attrs if issubclass(type(attrs), dict) else {}


def _dict_values(d) -> list:
    """A dict's stored values (an overridden ``values()`` is not asked); nothing for a non-dict."""
    return list(dict.values(d)) if issubclass(type(d), dict) else []


def _callable_parts(fn, cls) -> list:
    """What a function or bound method keeps alive, read from the interpreter's own fields.

    These types cannot be subclassed, so no notebook code answers the reads.
    A function's ``__globals__`` is left out: it is the notebook's namespace,
    whose variables are listed under their own names.
    """
    if cls is types.FunctionType:
        parts: list = []
        for cell in fn.__closure__ or ():
            try:
                parts.append(cell.cell_contents)
            except ValueError:  # a cell not bound yet (a name assigned later in the outer function)
                pass
        parts.extend(fn.__defaults__ or ())
        parts.extend((fn.__kwdefaults__ or {}).values())
        attrs = fn.__dict__   # function attributes: __wrapped__ of a decorated function
        parts.extend(dict.values(attrs))
        return parts
    owner = fn.__self__      # a bound method: the object it runs on
    if cls is types.MethodType:
        return [owner, fn.__func__]
    return [] if issubclass(type(owner), types.ModuleType) else [owner]  # a builtin's __self__ may be its module


def _partial_parts(p) -> list:
    """A ``functools.partial``'s function, arguments and keywords, through the base class's
    descriptors (a subclass's ``__getattribute__`` is not asked)."""
    base = functools.partial
    keywords = vars(base)["keywords"].__get__(p, base)
    return [vars(base)["func"].__get__(p, base), *vars(base)["args"].__get__(p, base),
            *(dict.values(keywords) if type(keywords) is dict else ())]


# BaseException's own getters: a subclass's properties of the same names are not asked.
_BASE_ERROR = vars(BaseException)
# Containers read item by item through their base type's iterator.
_SEQUENCES = (list, tuple, set, frozenset, deque)
# What add_array reads of an array.
_ARRAY_GETTERS = ("base", "__array_interface__", "nbytes", "dtype", "flat")
# ids of the callables whose parts _callable_parts reads.
_CALLABLES = frozenset(map(id, (types.FunctionType, types.MethodType, types.BuiltinMethodType,
                               types.MethodWrapperType)))
# A class's own namespace, read through type's getter (a metaclass's properties are not asked).
_CLASS_DICT = vars(type)["__dict__"]
# Objects whose attributes are not data a variable holds.
_NOT_HOLDERS = (types.ModuleType,)
# ids of the types of values that hold no other object: not worth remembering as visited.
_ATOMS = frozenset(map(id, (str, bytes, int, float, complex, bool, type(None))))
# A torch Module's registries of parameters, buffers and submodules, in its __dict__.
_MODULE_REGISTRIES = ("_parameters", "_buffers", "_modules")
