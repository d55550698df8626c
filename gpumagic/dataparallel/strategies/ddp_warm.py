"""``--compile`` on a rank: the model's own forward compiled in place (:func:`compile_forward`), and
kept warm across cells: each rank keeps the model it compiled, and a later cell trains that one.

torch.compile's compiled code hangs off the code objects it traced, and its
guards name the module objects. Every cell the kernel ships the notebook's model
again: cloudpickle gives the rank the same class object for a notebook class it
has seen (its class tracker), but fresh copies of the class's functions and a
new module object, so compiling what arrived traces everything again (seconds on
a GPU, even with inductor's cache supplying the code).

So a rank keeps what it compiled (:class:`WarmModels`, in the worker's state).
When the next cell's model is the same (the same classes; their functions' code,
defaults, closures and the globals they read unchanged; the same submodules,
parameter names, shapes, dtypes and ``requires_grad``; the same DDP options and
compile mode), the rank puts the class's earlier function objects back, copies
the shipped weights and plain attributes into the kept module, and the cell's
name is bound to the kept, compiled wrapper: nothing is traced again. Otherwise
the model is wrapped and compiled anew, and the kept one is let go; the reason
goes into the cell's ``--compile`` note.

Runs in the workers: no IPython.
"""
from __future__ import annotations

import functools
import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["WarmModels", "Adopted", "warm_models", "let_go_of_warm_models", "follow_kept", "compile_forward",
           "forwards_set_aside", "compile_counts", "compile_note"]

_MISSING = object()
_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_OWN_STATE = ("_parameters", "_buffers", "_modules")   # compared and copied tensor by tensor
_ADDED_BY_COMPILE = {"forward"}   # compile_forward's instance attribute
_HEAP_TYPE = 1 << 9   # Py_TPFLAGS_HEAPTYPE: a class defined in Python, not in C


@dataclass
class _Kept:
    wrapper: Any            # what the cell's name was bound to: the compiled DDP wrapper, or the module
    module: Any             # the user's module inside it
    options: tuple          # DDP options, compile mode, device
    param_ids: list         # the module's parameters when the wrapper was built (DDP's buckets hold them)
    methods: dict           # class -> {attribute: function, staticmethod, classmethod or property}


@dataclass
class Adopted:
    """A kept model the cell trains again: bind ``wrapper``; ``replaced`` maps ``id`` of each shipped
    submodule, parameter and buffer to the kept one, so the optimizers can follow."""
    wrapper: Any
    module: Any
    replaced: dict = field(default_factory=dict)
    copied: set = field(default_factory=set)   # (device, data_ptr) of shipped tensors copied, not shared


class WarmModels:
    """The compiled models a rank keeps between ``--compile`` cells, by the cell's name for them.

    >>> warm = WarmModels()                                      # doctest: +SKIP
    >>> found = warm.adopt("model", shipped, options)            # an Adopted, or the reason it is not
    """

    def __init__(self, lost: dict | None = None):
        self.kept: dict[str, _Kept] = {}
        self.lost = dict(lost or {})   # name -> why the model kept for it was let go (for the note)

    def let_go(self, why: str) -> dict:
        """Why each kept model is let go now, or was before, by name: for the next WarmModels' notes."""
        return {**self.lost, **{name: why for name in self.kept}}

    def adopt(self, name: str, module, options: tuple) -> Adopted | str:
        """The kept model for ``name`` with ``module``'s weights, or why it cannot be (it is let go)."""
        kept = self.kept.pop(name, None)
        if kept is None:
            return self.lost.pop(name, "first cell")
        why = _difference(kept, module, options)
        if why:
            return why
        for cls, methods in kept.methods.items():
            for attr, value in methods.items():
                if cls.__dict__.get(attr) is not value:
                    setattr(cls, attr, value)   # the same code; the compiled code hangs off these objects
        adopted = Adopted(kept.wrapper, kept.module)
        _copy_into(kept.module, module, adopted)
        self.kept[name] = kept
        return adopted

    def keep(self, name: str, wrapper, module, options: tuple) -> None:
        """Keep ``wrapper`` (compiled, around ``module``) for the next cell's ``name``."""
        self.kept[name] = _Kept(wrapper, module, options, [id(p) for p in module.parameters()],
                                _methods(module))

    def retain_only(self, names) -> None:
        """Let go of the models no name of this cell asks for (their device memory with them)."""
        for name in [n for n in self.kept if n not in names]:
            del self.kept[name]
            # (a later cell that trains it again compiles it anew: its note says why, not "first cell")
            self.lost[name] = "a cell in between did not train it, which let it go"


