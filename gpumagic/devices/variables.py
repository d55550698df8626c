"""Which notebook variables hold memory, and freeing it: ``%gpumem --vars`` and ``--free``.

* :func:`variable_memory` -- bytes held by tensors, modules, optimizers and
  containers in a namespace, per device, each storage counted once;
* :func:`free_memory` -- collect garbage, release torch's cached blocks and
  report what was freed per device.

Neither imports torch nor initialises CUDA: where torch was never imported
no tensor exists, and torch is asked only about devices it has already set up.
Nothing here needs IPython.
"""
from __future__ import annotations

import gc
import logging
import sys
import types
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..display import fmt_bytes, html_table, text_table
from . import discovery as devices

logger = logging.getLogger(__name__)

__all__ = ["VarMemory", "VarsReport", "variable_memory", "FreedRow", "FreeReport", "free_memory"]


def _torch():
    """torch if this process imported it; nothing here imports it itself."""
    return sys.modules.get("torch")


# --------------------------------------------------------------------------- variables

@dataclass
class VarMemory:
    """Bytes that notebook variable ``name`` holds on ``device``.

    ``parts`` splits them (``params``, ``buffers``, ``grads``, ``state``,
    ``tensors``); ``shared`` is how many of them other listed variables hold too.
    """
    name: str
    type: str
    device: str
    nbytes: int
    parts: dict = field(default_factory=dict)
    shared: int = 0
    truncated: bool = False


class VarsReport:
    """What ``%gpumem --vars`` shows: :class:`VarMemory` rows, largest first.

    ``totals`` maps each device to the bytes all listed variables hold there,
    each storage counted once however many variables or views reach it.
    """

    header = ["variable", "type", "device", "size", "made of", "shared"]

    def __init__(self, rows: list[VarMemory], totals: dict[str, int], notes: list[str] | None = None):
        self.rows = rows
        self.totals = totals
        self.notes = notes or []

    def __getitem__(self, key) -> VarMemory:
        """``report["x"]`` (the only row of ``x``) or ``report["x", "cuda:0"]``."""
        name, device = key if isinstance(key, tuple) else (key, None)
        found = [r for r in self.rows if r.name == name and (device is None or r.device == device)]
        if len(found) != 1:
            raise KeyError(key)
        return found[0]

    def as_dict(self) -> dict:
        return {
            "variables": [{"name": r.name, "type": r.type, "device": r.device, "bytes": r.nbytes,
                           "parts": dict(r.parts), "shared": r.shared} for r in self.rows],
            "totals": dict(self.totals),
        }

    def _cells(self) -> list[list[str]]:
        cells = []
        for r in self.rows:
            parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in r.parts.items() if v) or "-"
            if r.truncated:
                parts += " (first items only)"
            cells.append([r.name, r.type, r.device, fmt_bytes(r.nbytes), parts,
                          fmt_bytes(r.shared) if r.shared else "-"])
        for device, total in sorted(self.totals.items(), key=lambda kv: -kv[1]):
            cells.append(["(total)", "", device, fmt_bytes(total), "each storage once", ""])
        return cells

    def text(self) -> str:
        if not self.rows:
            return "\n".join(["No variable holds tensor memory.", *self.notes])
        return "\n".join([text_table(self._cells(), self.header), *self.notes])

    def _repr_pretty_(self, p, cycle):
        p.text(self.text())

    def _repr_html_(self):
        import html
        if not self.rows:
            return f"<div>{html.escape(self.text())}</div>"
        notes = "".join(f"<div>{html.escape(n)}</div>" for n in self.notes)
        return html_table(self._cells(), self.header) + notes

    def __repr__(self):
        return self.text()


