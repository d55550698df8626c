"""What each piece of :class:`~gpumagic.cell.rewrite.helper.Placement` reads from the whole.

``Placement`` is put together from pieces, one module each (CUDA calls, ``torch.nn.parallel``,
remembered placements, modules' own methods); each piece subclasses :class:`PlacementPart`, which
names the attributes and the one method of ``Placement`` they use, for readers and the type checker.
"""
from __future__ import annotations

from typing import Any

__all__ = ["PlacementPart"]


class PlacementPart:
    """The attributes of ``Placement`` its pieces read: the target device, its kind, and torch."""

    __slots__ = ()
    target: Any
    _kind: str | None
    _torch: Any

    def map(self, device):  # Placement's
        raise NotImplementedError