def warm_models(ctx, mode: str | None, names) -> WarmModels | None:
    """This rank's kept compiled models, holding only those the cell's ``names`` may train; None (and every
    kept one let go) for a cell without ``--compile`` (``mode`` None)."""
    if not mode:
        let_go_of_warm_models(ctx, "a cell without --compile let the compiled model go")
        return None
    warm = ctx.state.get("warm") or ctx.state.setdefault("warm", WarmModels(ctx.state.pop("warm_lost", None)))
    warm.retain_only(names)
    return warm


def let_go_of_warm_models(ctx, why: str) -> None:
    """Let go of this rank's kept compiled models; the next ``--compile`` cell's note says ``why``."""
    warm = ctx.state.pop("warm", None)
    if warm is not None:
        ctx.state["warm_lost"] = warm.let_go(why)


def follow_kept(ns: dict, replaced: dict) -> None:
    """What refers to the shipped modules' parts refers to the kept models' instead: other names
    (an alias, a submodule), optimizers, modules holding one (``AveragedModel(model)``), and the
    lists, tuples and dicts the notebook keeps them in."""
    from collections import defaultdict

    import torch

    def swap(value):
        return replaced.get(id(value), value)

    for name, value in list(ns.items()):
        if id(value) in replaced:
            ns[name] = replaced[id(value)]
        elif isinstance(value, torch.optim.Optimizer):
            for group in value.param_groups:
                group["params"] = [swap(p) for p in group["params"]]
            value.state = defaultdict(dict, {swap(p): s for p, s in value.state.items()})
        elif isinstance(value, torch.nn.Module):
            for sub in list(value.modules()):
                for table in (sub._modules, sub._parameters, sub._buffers):
                    for key, item in table.items():
                        table[key] = swap(item)
        elif isinstance(value, list):
            for i in [i for i, v in enumerate(value) if id(v) in replaced]:
                value[i] = replaced[id(value[i])]
        elif isinstance(value, tuple) and any(id(v) in replaced for v in value):
            ns[name] = type(value)(*map(swap, value)) if hasattr(value, "_fields") else tuple(map(swap, value))
        elif isinstance(value, dict) and not name.startswith("__"):
            for key in [k for k, v in value.items() if id(v) in replaced]:
                value[key] = replaced[id(value[key])]


def compile_forward(module, mode: str) -> None:
    """``module.forward`` compiled in place, as an instance attribute: the cell's name keeps the
    module it knows, and its ``state_dict`` its keys.

    Not ``module.compile()`` nor ``torch.compile(DDP(module))``: dynamo skips torch's own frames
    (``nn.Module._call_impl``, DDP's forward, ``nn.Sequential.forward``) unless told to compile
    one, so those trace nothing at all for a model made only of torch's layers (an
    ``nn.Sequential`` MLP, an ``nn.TransformerEncoder``). Compiling the model's own ``forward``
    does, whatever its class.

    A model the notebook compiled already (``model = torch.compile(model)``, an ``OptimizedModule``)
    has the model it wraps compiled this way, with ``mode``, and its own forward calls that one
    uncompiled: one compile, the mode the cell asked for.
    """
    import torch

    from .ddp_wrapper import user_module
    target = user_module(module)
    forward = type(target).forward.__get__(target)   # the class's, not an earlier compiled one
    compiled: Any = torch.compile(forward, mode=None if mode == "default" else mode)
    compiled._gpumagic_forward = True   # see forwards_set_aside
    target.forward = compiled
    if target is not module:
        def call_uncompiled(*args, **kwargs):
            return target(*args, **kwargs)
        call_uncompiled._gpumagic_forward = True   # type: ignore[attr-defined]
        module.forward = call_uncompiled


@contextmanager
def forwards_set_aside(modules):
    """The forwards :func:`compile_forward` set, taken off the modules while they are pickled: a
    compiled function does not pickle, and the notebook's module must not get one.

    >>> with forwards_set_aside(inner.values()):      # doctest: +SKIP
    ...     packed = pack(state)
    """
    aside = []
    for module in modules:
        for sub in module.modules():
            if getattr(sub.__dict__.get("forward"), "_gpumagic_forward", False):
                aside.append((sub, sub.__dict__.pop("forward")))
    try:
        yield
    finally:
        for sub, forward in aside:
            sub.__dict__["forward"] = forward


def compile_counts() -> tuple[int, int]:
    """(graphs dynamo traced, graphs inductor compiled rather than took from its cache) so far."""
    from torch._dynamo.utils import counters
    inductor = counters["inductor"]
    return (int(counters["stats"]["unique_graphs"]),
            int(inductor["fxgraph_cache_miss"]) + int(inductor["fxgraph_cache_bypass"]))


