"""In a worker, the cell's namespace answers for ``__main__``, as the notebook's does in the kernel.

A class defined in the notebook (``class Net(nn.Module)``) has ``__module__ == "__main__"``, and
pickle saves such an object by reference: ``__main__.Net``. In the kernel that name resolves,
so the recipes' ``torch.save(model, PATH)`` ("save the entire model"), ``pickle.dumps(obj)`` and
``torch.load(PATH, weights_only=False)`` of such a file work in a plain cell. A worker runs the
cell in a namespace of its own, while its ``sys.modules["__main__"]`` is the worker's start-up
script, so the same calls failed there with ``attribute lookup Net on __main__ failed``.

While the cell runs, the worker's ``__main__`` module looks the names it lacks up in the cell's
namespace (a module-level ``__getattr__``, PEP 562), so pickle finds the very class the cell
uses and writes ``__main__.Net``: a file that loads in the notebook as one saved there would.
Only the names a cell reads travel to the worker, and ``torch.save(model, PATH)`` does not name
``Net``: a name the namespace lacks is then looked for among the classes of the notebook's
objects the cell holds (a model's layers, the objects they keep), which travelled with them.

Runs in the workers: no IPython.
"""
from __future__ import annotations

import contextlib
import sys

__all__ = ["main_is_cell"]

_MISSING = object()


@contextlib.contextmanager
def main_is_cell(ns: dict):
    """While the block runs, ``getattr(sys.modules["__main__"], name)`` finds ``ns[name]`` where the
    module has no ``name`` of its own."""
    main = sys.modules.get("__main__")
    if main is None or getattr(main, "__dict__", None) is ns:   # (a forked worker: the notebook's own)
        yield
        return
    saved = main.__dict__.get("__getattr__", _MISSING)

    def lookup(name: str):
        if name in ns:
            return ns[name]
        found = _notebook_class(ns, name)
        if found is not None:
            return found
        if saved is not _MISSING:
            return saved(name)
        raise AttributeError(f"module '__main__' has no attribute {name!r}")

    main.__getattr__ = lookup   # type: ignore[method-assign]
    try:
        yield
    finally:
        if saved is _MISSING:
            main.__dict__.pop("__getattr__", None)
        else:
            main.__getattr__ = saved   # type: ignore[method-assign]


def _notebook_class(ns: dict, name: str) -> type | None:
    """The class called ``name`` defined in the notebook (``__module__`` ``"__main__"``) of an object
    the namespace holds: a value, a module's layers and what they keep, containers' items (a
    bounded walk: pickle asks only while it saves such an object)."""
    seen: set[int] = set()
    todo = [v for k, v in ns.items() if not k.startswith("__")]
    for _ in range(100_000):
        if not todo:
            return None
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, str, bytes, int, float, bool)) or obj is None:
            continue
        seen.add(id(obj))
        cls = type(obj)
        if cls.__module__ == "__main__" and cls.__qualname__ == name:
            return cls
        if isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif cls.__module__ == "__main__" or _is_module(obj):
            state = getattr(obj, "__dict__", None)
            if isinstance(state, dict):
                todo.extend(state.values())
    return None


def _is_module(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)
