"""Seeds for workers: drawn in the kernel from the notebook's generator, applied in each worker."""
from __future__ import annotations

import random
import sys

__all__ = ["draw_seed", "seed_all", "check_seed", "SEED_LIMIT"]

SEED_LIMIT = 2 ** 63   # torch.manual_seed takes a 64-bit integer; ranks add their rank to it


def draw_seed() -> int:
    """A seed from the notebook's torch generator: reproducible when the notebook seeded torch."""
    import torch
    return int(torch.randint(0, 2 ** 31 - 1, (1,)).item())


def check_seed(seed: int | None, offset: int = 0) -> None:
    """``UsageError`` for a seed outside ``0 <= seed + offset < SEED_LIMIT``, before anything starts."""
    if seed is not None and not 0 <= seed < SEED_LIMIT - offset:
        from ..errors import usage_error
        raise usage_error(f"--seed {seed}: a seed is a whole number from 0 to {SEED_LIMIT - offset - 1}",
                          ["--seed 0", "--seed 1234"])


def seed_all(seed: int) -> None:
    """Seed torch, ``random`` and (when imported) numpy in this process."""
    import torch
    torch.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2 ** 32)
