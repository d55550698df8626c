"""How many CPU cores this kernel may use (a container or ``taskset`` may allow fewer than the machine has)."""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

__all__ = ["usable_cpus", "physical_cores"]


def usable_cpus() -> int:
    """Logical CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def physical_cores() -> int:
    """Physical cores among the usable CPUs: one Hogwild worker per core."""
    try:
        import psutil
        physical = psutil.cpu_count(logical=False)
    except (ImportError, OSError):
        logger.debug("psutil cannot count physical cores", exc_info=True)
        physical = None
    logical = os.cpu_count() or 1
    if physical is None:
        physical = logical
    usable = usable_cpus()
    if usable < logical:
        physical = max(1, min(physical, usable * physical // logical))
    return max(1, physical)