class _Collector:
    """Storages one variable reaches: key -> (device, bytes, part)."""

    def __init__(self, torch, max_depth: int, max_items: int):
        self.torch = torch
        self.max_depth = max_depth
        self.max_items = max_items
        self.storages: dict[tuple, tuple[str, int, str]] = {}
        self.visited: set[int] = set()
        self.truncated = False

    def add_tensor(self, t, part: str) -> None:
        device = t.device
        if device.type == "meta":  # shapes only, no bytes anywhere
            return
        device = "mps" if device.type == "mps" else str(device)
        try:
            if t.is_sparse:
                self.add_tensor(t._indices(), part)
                self.add_tensor(t._values(), part)
                return
            if t.layout in (self.torch.sparse_csr, self.torch.sparse_csc,
                            self.torch.sparse_bsr, self.torch.sparse_bsc):
                compressed, plain = ((t.crow_indices(), t.col_indices())
                                     if t.layout in (self.torch.sparse_csr, self.torch.sparse_bsr)
                                     else (t.ccol_indices(), t.row_indices()))
                for piece in (compressed, plain, t.values()):
                    self.add_tensor(piece, part)
                return
            storage = t.untyped_storage()
            key: tuple = (device, storage.data_ptr())
            nbytes = int(storage.nbytes())
            if storage.data_ptr() == 0:  # empty storages all sit at 0
                key = (device, "empty", id(storage))
        except Exception:
            # Wrapper subclasses without a storage: count the elements they expose.
            logger.debug("a %s has no storage to read; counting its elements", type(t).__name__, exc_info=True)
            key = (device, "tensor", id(t))
            nbytes = int(t.numel() * t.element_size())
        self.storages.setdefault(key, (device, nbytes, part))

    def walk(self, obj, depth: int = 0, part: str = "tensors") -> None:
        torch = self.torch
        if isinstance(obj, torch.Tensor):
            self.add_tensor(obj, part)
            if obj.is_leaf and obj.grad is not None:
                self.add_tensor(obj.grad, "grads")
            return
        if id(obj) in self.visited or depth > self.max_depth:
            return
        self.visited.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                self.add_tensor(p, "params")
            for b in obj.buffers():
                self.add_tensor(b, "buffers")
            for p in obj.parameters():
                if p.grad is not None:
                    self.add_tensor(p.grad, "grads")
            return
        if isinstance(obj, torch.optim.Optimizer):
            # The optimizer's parameters belong to their model; its own memory is the state.
            for state in list(obj.state.values()):
                for value in (state.values() if isinstance(state, dict) else (state,)):
                    self.walk(value, depth + 1, "state")
            return
        items: Iterable
        if isinstance(obj, dict):
            items = obj.values()
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = obj
        elif isinstance(getattr(obj, "__dict__", None), dict) and not isinstance(obj, _NOT_HOLDERS):
            # an object's attributes (a dataset, a loader, a Trainer, an instance of a notebook class)
            items = list(vars(obj).values())
        else:
            return
        for i, item in enumerate(items):
            if i >= self.max_items:
                self.truncated = True
                break
            self.walk(item, depth + 1, part)


# Objects whose attributes are not data a variable holds: modules, classes, functions.
_NOT_HOLDERS = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def _is_user_variable(name: str, hidden) -> bool:
    return not name.startswith("_") and name not in hidden


def variable_memory(user_ns: dict, hidden=(), device: str | None = None,
                    max_depth: int = 4, max_items: int = 100_000, history: dict | None = None) -> VarsReport:
    """Which variables in ``user_ns`` hold tensor memory, on which device, largest first.

    Tensors, modules (parameters, buffers, gradients), optimizers (their
    state) and tensors inside lists, tuples, sets, dicts and objects'
    attributes (``max_depth`` levels deep, ``max_items`` per container).
    ``history`` (IPython's ``Out``) is not a variable, but a note says what
    it holds. Each row counts every storage
    it reaches once, so a view costs what its whole storage costs and tied
    weights count once; ``totals`` counts each storage once over all rows.
    Names starting with ``_`` and names in ``hidden`` (IPython's own) are
    skipped. Never imports torch and never initialises CUDA.

    In a notebook::

        x = torch.zeros(1024, 1024, device="cuda:0")
        from gpumagic.devices.variables import variable_memory
        variable_memory(globals())["x"].nbytes
        4194304
    """
    torch = _torch()
    if torch is None:  # no torch imported, so no tensors exist
        return VarsReport([], {})
    hidden = set(hidden)
    per_var: dict[str, tuple[str, _Collector]] = {}
    owners: dict[tuple, set[str]] = {}
    for name, value in list(user_ns.items()):
        if not _is_user_variable(name, hidden):
            continue
        collector = _Collector(torch, max_depth, max_items)
        try:
            collector.walk(value)
        except Exception:  # an odd object must not spoil the report
            logger.debug("skipping variable %r: walking it for tensors failed", name, exc_info=True)
            continue
        if not collector.storages:
            continue
        per_var[name] = (type(value).__name__, collector)
        for key in collector.storages:
            owners.setdefault(key, set()).add(name)

    rows: list[VarMemory] = []
    totals: dict[str, int] = {}
    counted: set[tuple] = set()
    for name, (type_name, collector) in per_var.items():
        by_device: dict[str, VarMemory] = {}
        for key, (dev, nbytes, part) in collector.storages.items():
            if device is not None and dev != device:
                continue
            row = by_device.get(dev)
            if row is None:
                row = by_device[dev] = VarMemory(name, type_name, dev, 0, truncated=collector.truncated)
            row.nbytes += nbytes
            row.parts[part] = row.parts.get(part, 0) + nbytes
            if len(owners[key]) > 1:
                row.shared += nbytes
            if key not in counted:
                counted.add(key)
                totals[dev] = totals.get(dev, 0) + nbytes
        rows.extend(r for r in by_device.values() if r.nbytes)
    rows.sort(key=lambda r: (-r.nbytes, r.name, r.device))
    notes = []
    if any(r.shared for r in rows):
        notes.append("shared: bytes other listed variables hold too (views, tied weights, "
                     "the same tensor under two names); totals count them once.")
    if history:
        notes += _history_note(history, device)
    return VarsReport(rows, {d: b for d, b in totals.items() if b}, notes)


