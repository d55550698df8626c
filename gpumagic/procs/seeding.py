"""Seeds for workers: drawn in the kernel from the notebook's generator, applied in each worker."""
from __future__ import annotations

import random
import sys

__all__ = ["draw_seed", "seed_all"]


def draw_seed() -> int:
    """A seed from the notebook's torch generator: reproducible when the notebook seeded torch."""
    import torch
    return int(torch.randint(0, 2 ** 31 - 1, (1,)).item())


def seed_all(seed: int) -> None:
    """Seed torch, ``random`` and (when imported) numpy in this process."""
    import torch
    torch.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2 ** 32)
