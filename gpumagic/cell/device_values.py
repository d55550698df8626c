"""Values that stand for "the cell's device", before and after a ``%%ondevice`` cell.

A notebook written for one GPU keeps its device in a variable::

    device = "cuda" if torch.cuda.is_available() else "cpu"        # older tutorials
    device = torch.accelerator.current_accelerator()               # pytorch/examples' mnist

Inside ``%%ondevice X`` that value means X. When the cell ends, :func:`settle`
makes each such value the notebook bound in the cell hold X, so a plain cell's
``x.to(device)`` lands where the cell's did, and marks it as standing for the
cell's device, so that it follows a later ``%%ondevice Y`` cell (Y) and the
training magics' workers (each worker's own device):

* a string becomes a :class:`DeviceName` (a ``str``: ``'cpu'``, ``'cuda:1'``);
* a ``torch.device`` becomes the one object :func:`stand_in` keeps for X
  (``torch.device`` cannot be subclassed, so it is known by identity).

In a worker process (:func:`set_process_device`), a :class:`DeviceName` that
arrives means the worker's device; it goes back to the kernel as what it was
there. Nothing here imports IPython; torch is imported when a device is made.
"""
from __future__ import annotations

from typing import Any

__all__ = ["DeviceName", "stand_in", "stands_for_cell_device", "settle", "settle_note", "set_process_device",
           "process_device"]

_stand_ins: dict[str, Any] = {}      # device name -> the torch.device object that stands for it
_stand_in_ids: set[int] = set()      # their ids (the objects live as long as this module)
_process_device: str | None = None   # set in a worker: the device every stand-in means there


class DeviceName(str):
    """A device name (``'cpu'``, ``'cuda:1'``) that stands for the cell's device.

    It is a plain string everywhere (printing, comparing, ``torch.device(name)``,
    ``x.to(name)``); rewritten ``%%ondevice`` code and the training magics'
    workers read it as "the cell's device". ``home`` is what it means in the kernel.

    Examples
    --------
    In a notebook::

        %%ondevice cpu
        device = "cuda" if torch.cuda.is_available() else "cpu"   # "cuda" here...

        device          # ...'cpu' after the cell
    """

    home: str

    def __new__(cls, name: str, home: str | None = None):
        made = super().__new__(cls, name)
        made.home = str(name) if home is None else home
        return made

    def __reduce__(self):
        # Pickled into a worker it becomes the worker's device; back in the kernel, what it was there.
        return _device_name_here, (self.home,)


def _device_name_here(home: str) -> DeviceName:
    return DeviceName(_process_device if _process_device is not None else home, home)


def set_process_device(device) -> None:
    """This process is a worker on ``device``: every stand-in that arrives means it (None: the kernel)."""
    global _process_device
    _process_device = None if device is None else str(device)


def process_device() -> str | None:
    """The device set by :func:`set_process_device`, or None in the kernel."""
    return _process_device


def stand_in(device):
    """The ``torch.device`` object that stands for the cell's device ``device`` (one per device)."""
    name = str(device)
    made = _stand_ins.get(name)
    if made is None:
        import torch
        made = _stand_ins[name] = torch.device(name)
        _stand_in_ids.add(id(made))
    return made


def stands_for_cell_device(value) -> bool:
    """True for a :class:`DeviceName` and for the ``torch.device`` objects :func:`stand_in` made."""
    return id(value) in _stand_in_ids or type(value) is DeviceName


def _is_cuda_name(value: str) -> bool:
    return value == "cuda" or (value.startswith("cuda:") and value[5:].isdigit())


def _current_cuda_index() -> int:
    """What a bare ``'cuda'`` means in the kernel now; 0 where CUDA has not started (never starts it)."""
    from ..devices import torch_cuda_initialized
    if not torch_cuda_initialized():
        return 0
    import torch
    return torch.cuda.current_device()


def _names_target(text: str, target) -> bool:
    """Whether ``text`` already names ``target`` in the kernel (``'cuda'`` names ``cuda:0`` there)."""
    if text == str(target):
        return True
    return text == target.type == "cuda" and target.index == _current_cuda_index()


def settle(namespace: dict, names, target) -> list[tuple[str, object, object]]:
    """After a cell on ``target``: the device values it bound under ``names`` hold ``target``.

    A CUDA name (``'cuda'``, ``'cuda:0'``), a CUDA ``torch.device`` and any
    stand-in (:func:`stands_for_cell_device`) are replaced by a stand-in for
    ``target``; other values (``'cpu'`` written as such, a model) are left alone.
    Returns ``(name, before, after)`` for the values whose meaning changed.

    Examples
    --------
    ::

        ns = {"device": "cuda"}
        settle(ns, ["device"], torch.device("cpu"))   # [('device', 'cuda', 'cpu')]
        ns["device"]                                   # 'cpu' (a DeviceName)
    """
    import torch
    target = torch.device(target)
    changed: list[tuple[str, object, object]] = []
    for name in names:
        value = namespace.get(name)
        if isinstance(value, str):
            text = str(value)
            if not (type(value) is DeviceName or _is_cuda_name(text)):
                continue
            # A bare 'cuda' that names the target already (its type, as .type gives it) stays as it is.
            new = DeviceName(text if _names_target(text, target) else str(target))
            if text != str(new):
                changed.append((name, text, str(new)))
        elif isinstance(value, torch.device):
            if not (value.type == "cuda" or stands_for_cell_device(value)):
                continue
            new = stand_in(target)
            if str(value) != str(new) and not _names_target(str(value), target):
                changed.append((name, value, new))
        else:
            continue
        namespace[name] = new
    return changed


def settle_note(changed: list[tuple[str, object, object]], device: str) -> str | None:
    """``after the cell, device is 'cpu' (what 'cuda' meant in it on cpu)``."""
    if not changed:
        return None
    parts = [f"{name} is {after!r} (what {before!r} meant in it)" for name, before, after in changed]
    return f"after the cell on {device}, " + "; ".join(parts)