def _history_note(history: dict, device: str | None) -> list[str]:
    """What IPython's output history (``Out``) keeps alive: no variable, yet memory nothing frees."""
    kept = variable_memory({"Out": history}, device=device).totals
    if not kept:
        return []
    held = ", ".join(f"{fmt_bytes(b)} on {d}" for d, b in sorted(kept.items()))
    return [f"the output history (Out[...]) still holds tensors: {held}; `%reset -f out` lets them go."]


# --------------------------------------------------------------------------- freeing

@dataclass
class FreedRow:
    device: str
    before: int | None
    after: int | None
    what: str

    @property
    def freed(self) -> int | None:
        if self.before is None or self.after is None:
            return None
        return self.before - self.after


class FreeReport:
    """What ``%gpumem --free`` did: per device, memory before and after."""

    header = ["device", "measured", "before", "after", "freed"]

    def __init__(self, rows: list[FreedRow], collected: int, notes: list[str] | None = None):
        self.rows = rows
        self.collected = collected
        self.notes = notes or []

    def __getitem__(self, device: str) -> FreedRow:
        for row in self.rows:
            if row.device == device:
                return row
        raise KeyError(device)

    def as_dict(self) -> dict:
        return {
            "collected": self.collected,
            "devices": {r.device: {"measured": r.what, "before": r.before, "after": r.after, "freed": r.freed}
                        for r in self.rows},
            "notes": list(self.notes),
        }

    def _cells(self):
        return [[r.device, r.what, fmt_bytes(r.before), fmt_bytes(r.after), fmt_bytes(r.freed)]
                for r in self.rows]

    def text(self) -> str:
        lines = [f"garbage collector: {self.collected} unreachable objects",
                 text_table(self._cells(), self.header), *self.notes]
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):
        p.text(self.text())

    def _repr_html_(self):
        import html
        head = f"<div>garbage collector: {self.collected} unreachable objects</div>"
        notes = "".join(f"<div>{html.escape(n)}</div>" for n in self.notes)
        return head + html_table(self._cells(), self.header) + notes

    def __repr__(self):
        return self.text()


def free_memory(device: str | None = None, history: dict | None = None) -> FreeReport:
    """Collect garbage and release torch's cached blocks; report what was freed.

    GPUs report torch's reserved bytes before and after (only devices this
    kernel initialised; the others hold nothing of ours); the CPU reports the
    kernel's resident memory. ``device`` limits the report, not the freeing
    (``gc`` and ``empty_cache`` act on everything). ``history`` (IPython's
    ``Out``) is checked for tensors it keeps alive, which nothing can free.

    In a notebook::

        del model, optimizer
        %gpumem --free
    """
    import psutil
    proc = psutil.Process()
    torch = _torch()
    cuda = devices.torch_cuda_initialized()
    indices = list(range(torch.cuda.device_count())) if cuda else []

    def reserved():
        return {i: int(torch.cuda.memory_reserved(i)) for i in indices}

    rss_before = proc.memory_info().rss
    before = reserved()
    collected = gc.collect()
    if cuda:
        torch.cuda.empty_cache()  # releases unused cached blocks on every device
    mps = torch is not None and "mps" in (device or "mps") and devices.mps_available()
    if mps:
        mps_before = int(torch.mps.driver_allocated_memory())
        torch.mps.empty_cache()
    after = reserved()
    rss_after = proc.memory_info().rss

    rows = [FreedRow("cpu", rss_before, rss_after, "kernel resident")]
    rows += [FreedRow(f"cuda:{i}", before[i], after[i], "torch reserved") for i in indices]
    if mps:
        rows.append(FreedRow("mps", mps_before, int(torch.mps.driver_allocated_memory()), "mps driver"))
    if device is not None:
        rows = [r for r in rows if r.device == device]
    notes = _history_note(history, device) if history else []
    if not cuda and (device is None or device.startswith("cuda")):
        notes.append("this kernel has not initialised CUDA, so it holds no cached GPU blocks.")
    return FreeReport(rows, collected, notes)
