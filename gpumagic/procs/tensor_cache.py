"""Tensors a worker keeps between cells, found again by their content.

Tensors of ``LARGE_TENSOR_BYTES`` or more are *fingerprinted* (a 64-bit,
position-weighted sum of their bits, the same on CPU and GPU). A worker keeps
the large tensors of its last cell in a :class:`TensorStore` keyed by
fingerprint; when the kernel ships a tensor whose fingerprint every worker
holds, only the key travels (:mod:`.wire`). After a ``%%dataparallel`` cell
the notebook's model holds rank 0's trained weights and the workers hold the
same bytes, so the next cell ships no weights at all. Because the key is the
content, a tensor changed in the notebook in any way (``p.data.normal_()``
included) is shipped again.
"""
from __future__ import annotations

import torch

__all__ = ["LARGE_TENSOR_BYTES", "fingerprint_keys", "TensorStore", "is_shippable_tensor"]

# What counts as a large tensor: fingerprinted and kept between cells here (a smaller one always travels:
# fingerprinting it costs more than it saves), mapped rather than copied where wire.unpack is asked to.
LARGE_TENSOR_BYTES = 1 << 20


def is_shippable_tensor(obj) -> bool:
    """A dense tensor on the CPU or a GPU whose bytes can travel as they are."""
    return (type(obj) in (torch.Tensor, torch.nn.Parameter)
            and obj.layout == torch.strided and not obj.is_quantized
            and obj.device.type in ("cpu", "cuda") and not obj.is_nested)


_COLS = 1021   # a prime: rows of this many 8-byte words get one weight each, columns another


def _fingerprint_tensor(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64 tensor on ``t``'s device: a position-weighted sum of ``t``'s bits.

    The bytes are read as a matrix of 8-byte words, ``_COLS`` to a row; each
    column and each row has its own odd weight. Integer arithmetic wraps
    identically on every device and in any summation order, so CPU and GPU
    agree on the value; on the CPU ``mv`` makes it one pass over memory.
    """
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if b.storage_offset() % 8:
        b = b.clone()
    n = b.numel()
    row_bytes = 8 * _COLS
    full = n // row_bytes * row_bytes
    device = b.device
    cols = torch.arange(_COLS, device=device, dtype=torch.int64) * 2 + 1
    parts = []
    if full:
        parts.append(b[:full].view(torch.int64).view(-1, _COLS))
    if n > full:
        tail = torch.zeros(row_bytes, dtype=torch.uint8, device=device)
        tail[: n - full] = b[full:]
        parts.append(tail.view(torch.int64).view(1, _COLS))
    if not parts:
        return torch.zeros((), dtype=torch.int64, device=device)
    cpu = device.type == "cpu"
    rows = torch.cat([torch.mv(x, cols) if cpu else (x * cols).sum(1) for x in parts])
    weights = torch.arange(rows.numel(), device=device, dtype=torch.int64) * 2654435761 + 97
    total = torch.dot(rows, weights) if cpu else (rows * weights).sum()
    return total + n


def fingerprint_keys(tensors: list[torch.Tensor]) -> list[tuple]:
    """``(dtype, shape, fingerprint)`` for each tensor; one host sync per device."""
    keys: list[tuple | None] = [None] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        values = torch.stack([_fingerprint_tensor(tensors[i]) for i in idx]).tolist()
        for i, v in zip(idx, values):
            keys[i] = (str(tensors[i].dtype), tuple(tensors[i].shape), int(v))
    return keys  # type: ignore[return-value]


class TensorStore:
    """The large tensors a worker kept from its last cell, by fingerprint key."""

    def __init__(self, min_cache_bytes: int = LARGE_TENSOR_BYTES):
        self.min_cache_bytes = min_cache_bytes
        self._items: dict[tuple, torch.Tensor] = {}
        self._handed: set = set()

    def __contains__(self, key) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        seen, total = set(), 0
        for t in self._items.values():
            ptr = (t.device, t.untyped_storage().data_ptr())
            if ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
        return total

    def take(self, key: tuple) -> torch.Tensor:
        """The held tensor for ``key``; the second taker of one key gets a copy (no aliasing)."""
        t = self._items[key]
        if key in self._handed:
            return t.detach().clone()
        self._handed.add(key)
        return t

    def rebuild(self, tensors) -> set:
        """Hold exactly the large tensors among ``tensors`` (their current contents); returns the keys."""
        unique, seen = [], set()
        for t in tensors:
            if isinstance(t, torch.Tensor) and is_shippable_tensor(t) and id(t) not in seen \
                    and t.numel() * t.element_size() >= self.min_cache_bytes:
                seen.add(id(t))
                unique.append(t)
        keys = fingerprint_keys(unique) if unique else []
        self._items = dict(zip(keys, unique))
        self._handed = set()
        return set(self._items)

    def clear(self) -> None:
        self._items = {}
        self._handed = set()
