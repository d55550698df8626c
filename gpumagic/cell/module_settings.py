"""What a cell may set on a module besides its tensors, carried from where the cell ran to the notebook.

A cell run elsewhere (``%%dataparallel``'s rank 0, a ``%%sharedtrain`` worker)
may call ``model.eval()``, set ``model.temperature = 0.5``, freeze a layer or
collect values in the module (a LightningModule's ``self.losses.append(loss)``);
after a plain cell the notebook's module would show it. :func:`module_settings`
reads it there, :func:`apply_settings` sets it on the notebook's module.
"""
from __future__ import annotations

from .values import detached, equal_values, is_plain_value

__all__ = ["module_settings", "apply_settings"]

_SETTING_TYPES = (bool, int, float, str, type(None))


def module_settings(module) -> dict:
    """What a cell may set on a module besides its tensors, as a plain cell would leave it:
    each submodule's ``training`` flag (``model.eval()``) and plain attributes (``model.temp = 0.5``,
    lists and dicts of plain values, tensors detached on the CPU), and each parameter's
    ``requires_grad`` (``layer.requires_grad_(False)``). Runs where the cell ran (rank 0)."""
    subs = {}
    for qualname, sub in module.named_modules():
        attrs = {k: detached(v, cpu=True) for k, v in vars(sub).items()
                 if not k.startswith("_") and k != "training" and _is_setting(v)}
        subs[qualname] = {"training": sub.training, "attrs": attrs}
    return {"modules": subs, "requires_grad": {n: p.requires_grad for n, p in module.named_parameters()}}


# Past this many items a collection is data the module holds rather than something a cell collected:
# it is not carried each cell (the same bound as for the notebook's other objects).
_MOST_ITEMS = 10_000


def _is_setting(value) -> bool:
    return type(value) in _SETTING_TYPES or (
        isinstance(value, (list, tuple, dict)) and len(value) <= _MOST_ITEMS and is_plain_value(value))


def apply_settings(module, settings: dict) -> None:
    """:func:`module_settings` of rank 0's module, set on the notebook's (whose structure matches)."""
    # named_modules(), not get_submodule(): a TorchScript module has no get_submodule.
    subs = dict(module.named_modules())
    for qualname, got in settings["modules"].items():
        sub = subs.get(qualname)
        if sub is None:   # a layer without tensors that the cell added: the notebook's has none
            continue
        sub.training = got["training"]
        for k, v in got["attrs"].items():
            old = vars(sub).get(k)
            if k in vars(sub) and equal_values(old, v):
                continue
            # a list or dict the cell appended to stays the same object (other names may hold it)
            if isinstance(old, list) and isinstance(v, list):
                old[:] = v
            elif isinstance(old, dict) and type(v) is dict:
                old.clear()
                old.update(v)
            else:
                setattr(sub, k, v)
    params = dict(module.named_parameters())
    for name, flag in settings["requires_grad"].items():
        if name in params and params[name].requires_grad != flag:
            params[name].requires_grad_(flag)
