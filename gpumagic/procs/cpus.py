"""How many CPU cores this kernel may use (a container or ``taskset`` may allow fewer than the machine has)."""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

__all__ = ["usable_cpus", "physical_cores", "process_limit", "check_process_count"]


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


# A worker with torch imported holds about this much memory before it touches any data.
WORKER_MEMORY = 512 << 20
PER_CORE = 4   # more workers than this per core only wait for one another


def process_limit() -> int:
    """The most worker processes this machine can hold: ``PER_CORE`` per usable core, and no more
    than the memory available now has room for (``WORKER_MEMORY`` each)."""
    limit = PER_CORE * usable_cpus()
    try:
        import psutil
        limit = min(limit, psutil.virtual_memory().available // WORKER_MEMORY)
    except (ImportError, OSError):
        logger.debug("psutil cannot read the available memory; bounding by cores alone", exc_info=True)
    return max(1, limit)


def check_process_count(nprocs: int, oversubscribe: bool = False, flag: str = "--nprocs") -> str | None:
    """Refuse ``nprocs`` above :func:`process_limit` (unless ``oversubscribe``), before anything starts.
    ``flag`` is how the magic's line names the count (``-n`` for ``cluster start``).

    Returns a warning to show where ``nprocs`` is above the usable cores, else None.
    """
    cores = usable_cpus()
    limit = process_limit()
    if nprocs > limit and not oversubscribe:
        from ..errors import usage_error
        raise usage_error(f"{flag} {nprocs}: this machine has room for {limit} worker processes "
                          f"({cores} core(s), {PER_CORE} per core at most, about "
                          f"{WORKER_MEMORY >> 20} MiB of memory each); add --oversubscribe to start them anyway",
                          [f"{flag} {limit}", f"{flag} {nprocs} --oversubscribe"])
    if nprocs > cores:
        return (f"Warning: {nprocs} processes on {cores} CPU core(s): workers will compete for cores; "
                f"{flag} {physical_cores()} matches this machine")
    return None
