"""``%%ondevice --move``: move notebook tensors and modules to the cell's device first.

Names are checked before anything changes (:func:`plan_moves`), then modules
move in place and tensors are rebound (:func:`apply_moves`); :func:`move_note`
says what moved. A move to ``meta`` is for a dry run: meta tensors hold no
values, so :class:`DryRunMoves` puts the originals back after the cell.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..display import fmt_bytes
from ..errors import usage_error

__all__ = ["Moved", "plan_moves", "apply_moves", "move_note", "DryRunMoves"]


@dataclass
class Moved:
    """One ``--move`` variable: what it was and how many bytes changed device."""
    name: str
    kind: str            # "tensor" or the module's class name
    nbytes: int          # bytes that were elsewhere and now are on the device
    already: bool        # everything was on the device already


def _movable(namespace: dict) -> list[str]:
    import torch
    return sorted(n for n, v in namespace.items()
                  if not n.startswith("_") and isinstance(v, (torch.Tensor, torch.nn.Module)))


def plan_moves(namespace: dict, names) -> list[str]:
    """Check ``--move`` names before anything changes; ``UsageError`` names the movable variables."""
    import torch
    planned: list[str] = []
    for name in names:
        if name in planned:
            continue
        if name not in namespace:
            raise usage_error(f"--move {name!r}: no such variable in the notebook", _movable(namespace))
        value = namespace[name]
        if not isinstance(value, (torch.Tensor, torch.nn.Module)):
            raise usage_error(f"--move {name!r} is a {type(value).__name__}, not a tensor or torch.nn.Module",
                              _movable(namespace))
        planned.append(name)
    return planned


def apply_moves(namespace: dict, names: list[str], device: str) -> list[Moved]:
    """Move modules in place and rebind tensors (parameters stay parameters)."""
    import torch
    target = torch.device(device)
    moved = []
    for name in names:
        value = namespace[name]
        if isinstance(value, torch.nn.Module):
            tensors = list(value.parameters()) + list(value.buffers())
            nbytes = sum(t.nelement() * t.element_size() for t in tensors if t.device != target)
            value.to(target)
            moved.append(Moved(name, type(value).__name__, nbytes, nbytes == 0 and
                               all(t.device == target for t in tensors)))
        else:
            elsewhere = value.device != target
            nbytes = value.nelement() * value.element_size() if elsewhere else 0
            if elsewhere:
                new = value.detach().to(target) if isinstance(value, torch.nn.Parameter) else value.to(target)
                if isinstance(value, torch.nn.Parameter):
                    new = torch.nn.Parameter(new, requires_grad=value.requires_grad)
                namespace[name] = new
            moved.append(Moved(name, "tensor", nbytes, not elsewhere))
    return moved


def move_note(moved: list[Moved], device) -> str | None:
    """``moved to cuda:1: model (Sequential, 1.6 KiB), x (tensor, 8 B); 1.6 KiB in all``."""
    if not moved:
        return None
    went = [m for m in moved if not m.already]
    stayed = [m.name for m in moved if m.already]
    parts = []
    if went:
        listed = ", ".join(f"{m.name} ({m.kind}, {fmt_bytes(m.nbytes)})" for m in went)
        parts.append(f"moved to {device}: {listed}; {fmt_bytes(sum(m.nbytes for m in went))} in all")
    if stayed:
        parts.append(f"already on {device}: {', '.join(stayed)}")
    return "; ".join(parts)


class DryRunMoves:
    """The values ``--move`` to ``meta`` replaces, kept to be put back after the cell.

    Make it before :func:`apply_moves` and call :meth:`moved` after it; :meth:`put_back`
    then puts back each parameter and buffer that is still on meta (the same objects), and
    rebinds each tensor name the cell did not bind to something else.
    """

    def __init__(self, namespace: dict, names: list[str]):
        import torch
        self.namespace, self.names = namespace, names
        self.tensors = {n: namespace[n] for n in names if isinstance(namespace[n], torch.Tensor)}
        # (module, "_parameters" or "_buffers", name, the tensor before the move): moving to meta makes
        # new Parameter objects, so the originals go back by name, optimizers' references intact
        self.held: list = []
        for n in names:
            value = namespace[n]
            if isinstance(value, torch.nn.Module):
                for sub in value.modules():
                    for where in ("_parameters", "_buffers"):
                        self.held += [(sub, where, k, t) for k, t in getattr(sub, where).items() if t is not None]
        self.after: dict = {}

    def moved(self) -> None:
        """Note what the tensor names are bound to after the move (the meta copies)."""
        self.after = {n: self.namespace.get(n) for n in self.tensors}

    def put_back(self) -> None:
        """The originals back where the cell left meta copies."""
        for n, original in self.tensors.items():
            if self.namespace.get(n) is self.after.get(n):
                self.namespace[n] = original
        for sub, where, k, original in self.held:
            current = getattr(sub, where).get(k)
            if current is not None and current.is_meta:
                getattr(sub, where)[k] = original
