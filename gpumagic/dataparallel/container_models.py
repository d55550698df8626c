"""Models a ``%%dataparallel`` cell puts in the notebook's lists, dicts and objects, and how they come back.

A plain cell's ``best["model"] = copy.deepcopy(model)`` or ``self.best_model = copy.deepcopy(model)`` leaves a
model of its own there: rank 0's comes back whole (:func:`made_model`, on the CPU), as a model the cell binds
to a name does. ``reg["head"] = model.fc`` leaves the notebook's own layer: it comes back as that layer, by its
path in the notebook's module (:func:`layer_of`). A model that holds the notebook's modules (a wrapper the cell
built around them) is neither: the note names where it is held.

Runs in the workers: no IPython.
"""
from __future__ import annotations

import sys

from .touched import is_array

__all__ = ["made_model", "layer_of", "model_bytes"]


def made_model(item, named: dict):
    """A model the cell made that stands alone (``copy.deepcopy(model)``: the user's module, out of its DDP
    wrapper), to come back whole as one the cell binds to a name does; None for anything else, and for a
    model holding one of the notebook's ``named`` modules (it trained those: a copy would not be them)."""
    from .rank_state import stands_alone, unwrapped
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(item, torch.nn.Module):
        return None
    model = unwrapped(item)
    # (and their layers: ``reg["head"] = model.fc`` is the notebook's layer, which no copy stands for)
    mine = {id(sub): sub for _, m in named.values() if isinstance(m, torch.nn.Module) for sub in m.modules()}
    # (a copy of an fsdp model holds the ranks' shards, DTensors, or nothing, on the meta device: not one)
    whole = all(is_array(t) and t.device.type != "meta" for t in model.state_dict().values())
    return model if whole and stands_alone(model, mine) else None


def layer_of(item, named: dict) -> tuple[str, str] | None:
    """``(name, path)`` where ``item`` is a layer of the notebook's module ``name`` (``model.get_submodule(path)``,
    as the cell started); None for anything else."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(item, torch.nn.Module):
        return None
    from torch.nn.parallel import DistributedDataParallel
    for name, module in named.values():   # (the user's modules, not their DDP wrappers: the notebook's names)
        if isinstance(module, torch.nn.Module) and not isinstance(module, DistributedDataParallel):
            for path, sub in module.named_modules():
                if sub is item and path:
                    return name, path
    return None


def model_bytes(model) -> int:
    """The bytes of a model's tensors, as they count in what one cell brings back."""
    return sum(t.nbytes for t in model.state_dict().values() if is_array(t))
