"""What the names a cell uses are in the notebook: modules, optimizers, loaders, plain values.

Plain functions over a cell's AST and the user's namespace; no IPython here
(``UsageError`` is imported where it is raised).
"""
from __future__ import annotations

import ast
import logging
import numbers
import types

from .names import names_read

logger = logging.getLogger(__name__)

__all__ = ["find_modules", "find_optimizers", "find_loaders", "is_plain_value", "is_stateful", "same_tuple_type",
           "equal_values", "detached", "instead_of_sending"]


def _module_names(namespace: dict) -> list[str]:
    import torch
    return sorted(n for n, v in namespace.items()
                  if isinstance(v, torch.nn.Module) and not n.startswith("_"))


def find_modules(tree: ast.AST, namespace: dict, names: list[str] | None = None, required: bool = True,
                 hint: str = "") -> dict:
    """The ``nn.Module`` objects the cell trains: those named, else those it reads.

    Raises ``UsageError`` naming the notebook's modules when a name is not a
    module, or (``required``) when the cell uses none (``hint`` ends that message).
    """
    import torch
    choices = _module_names(namespace)
    if names:
        found = {}
        for name in names:
            if name not in namespace:
                raise _usage_error(f"--model {name!r}: no such variable in the notebook", choices)
            if not isinstance(namespace[name], torch.nn.Module):
                kind = type(namespace[name]).__name__
                raise _usage_error(f"--model {name!r} is a {kind}, not a torch.nn.Module", choices)
            found[name] = namespace[name]
        return found
    found = {n: namespace[n] for n in names_read(tree)
             if isinstance(namespace.get(n), torch.nn.Module)}
    if not found and required:
        raise _usage_error("the cell uses no torch.nn.Module from the notebook; define the model in an "
                          "earlier cell or name it with --model NAME" + hint, choices)
    # A module that is a submodule of another found module trains with its parent.
    parents = list(found.values())
    return {n: m for n, m in found.items()
            if not any(m is not p and any(m is s for s in p.modules()) for p in parents)}


def find_optimizers(tree: ast.AST, namespace: dict, modules: dict) -> dict:
    """Optimizers the cell reads whose parameters belong to ``modules``."""
    import torch
    params = {id(p) for m in modules.values() for p in m.parameters()}
    found = {}
    for name in names_read(tree):
        value = namespace.get(name)
        if isinstance(value, torch.optim.Optimizer):
            if any(id(p) in params for g in value.param_groups for p in g["params"]):
                found[name] = value
    return found


def find_loaders(tree: ast.AST, namespace: dict) -> dict:
    """DataLoaders the cell reads."""
    from torch.utils.data import DataLoader
    return {n: namespace[n] for n in names_read(tree) if isinstance(namespace.get(n), DataLoader)}


def is_plain_value(value, _depth: int = 0) -> bool:
    """Numbers, strings, None, and lists/tuples/dicts of them (what a cell's metrics are).

    Zero-dimensional tensors count too: ``loss.item()`` is often forgotten.
    """
    if _depth > 4:
        return False
    if value is None or isinstance(value, (bool, str, bytes, numbers.Number)):
        return True
    if isinstance(value, (list, tuple)):
        return len(value) <= 1_000_000 and all(is_plain_value(v, _depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and is_plain_value(v, _depth + 1) for k, v in value.items())
    torch = __import__("sys").modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.dim() == 0
    return False


def equal_values(a, b) -> bool:
    """``a == b`` for values of one type; False where the types differ or ``==`` raises or is not a
    truth value (a tensor of several elements)."""
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - any value's __eq__ may raise: unequal
        return False


def detached(value, cpu: bool = False):
    """A plain value without autograd history (``losses.append(loss)`` keeps the graph; such a tensor
    cannot be copied), its tensors moved to the CPU where ``cpu``."""
    import torch
    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if cpu else value.detach()
    if isinstance(value, list):
        return [detached(v, cpu) for v in value]
    if isinstance(value, tuple):
        return same_tuple_type(value, [detached(v, cpu) for v in value])
    if isinstance(value, dict):
        return {k: detached(v, cpu) for k, v in value.items()}
    return value


def same_tuple_type(original: tuple, items: list) -> tuple:
    """``items`` as a tuple of ``original``'s type: a ``torch.Size`` stays one, a namedtuple too."""
    if type(original) is tuple:
        return tuple(items)
    try:
        if hasattr(original, "_fields"):
            return type(original)(*items)
        return type(original)(items)
    except Exception:
        logger.debug("%s rebuilt as a tuple", type(original).__name__, exc_info=True)
        return tuple(items)


def is_stateful(value) -> bool:
    """An object with ``state_dict``/``load_state_dict`` (a scheduler, a scaler...) that is not a
    module, optimizer or tensor: its state comes back from the workers."""
    import torch
    if isinstance(value, (type, types.ModuleType, torch.nn.Module, torch.optim.Optimizer, torch.Tensor)):
        return False
    try:
        return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))
    except Exception:  # a __getattr__ raising KeyError (an attribute dict): no state_dict
        logger.debug("a %s answered state_dict with an error: taken as stateless", type(value).__name__,
                     exc_info=True)
        return False


def instead_of_sending(name: str, value) -> str | None:
    """What to do with ``value``, which cannot be pickled for a worker, where its kind says: a function
    torch.compile wrapped, or a module scripted, traced or exported (a copy made in the cell would
    train no notebook weights)."""
    import torch
    if callable(value) and hasattr(value, "_torchdynamo_orig_callable"):
        return (f"{name} is a torch.compile'd function: compile the plain function inside the cell "
                f"({name} = torch.compile(fn))")
    if isinstance(value, (torch.jit.ScriptModule, torch.fx.GraphModule)):
        return (f"{name} is a {type(value).__name__}: train the nn.Module it was made from, and script, trace "
                "or export that after training")
    return None


def _usage_error(what, choices):
    from ..errors import usage_error
    return usage_error(what, choices)
