"""What an autograd graph keeps alive, for ``%gpumem --vars`` (:mod:`.storages`).

A result kept in a variable (``loss = model(x).sum()``, no ``backward()``) keeps
its ``grad_fn`` graph, and the graph keeps the tensors saved for backward
(activations), the leaves it accumulates into and, for a custom
``autograd.Function``, what its ``ctx`` holds. :class:`GraphWalk` reads them
the way torch stores them: ``SavedTensor.data`` (``_raw_saved_*``), the
tensor or what a ``saved_tensors_hooks`` pack hook returned, never
``_saved_*``, which unpacks and so runs an unpack hook (notebook code; for
activation checkpointing, the forward pass again). Every attribute is read
through torch's own C getters found on the node's class, never a Python
property. Nodes are held only while a walk runs, so nothing stays alive
after it. A C++ node torch shows nothing of (``CppFunction``: TorchScript's
differentiable graphs, a C++ extension's Function) is counted in ``opaque``,
for a note: what it saved is not read.
"""
from __future__ import annotations

import logging
import types
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)

__all__ = ["GraphWalk", "MAX_NODES", "saved_tensors_readable"]

# Nodes read per variable: a training step's graph has thousands; a list of losses kept with
# their graphs (`losses.append(loss)`) can have millions, and reading them would stall the magic.
MAX_NODES = 20_000

_PREFIX = "_raw_saved_"
# A class's MRO and namespace through type's own getters (a metaclass's properties are not asked).
_MRO = vars(type)["__mro__"]
_CLASS_DICT = vars(type)["__dict__"]
_NAME = vars(type)["__name__"]


def saved_tensors_readable(torch) -> bool:
    """True where torch shows a saved tensor's data without unpacking it (``SavedTensor.data`` and
    ``unpack_hook``, in recent torch); elsewhere saved tensors are not read at all."""
    saved = getattr(getattr(torch._C, "_autograd", None), "SavedTensor", None)
    return saved is not None and hasattr(saved, "data") and hasattr(saved, "unpack_hook")


