"""What a cell may set on a module besides its tensors, carried from where the cell ran to the notebook.

A cell run elsewhere (``%%dataparallel``'s rank 0, a ``%%sharedtrain`` worker)
may call ``model.eval()``, set ``model.temperature = 0.5`` or freeze a layer;
after a plain cell the notebook's module would show it. :func:`module_settings`
reads it there, :func:`apply_settings` sets it on the notebook's module.
"""
from __future__ import annotations

__all__ = ["module_settings", "apply_settings"]

_SETTING_TYPES = (bool, int, float, str, type(None))


def module_settings(module) -> dict:
    """What a cell may set on a module besides its tensors, as a plain cell would leave it:
    each submodule's ``training`` flag (``model.eval()``) and plain attributes (``model.temp = 0.5``),
    and each parameter's ``requires_grad`` (``layer.requires_grad_(False)``). Runs where the cell ran (rank 0)."""
    subs = {}
    for qualname, sub in module.named_modules():
        attrs = {k: v for k, v in vars(sub).items()
                 if not k.startswith("_") and k != "training" and type(v) in _SETTING_TYPES}
        subs[qualname] = {"training": sub.training, "attrs": attrs}
    return {"modules": subs, "requires_grad": {n: p.requires_grad for n, p in module.named_parameters()}}


def apply_settings(module, settings: dict) -> None:
    """:func:`module_settings` of rank 0's module, set on the notebook's (whose structure matches)."""
    for qualname, got in settings["modules"].items():
        try:
            sub = module.get_submodule(qualname)
        except AttributeError:   # a layer without tensors that the cell added: the notebook's has none
            continue
        sub.training = got["training"]
        for k, v in got["attrs"].items():
            if k not in vars(sub) or type(vars(sub)[k]) is not type(v) or vars(sub)[k] != v:
                setattr(sub, k, v)
    params = dict(module.named_parameters())
    for name, flag in settings["requires_grad"].items():
        if name in params and params[name].requires_grad != flag:
            params[name].requires_grad_(flag)
