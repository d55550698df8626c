"""The full CUDA attribute list through pycuda, asked in a short-lived subprocess.

``cuInit`` in the kernel would make later forks (Hogwild, DataLoader workers)
unsafe, and ``pycuda.autoinit`` would make a second context beside torch's. So
the query runs in a child process, which reads attributes through the device
handle (no context is made at all) and exits; answers are cached by PCI bus id.
"""
from __future__ import annotations

import json
import subprocess
import sys

__all__ = ["pycuda_installed", "pycuda_attributes", "INSTALL_HINT"]

INSTALL_HINT = ("pycuda is not installed: `pip install 'gpumagic[pycuda]'` (or `pip install pycuda`) "
                "shows every CUDA attribute")

_cache: dict[str, dict] = {}

_QUERY = r"""
import json, sys
import pycuda.driver as cuda
cuda.init()
out = {}
for i in range(cuda.Device.count()):
    d = cuda.Device(i)
    attrs = {}
    for key, value in d.get_attributes().items():
        attrs[str(key)] = value if isinstance(value, (int, float, str)) else str(value)
    major, minor = d.compute_capability()
    out[d.pci_bus_id().lower()] = {"name": d.name(), "compute_capability": f"{major}.{minor}",
                                   "total_memory": d.total_memory(), "attributes": attrs}
json.dump({"pycuda_version": __import__("pycuda").VERSION_TEXT,
           "driver_version": cuda.get_driver_version(), "devices": out}, sys.stdout)
"""


def pycuda_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("pycuda") is not None


def pycuda_attributes(refresh: bool = False, timeout: float = 60.0) -> dict:
    """``{bus_id: {"name", "compute_capability", "total_memory", "attributes": {...}}}``.

    Raises ``RuntimeError`` with pycuda's message if the query fails.
    """
    if _cache and not refresh:
        return dict(_cache)
    proc = subprocess.run([sys.executable, "-c", _QUERY], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"pycuda query failed: {proc.stderr.strip().splitlines()[-1:]}")
    data = json.loads(proc.stdout)
    from .discovery import normalize_bus_id
    _cache.clear()
    for bus, entry in data["devices"].items():
        entry["pycuda_version"] = data["pycuda_version"]
        _cache[normalize_bus_id(bus) or bus] = entry
    return dict(_cache)
