"""Which tensor storages an object reaches, for ``%gpumem --vars`` (:mod:`.variables`).

The walk reads what objects hold: dict values, list items, ``__dict__`` and
slots, never a property or ``__getattr__`` (they may compute, load or count);
of torch's own objects it asks their API (a module's parameters, an
optimizer's state). Nothing here imports torch: the caller passes it in.
"""
from __future__ import annotations

import logging
import types
from collections import deque
from collections.abc import Iterable

logger = logging.getLogger(__name__)

__all__ = ["Collector"]


class Collector:
    """Storages one variable reaches: key -> (device, bytes, part).

    ``via_optimizer`` holds the parameters (and gradients) an optimizer reaches
    through its param groups: they count for it only where no variable holds them.
    """

    def __init__(self, torch, max_depth: int, max_items: int, slots: dict | None = None):
        self.torch = torch
        self.max_depth = max_depth
        self.max_items = max_items
        self.storages: dict[tuple, tuple[str, int, str]] = {}
        self.via_optimizer: dict[tuple, tuple[str, int, str]] = {}
        self.visited: set[int] = set()
        self._queue: deque = deque()   # (object, depth, part) to read: see walk()
        self.truncated = False
        self.slots = {} if slots is None else slots   # class -> its slot descriptors, shared by a scan
        self.compressed = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
        self.uninitialized = getattr(torch.nn.parameter, "UninitializedTensorMixin", ())

    def add_tensor(self, t, part: str, into: dict | None = None) -> None:
        into = self.storages if into is None else into
        if isinstance(t, self.uninitialized):  # a lazy module's parameter: no memory before its first call
            return
        device = t.device
        if device.type == "meta":  # shapes only, no bytes anywhere
            return
        device = "mps" if device.type == "mps" else str(device)
        try:
            layout = t.layout
            if layout is not self.torch.strided:
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
        except Exception:
            # Wrapper subclasses without a storage: count the elements they expose.
            logger.debug("a %s has no storage to read; counting its elements", type(t).__name__, exc_info=True)
            key = (device, "tensor", id(t))
            try:
                nbytes = int(t.numel() * t.element_size())
            except Exception:  # one unreadable tensor must not hide the rest of the variable
                logger.debug("a %s has no size to read; skipping it", type(t).__name__, exc_info=True)
                return
        known = into.get(key)
        # Two storages can start at one address (torch.from_numpy of an array and of its first half).
        if known is None or nbytes > known[1]:
            into[key] = (device, nbytes, known[2] if known else part)

    def walk(self, obj, depth: int = 0, part: str = "tensors") -> None:
        """Read ``obj`` and what it holds, breadth first: each object where it is nearest the top
        (first reached deep, through a back reference, its contents were cut at ``max_depth``)."""
        self._queue.clear()
        self._reach(obj, depth, part)
        while self._queue:
            self._visit(*self._queue.popleft())

    def _reach(self, obj, depth: int, part: str) -> None:
        """A tensor is counted now; a holder is read once its turn comes."""
        # type(), never isinstance(): isinstance reads obj.__class__, which a proxy answers with code
        # of its own (a lazy object loads itself); the scan must run nothing of the notebook's.
        cls = type(obj)
        if issubclass(cls, self.torch.Tensor):
            self.add_tensor(obj, part)
            if (obj.is_leaf or obj.retains_grad) and obj.grad is not None:
                self.add_tensor(obj.grad, "grads")
        elif cls not in _ATOMS and depth <= self.max_depth and id(obj) not in self.visited:
            self._queue.append((obj, depth, part))

    def _visit(self, obj, depth: int, part: str) -> None:
        if id(obj) in self.visited:
            return
        self.visited.add(id(obj))
        torch = self.torch
        cls = type(obj)
        if issubclass(cls, torch.nn.Module):
            self._module(obj, depth)
            return
        if issubclass(cls, torch.optim.Optimizer):
            self._optimizer(obj, depth)
            return
        items: Iterable
        if issubclass(cls, dict):
            items = dict.values(obj)  # the stored values, not what an overridden values() computes
        elif issubclass(cls, (list, tuple, set, frozenset)):
            base = next(b for b in (list, tuple, set, frozenset) if issubclass(cls, b))
            items = base.__iter__(obj)
        elif issubclass(cls, types.GeneratorType):
            # A started generator keeps its locals (a batch, a model) alive; never iterate it.
            frame = obj.gi_frame
            items = list(frame.f_locals.values()) if frame is not None else ()
        elif not issubclass(cls, _NOT_HOLDERS):
            # an object's attributes (a dataset, a loader, a Trainer, an instance of a notebook class)
            items = self._attributes(obj, cls)
        else:
            return
        for i, item in enumerate(items):
            if i >= self.max_items:
                self.truncated = True
                break
            self._reach(item, depth + 1, part)

    def _module(self, module, depth: int) -> None:
        for p in module.parameters():
            self.add_tensor(p, "params")
        for b in module.buffers():
            self.add_tensor(b, "buffers")
        for p in module.parameters():
            if p.grad is not None:
                self.add_tensor(p.grad, "grads")
        # Tensors kept as plain attributes (a cache, a mask not registered as a buffer, layers
        # in a plain list) hold memory too; the registries were counted above.
        for sub in module.modules():
            attrs = self._attributes(sub, type(sub))
            registries = [vars(sub).get(k) for k in _MODULE_REGISTRIES]
            for value in attrs:
                if not any(value is r for r in registries):
                    self._reach(value, depth + 1, "tensors")

    def _optimizer(self, opt, depth: int) -> None:
        # Its own memory is the state; its parameters belong to their model (see variable_memory).
        for state in list(opt.state.values()):
            for value in (state.values() if isinstance(state, dict) else (state,)):
                self._reach(value, depth + 1, "state")
        for group in list(getattr(opt, "param_groups", ())):
            for p in group.get("params", ()) if isinstance(group, dict) else ():
                if issubclass(type(p), self.torch.Tensor):
                    self.add_tensor(p, "params", self.via_optimizer)
                    if p.grad is not None:
                        self.add_tensor(p.grad, "grads", self.via_optimizer)

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
        slots = self.slots.get(cls)
        if slots is None:
            slots = self.slots[cls] = tuple(
                d for k in cls.__mro__ if "__slots__" in vars(k)
                for d in vars(k).values() if type(d) is types.MemberDescriptorType)
        for descriptor in slots:
            try:
                values.append(descriptor.__get__(obj, cls))
            except AttributeError:  # a slot never set
                pass
        return values


# Objects whose attributes are not data a variable holds: modules, classes, functions.
_NOT_HOLDERS = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
# Values that hold no other object: not worth remembering as visited.
_ATOMS = frozenset({str, bytes, int, float, complex, bool, type(None)})
# A torch Module's registries of parameters, buffers and submodules, counted through its own API.
_MODULE_REGISTRIES = ("_parameters", "_buffers", "_modules")
