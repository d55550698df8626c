"""``torch.jit.script(model)`` and ``torch.jit.trace(model, x)`` in a ``%%dataparallel`` cell.

In the cell ``model`` is the DDP wrapper (:mod:`.wrapping`), which TorchScript
cannot compile; in a plain cell the same call scripts the user's module, and the
scripted module shares its parameters. So while the cell runs, both functions
given the wrapper act on the module inside it (:func:`scripting_users_modules`).

In a ``--compile`` cell the ranks compiled the module's ``forward`` in place; scripting and
tracing read the module with its own forwards (``torch.jit.trace`` refuses a compiled one).

A scripted module runs without DDP: a training step through it has gradients no
rank averaged, which :func:`~.wrapping.refuse_unaveraged_steps` refuses, naming
the scripting (:func:`scripted_hint`). A module scripted in the cell comes back
into the notebook scripted again from the notebook's own trained module (sharing
its parameters, as after a plain cell); a traced one cannot be traced again
without the cell's inputs, so the cell's note names it.

Runs in the workers: no IPython.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["scripting_users_modules", "scripted_hint", "scripted_results"]


@contextmanager
def scripting_users_modules(wrappers: dict, scripted: dict) -> Iterator[None]:
    """While the cell runs, ``torch.jit.script``/``trace`` given one of ``wrappers`` (name: the cell's DDP
    wrapper) take its module; ``scripted`` gets ``id(result): (kind, name, result)`` for each."""
    import torch.jit
    by_id = {id(w): (name, w) for name, w in wrappers.items()}
    originals = {kind: getattr(torch.jit, kind) for kind in ("script", "trace")}

    def acting_on_module(kind):
        original = originals[kind]

        def call(obj, *args, **kwargs):
            found = by_id.get(id(obj))
            if found is None or found[1] is not obj:
                with _eager(obj):
                    return original(obj, *args, **kwargs)
            with _eager(obj.module):
                result = original(obj.module, *args, **kwargs)
            scripted[id(result)] = (kind, found[0], result)
            return result
        call.__name__, call.__doc__, call.__wrapped__ = original.__name__, original.__doc__, original
        return call
    for kind in originals:
        setattr(torch.jit, kind, acting_on_module(kind))
    try:
        yield
    finally:
        for kind, original in originals.items():
            setattr(torch.jit, kind, original)


def _eager(obj):
    """``obj``'s own forwards while TorchScript reads it: ``--compile`` compiled them in place (:mod:`.warm`),
    and ``torch.jit.trace`` refuses a dynamo-optimized function; the scripted or traced module is the
    plain one, as in a plain cell."""
    import torch

    from .ddp_warm import forwards_set_aside
    return forwards_set_aside([obj] if isinstance(obj, torch.nn.Module) else [])


def scripted_hint(name: str, scripted: dict) -> str:
    """What to add to the refusal of an unaveraged step of ``name``'s parameters when the cell scripted
    or traced ``name`` (empty otherwise)."""
    kinds = sorted({kind for kind, module, _ in scripted.values() if module == name})
    if not kinds:
        return ""
    calls = " and ".join(f"torch.jit.{kind}({name})" for kind in kinds)
    return (f" The cell made {calls}: that module runs without DDP, so its gradients are not averaged; train "
            f"through {name}(...) and script it after the training (at the cell's end, or in the notebook).")


def scripted_results(ns: dict, names, scripted: dict) -> tuple[dict, dict]:
    """Among the cell's ``names``, those bound to a module scripted from a notebook module (``{name: the
    notebook module's name}``: the kernel scripts that one again), and the traced ones (``{name: what the
    note says}``)."""
    again, traced = {}, {}
    for n in names:
        record = scripted.get(id(ns.get(n)))
        if record is None or record[2] is not ns.get(n):
            continue
        kind, module, _ = record
        if kind == "script":
            again[n] = module
        else:
            traced[n] = (f"{n} (torch.jit.trace({module}, ...) in the cell: a traced module does not come back; "
                         f"trace {module} again in the notebook, which holds the trained weights)")
    return again, traced