class GraphWalk:
    """The nodes of the graphs one variable reaches, each read once, at most ``max_nodes``.

    :meth:`held` yields ``(kind, value)``: ``"tensor"`` for a tensor torch holds
    (saved, or a leaf it accumulates into), ``"object"`` for anything else the graph
    holds (a pack hook's result, an unpack hook, a ``ctx`` attribute), for the caller
    to read as it reads any object. ``truncated`` says the limit was reached.
    """

    def __init__(self, torch, max_nodes: int):
        self.torch = torch
        self.max_nodes = max_nodes
        self.truncated = False
        self.saw_saved = False   # a saved tensor was met (unread where not `readable`)
        # C++ nodes torch gives no Python view of (TorchScript's DifferentiableGraphBackward, a C++
        # extension's Function): what they saved is not counted. Short node name -> how many.
        self.opaque: dict[str, int] = {}
        self.readable = saved_tensors_readable(torch)
        self._nodes: dict[int, object] = {}   # id -> node: holding them keeps their ids unique
        self._getters: dict[int, tuple] = {}  # id(node class) -> its C getters
        self._saved_type = getattr(getattr(torch._C, "_autograd", None), "SavedTensor", None)
        # Called with (SavedTensor, its tensor) for each saved tensor read without a hook: what moves a
        # graph's saved tensors elsewhere (memory/moving.py) records them through it.
        self.on_saved: Callable[[object, object], None] | None = None

    def held(self, grad_fn) -> Iterator[tuple[str, object]]:
        """What the graph under ``grad_fn`` holds, walking nodes not read before."""
        todo = [grad_fn]
        while todo:
            node = todo.pop()
            if node is None or id(node) in self._nodes:
                continue
            if len(self._nodes) >= self.max_nodes:
                self.truncated = True
                return
            self._nodes[id(node)] = node
            getters = self._node_getters(type(node))
            if getters[4]:
                name = _node_name(node)
                self.opaque[name] = self.opaque.get(name, 0) + 1
            yield from self._node(node, *getters[:4])
            pairs = _read(getters[0], node)
            todo.extend(p[0] for p in pairs or () if type(p) is tuple and p and p[0] is not None)

    def is_node(self, cls) -> bool:
        """True for a graph node's class (``loss.grad_fn``'s, a custom Function's ctx): torch's C getter
        ``next_functions`` is on it."""
        return self._node_getters(cls)[0] is not None

    def is_saved(self, obj) -> bool:
        """True for torch's ``SavedTensor``, which a checkpoint also keeps outside nodes (its inputs)."""
        return self._saved_type is not None and type(obj) is self._saved_type

    def saved(self, item) -> Iterator[tuple[str, object]]:
        """What one ``SavedTensor`` holds (see :meth:`held`), read without unpacking it."""
        self.saw_saved = True
        yield from self._saved(item)

    def _node(self, node, _next, saved, variable, has_dict) -> Iterator[tuple[str, object]]:
        for getter in saved:
            value = _read(getter, node)   # a freed custom Function's saved tensors raise: nothing then
            for item in value if type(value) in (list, tuple) else (value,):
                if self.is_saved(item):
                    yield from self.saved(item)
        leaf = _read(variable, node)
        if leaf is not None:
            yield "tensor", leaf
        # A custom Function's ctx attributes (`ctx.mask = mask`): its instance dict, read as stored.
        for value in list(_instance_dict(node).values()) if has_dict else ():
            yield "object", value

    def _saved(self, saved) -> Iterator[tuple[str, object]]:
        """A saved tensor's data as torch keeps it: the tensor, or a pack hook's result and the unpack hook
        that would turn it back (which may hold tensors of its own: a checkpoint's inputs)."""
        if not self.readable:
            return
        try:   # SavedTensor is torch's own type, never subclassed: no notebook code answers these reads
            data, hook = saved.data, saved.unpack_hook
        except Exception:
            logger.debug("a saved tensor's data is unreadable; skipping it", exc_info=True)
            return
        if data is None:    # freed by backward(), or an optional tensor never given
            return
        if hook is None and issubclass(type(data), self.torch.Tensor):
            if self.on_saved is not None:
                self.on_saved(saved, data)
            yield "tensor", data
            return
        yield "object", data
        if hook is not None:
            yield "object", hook

    def _node_getters(self, cls) -> tuple:
        """``(next_functions, [_raw_saved_* getters], variable, has_dict, opaque)``: the C getters torch
        defines for a node class, first found along its MRO (a subclass's Python property is never
        asked), whether its nodes have an instance dict (a custom Function's ctx; C++ nodes have none)
        and whether it is torch's generic ``CppFunction``, which shows nothing a node saved."""
        known = self._getters.get(id(cls))
        if known is not None:
            return known
        found: dict[str, object] = {}
        has_dict = False
        for klass in _MRO.__get__(cls):
            namespace = _CLASS_DICT.__get__(klass)
            has_dict = has_dict or "__dict__" in namespace
            for name, value in namespace.items():
                if type(value) is types.GetSetDescriptorType and name not in found and \
                        (name.startswith(_PREFIX) or name in ("next_functions", "variable")):
                    found[name] = value
        saved = [g for n, g in found.items() if n.startswith(_PREFIX)]
        # CppFunction cannot be subclassed: a class of that name from torch's C code is that one.
        opaque = _NAME.__get__(cls) == "CppFunction" and _CLASS_DICT.__get__(cls).get("__module__") is None \
            and "next_functions" in found and not saved
        known = self._getters[id(cls)] = (found.get("next_functions"), saved, found.get("variable"), has_dict,
                                          opaque)
        return known

    def release(self) -> None:
        """Let go of the nodes read (the walk is over): nothing of the graph stays alive through it."""
        self._nodes.clear()
        self._getters.clear()   # keyed by id(class): a custom Function's class may go with its nodes


def _node_name(node) -> str:
    """A ``CppFunction``'s C++ class, short (``DifferentiableGraphBackward``), through its own C method."""
    try:
        name = _CLASS_DICT.__get__(type(node))["name"](node)
    except Exception:   # a node torch half built
        logger.debug("an autograd node's name is unreadable", exc_info=True)
        return "CppFunction"
    return name.rsplit("::", 1)[-1] if type(name) is str and name else "CppFunction"


def _read(getter, node):
    """``getter`` (a C getter) on ``node``; None where there is none or it raises."""
    if getter is None:
        return None
    try:
        return getter.__get__(node, type(node))
    except Exception:  # saved tensors already freed by backward(), a node torch half built
        logger.debug("reading an autograd %s failed; skipping it", type(node).__name__, exc_info=True)
        return None


def _instance_dict(obj) -> dict:
    try:
        attrs = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):   # a C++ node: no instance dict
        return {}
    return attrs if type(attrs) is dict else {}
