"""Tensors a worker keeps between cells, found again by their content.

Tensors of ``LARGE_TENSOR_BYTES`` or more are *fingerprinted* (a 64-bit,
position-weighted sum of their mixed bits, the same on CPU and GPU). A worker keeps
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


_COLS = 1021          # a prime: rows of this many 8-byte words get one weight each, columns another
# Rows mixed at a time: on the CPU 0.5 MB of words, which stays in cache between the mixing steps
# (2.5x faster than whole-tensor steps); on a GPU 64 MB, few enough launches.
_CHUNK_ROWS = {"cpu": 64, "cuda": 8192}
# Odd multipliers (splitmix64's, as signed int64): multiplying by an odd number permutes the 2**64 words.
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_LOW32 = 0xFFFFFFFF


def _mix_(words: torch.Tensor, z: torch.Tensor, shifted: torch.Tensor) -> torch.Tensor:
    """``words`` through a bijective, non-linear mix (multiply, xor-shift, multiply), into ``z``.

    Without it the weighted sum was linear: flipping a float64's sign changes its
    word by 2**63, and any even number of such flips cancelled out. Each step is a
    bijection, so distinct words stay distinct; torch's ``>>`` on int64 keeps the
    sign, hence the mask that makes it a logical shift. ``shifted`` is scratch.
    """
    torch.mul(words, _MIX1, out=z)
    torch.bitwise_right_shift(z, 32, out=shifted)
    z.bitwise_xor_(shifted.bitwise_and_(_LOW32))
    return z.mul_(_MIX2)


def _fingerprint_tensor(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64 tensor on ``t``'s device: a position-weighted sum of ``t``'s mixed bits.

    The bytes are read as a matrix of 8-byte words, ``_COLS`` to a row; each word
    is mixed (:func:`_mix_`), and each column and each row has its own odd weight.
    Integer arithmetic wraps identically on every device and in any summation
    order, so CPU and GPU agree on the value.
    """
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if b.storage_offset() % 8:
        b = b.clone()
    n = b.numel()
    row_bytes = 8 * _COLS
    full = n // row_bytes * row_bytes
    device = b.device
    cols = torch.arange(_COLS, device=device, dtype=torch.int64) * 2 + 1
    matrices = []
    if full:
        matrices.append(b[:full].view(torch.int64).view(-1, _COLS))
    if n > full:
        tail = torch.zeros(row_bytes, dtype=torch.uint8, device=device)
        tail[: n - full] = b[full:]
        matrices.append(tail.view(torch.int64).view(1, _COLS))
    if not matrices:
        return torch.zeros((), dtype=torch.int64, device=device)
    cpu = device.type == "cpu"
    chunk = _CHUNK_ROWS["cpu" if cpu else "cuda"]
    most = min(chunk, max(x.shape[0] for x in matrices))
    z = torch.empty(most, _COLS, dtype=torch.int64, device=device)
    shifted = torch.empty_like(z)
    rows = []
    for x in matrices:
        for start in range(0, x.shape[0], chunk):
            words = x[start:start + chunk]
            k = words.shape[0]
            mixed = _mix_(words, z[:k], shifted[:k])
            rows.append(torch.mv(mixed, cols) if cpu else (mixed * cols).sum(1))
    row_sums = torch.cat(rows)
    weights = torch.arange(row_sums.numel(), device=device, dtype=torch.int64) * 2654435761 + 97
    total = torch.dot(row_sums, weights) if cpu else (row_sums * weights).sum()
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

    def let_go(self, tensors) -> None:
        """Stop holding ``tensors`` (by identity) before the cell ends: their new owner changes or
        replaces them, and holding them would keep their memory for nothing."""
        ids = {id(t) for t in tensors}
        self._items = {k: t for k, t in self._items.items() if id(t) not in ids}

    def clear(self) -> None:
        self._items = {}
        self._handed = set()