def compile_note(before: tuple[int, int], after: tuple[int, int], first: float | None, anew: dict) -> str:
    """One line on what ``--compile`` cost this cell: compiled, taken from the cache, or reused; ``first``: the
    seconds to its first optimizer step; ``anew``: the models compiled anew, with why (what
    :meth:`WarmModels.adopt` answered)."""
    traced, compiled = after[0] - before[0], after[1] - before[1]
    when = f"; first optimizer step {first:.1f} s after the cell started" if first is not None else ""
    # Adopted models recompile where a guard of dynamo's fails: shapes, train/eval, an attribute read.
    why = "; ".join(f"{name}: {reason}" for name, reason in anew.items()) or \
        "new input shapes, train/eval mode or an attribute the forward reads"
    if compiled:
        return f"--compile: compiled {compiled} graph{'s' if compiled != 1 else ''} ({why}){when}"
    if traced:
        return f"--compile: traced again ({why}), compiled code from inductor's cache{when}"
    return f"--compile: the compiled model was reused, nothing recompiled{when}"


def _classes(module) -> list:
    """The classes in the MRO of the module's submodules' types that travel by value (notebook
    classes): unpickling gives those new functions. (Library classes are imported, and left alone:
    torch itself sets attributes on some as it goes.)"""
    seen: dict = {}
    for sub in module.modules():
        for cls in type(sub).__mro__:
            if _by_value(cls):
                seen.setdefault(cls, None)
    return list(seen)


def _by_value(cls) -> bool:
    """Whether ``cls`` cannot be found by its module and name (and so is shipped by value)."""
    found = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is not cls


def _methods(module) -> dict:
    kinds = (types.FunctionType, staticmethod, classmethod, property)
    return {cls: {a: v for a, v in vars(cls).items() if isinstance(v, kinds)} for cls in _classes(module)}


def _structure(module) -> list:
    """What DDP and the compiled graphs are built on: submodule types by name; parameters and buffers
    by name (shared ones once), with dtype, shape and requires_grad."""
    return ([(n, type(m)) for n, m in module.named_modules()]
            + [(n, p.dtype, tuple(p.shape), p.requires_grad) for n, p in module.named_parameters()]
            + [(n, b.dtype, tuple(b.shape)) for n, b in module.named_buffers()])


def _difference(kept: _Kept, module, options: tuple) -> str:
    """Why ``module`` cannot train as ``kept`` (empty when it can)."""
    if options != kept.options:
        return "other --compile or DDP options"
    if [id(p) for p in kept.module.parameters()] != kept.param_ids:
        return "the last cell replaced layers"
    for (_, mine), (_, theirs) in zip(kept.module.named_modules(), module.named_modules()):
        if type(mine) is not type(theirs) and type(mine).__qualname__ == type(theirs).__qualname__:
            return f"{type(theirs).__name__} was defined again"
    if _structure(module) != _structure(kept.module):
        return "its layers, shapes or dtypes changed"
    now = _methods(module)
    for cls, methods in kept.methods.items():
        if set(now[cls]) != set(methods) or not all(_same(methods[a], now[cls][a]) for a in methods):
            return f"{cls.__name__}'s code or a global it reads changed"
    for (_, mine), (_, theirs) in zip(kept.module.named_modules(), module.named_modules()):
        if set(_compared_vars(mine)) != set(_compared_vars(theirs)):
            return f"the attributes of {type(theirs).__name__} changed"
        for attr, value in _compared_vars(theirs).items():
            if attr in _OWN_STATE or (_plain(value) and _plain(vars(mine)[attr])):
                continue   # plain values are copied; dynamo's guards see to any that its code reads
            if not _same(vars(mine)[attr], value):
                return f"{type(theirs).__name__}.{attr} changed"
    return ""


def _compared_vars(module) -> dict:
    """A module's attributes that decide what its compiled code does: not the forward
    :func:`compile_forward` set, nor, on torch.compile's wrapper (a model the notebook compiled),
    the wrapper's own (its forward, its compile options): --compile compiles the model inside."""
    from torch._dynamo.eval_frame import OptimizedModule
    skip = _ADDED_BY_COMPILE | (OptimizedModule._opt_mod_attributes if isinstance(module, OptimizedModule) else set())
    return {k: v for k, v in vars(module).items() if k not in skip}


def _copy_into(kept, module, adopted: Adopted) -> None:
    """The shipped module's weights and plain attributes into ``kept``; fills ``adopted``'s
    ``replaced`` and ``copied``."""
    import torch
    replaced = adopted.replaced
    with torch.no_grad():
        for (_, mine), (_, theirs) in zip(kept.named_modules(), module.named_modules()):
            replaced[id(theirs)] = mine
            for attr, value in vars(theirs).items():
                if attr not in _OWN_STATE and _plain(value):
                    mine.__dict__[attr] = value
            for own, table in (("_parameters", mine._parameters), ("_buffers", mine._buffers)):
                for key, t in getattr(theirs, own).items():
                    target = table[key]
                    if t is None or target is None:   # (both: the structures are the same)
                        continue
                    if t.data_ptr() != target.data_ptr():
                        target.copy_(t)
                        adopted.copied.add((t.device, t.data_ptr()))
                    replaced[id(t)] = target


def _plain(value) -> bool:
    return isinstance(value, _PLAIN) or (isinstance(value, (tuple, frozenset)) and all(map(_plain, value)))


def _same(a, b, seen: set | None = None) -> bool:
    """Whether ``a`` and ``b`` behave alike for compiled code: the same object, equal plain values
    or tensors, functions with the same code, defaults, closure and globals read, partials and bound
    methods holding alike things, or objects of Python classes with alike attributes. Anything else is
    different unless it is the same object: a wrong "alike" runs stale compiled code, a wrong
    "different" only compiles again."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if _plain(a):
        return bool(a == b)
    seen = set() if seen is None else seen
    if (id(a), id(b)) in seen:
        return True   # a recursive function (or two calling each other): compared already
    seen.add((id(a), id(b)))
    if isinstance(a, set):
        return all(map(_plain, a)) and a == b
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y, seen) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k], seen) for k in a)
    if isinstance(a, (staticmethod, classmethod)):
        return _same(a.__func__, b.__func__, seen)
    if isinstance(a, property):
        return all(_same(getattr(a, f), getattr(b, f), seen) for f in ("fget", "fset", "fdel"))
    if isinstance(a, types.FunctionType):
        return _same_function(a, b, seen)
    if isinstance(a, functools.partial):   # its state is not in its __dict__: what it calls, and with what
        return (_same(a.func, b.func, seen) and _same(a.args, b.args, seen)
                and _same(a.keywords, b.keywords, seen) and _same(vars(a), vars(b), seen))
    if isinstance(a, types.MethodType):    # (its __dict__ is its function's): the function and its object
        return _same(a.__func__, b.__func__, seen) and _same(a.__self__, b.__self__, seen)
    if _is_tensor(a):   # a constant the code reads (a mean, a mask): the same values
        return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and bool((a == b).all())
    if _state_in_attributes(type(a)):
        # an object the code reads (a config namespace, an activation module), shipped anew each
        # cell: alike when its attributes are
        return _same(_attributes(a), _attributes(b), seen)
    return False   # other objects (a C type's, whose state is not all in attributes): different when distinct


def _state_in_attributes(cls) -> bool:
    """Whether an instance's whole state is its ``__dict__`` and slots: every class of its MRO defined
    in Python (a heap type), or a namespace. A C base (``dict``, ``functools.partial``, a bound method's
    type) keeps state elsewhere, which comparing attributes would miss: when in doubt, different."""
    if cls is types.SimpleNamespace:
        return True
    if issubclass(cls, (type, types.ModuleType)):   # classes and modules: by identity
        return False
    return all(c is object or c.__flags__ & _HEAP_TYPE for c in cls.__mro__)


def _attributes(obj) -> dict:
    """``obj``'s ``__dict__`` and the values of its slots (those set)."""
    found = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__"):
                found[f"slot {slot}"] = getattr(obj, slot, _MISSING)
    return found


def _is_tensor(value) -> bool:
    import torch
    return isinstance(value, torch.Tensor)


def _same_function(a, b, seen: set) -> bool:
    if a.__code__ != b.__code__:
        return False
    if not (_same(a.__defaults__, b.__defaults__, seen) and _same(a.__kwdefaults__, b.__kwdefaults__, seen)):
        return False
    cells_a, cells_b = a.__closure__ or (), b.__closure__ or ()
    if len(cells_a) != len(cells_b):
        return False
    for x, y in zip(cells_a, cells_b):
        try:
            if not _same(x.cell_contents, y.cell_contents, seen):
                return False
        except ValueError:   # an empty cell
            return False
    return all(_same(a.__globals__.get(n, _MISSING), b.__globals__.get(n, _MISSING), seen)
               for n in _names_read(a.__code__))


def _names_read(code) -> set:
    """The global (and attribute) names a code object and the code nested in it read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_read(const)
    return names
