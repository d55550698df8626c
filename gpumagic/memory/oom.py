"""The out-of-memory report shown under an out-of-memory error's traceback.

:func:`is_out_of_memory` tells such errors (``torch.OutOfMemoryError``, the CPU
allocator's "can't allocate memory", ``MemoryError``, also where a framework
re-raised them as the cause of its own error); :func:`oom_report` says where the
memory went on the device that ran out: the device's total and free bytes, this
kernel's and other processes' use, the allocator's reserved-but-unused bytes,
the notebook variables holding most there, the failing frames' locals with
where they live (``Cell In[4], line 7, in step``) and their sizes, and the
command that gets it back. The report keeps numbers and names only: nothing of
the error, its frames or their tensors stays alive through it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from dataclasses import dataclass, field

from ..display import fmt_bytes
from . import last_error
from .storages import Collector
from .variables import VarMemory, _torch, exclusive_bytes, variable_memory

logger = logging.getLogger(__name__)

__all__ = ["is_out_of_memory", "oom_device", "requested_bytes", "FrameHolding", "OomReport", "oom_report",
           "rank_oom_report", "reporting_out_of_memory"]

MOST_VARIABLES = 5
MOST_FRAMES = 8
MOST_LOCALS = 5
FRAGMENTED = 1 << 30   # reserved-but-unused bytes worth a word about fragmentation
FREEABLE_FLOOR = 16 << 20   # a variable whose `del` frees less than this is not worth advice

_CPU_MESSAGES = ("can't allocate memory", "not enough memory", "unable to allocate", "cannot allocate memory")
_GPU_MESSAGES = ("cuda out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed",
                 "hip out of memory")
_UNITS = {"b": 1, "bytes": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def _out_of_memory_itself(error: BaseException) -> bool:
    torch = _torch()
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if isinstance(error, MemoryError) or (oom_type is not None and isinstance(error, oom_type)):
        return True
    if not isinstance(error, RuntimeError):
        return False
    text = _text(error).lower()
    return any(m in text for m in (*_CPU_MESSAGES, *_GPU_MESSAGES, "mps backend out of memory"))


def _text(error: BaseException) -> str:
    try:
        return str(error)
    except Exception:  # an error's __str__ is notebook code
        logger.debug("an error's text could not be read", exc_info=True)
        return ""


def _oom_in_chain(error: BaseException | None, depth: int = 0) -> BaseException | None:
    """The out-of-memory error itself: ``error``, or the cause or context it was raised from."""
    if error is None or depth > 8:
        return None
    if _out_of_memory_itself(error):
        return error
    return _oom_in_chain(error.__cause__, depth + 1) or _oom_in_chain(error.__context__, depth + 1)


def is_out_of_memory(error: BaseException | None) -> bool:
    """True for an out-of-memory error, or an error raised from one (a framework's wrapper).

    In a notebook::

        from gpumagic.memory.oom import is_out_of_memory
        is_out_of_memory(sys.last_value)
    """
    return _oom_in_chain(error) is not None


def oom_device(error: BaseException) -> str:
    """The device that ran out: ``cuda:N`` (torch's numbering), ``mps`` or ``cpu``."""
    oom = _oom_in_chain(error) or error
    text = _text(oom)
    lower = text.lower()
    gpu = re.search(r"\bGPU (\d+)\b", text)
    if gpu:
        return f"cuda:{gpu.group(1)}"
    if "mps" in lower:
        return "mps"
    torch = _torch()
    cuda = torch is not None and torch.cuda.is_initialized()
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if any(m in lower for m in _GPU_MESSAGES) or (cuda and oom_type is not None and isinstance(oom, oom_type)):
        return f"cuda:{torch.cuda.current_device() if cuda else 0}"
    return "cpu"


def requested_bytes(error: BaseException) -> int | None:
    """What the failed allocation asked for, as its message says (``Tried to allocate 2.00 GiB``)."""
    text = _text(_oom_in_chain(error) or error)
    found = re.search(r"allocate (?:an? )?([\d.]+)\s*([KMGT]i?B|bytes?|B)\b", text, re.IGNORECASE)
    if not found:
        return None
    unit = found.group(2).lower().rstrip("s") if found.group(2).lower() != "bytes" else "bytes"
    return int(float(found.group(1)) * _UNITS.get(unit, _UNITS.get(unit + "s", 1)))


@dataclass
class FrameHolding:
    """What one failing frame holds on the device: ``[(local, bytes, also a notebook variable's)]``."""
    label: str
    locals: list[tuple[str, int, bool]]


@dataclass
class OomReport:
    """Where the memory went on the device that ran out, and how to get it back."""
    device: str
    name: str = ""
    requested: int | None = None
    total: int | None = None
    free: int | None = None
    kernel: int | None = None
    others: int | None = None
    allocated: int | None = None
    reserved: int | None = None
    variables: list[VarMemory] = field(default_factory=list)
    frames: list[FrameHolding] = field(default_factory=list)
    error_alone: int = 0
    freeable: tuple[str, int] | None = None   # the variable whose `del` frees most, and how much
    advice: list[str] = field(default_factory=list)
    rank: int | None = None                   # a rank's report (%%dataparallel, %%sharedtrain)
    batches: list[str] = field(default_factory=list)   # its loaders' per-rank batch sizes

    def relabel(self, label) -> None:
        """Name the frames as the kernel numbers its cells (``label``: text -> text), in place."""
        self.frames = [FrameHolding(label(f.label), f.locals) for f in self.frames]

    @property
    def unused_reserved(self) -> int | None:
        if self.allocated is None or self.reserved is None:
            return None
        return self.reserved - self.allocated

    def as_dict(self) -> dict:
        return {"device": self.device, "name": self.name, "requested": self.requested, "total": self.total,
                "free": self.free, "kernel": self.kernel, "others": self.others, "allocated": self.allocated,
                "reserved": self.reserved, "unused_reserved": self.unused_reserved,
                "variables": [{"name": v.name, "bytes": v.nbytes} for v in self.variables],
                "frames": [{"where": f.label, "locals": [{"name": n, "bytes": b, "notebook": s}
                                                         for n, b, s in f.locals]} for f in self.frames],
                "error_alone": self.error_alone,
                "freeable": None if self.freeable is None else {"name": self.freeable[0], "bytes": self.freeable[1]},
                "advice": list(self.advice), "rank": self.rank, "batches": list(self.batches)}

    def lines(self) -> list[str]:
        asked = f": asked for {fmt_bytes(self.requested)}" if self.requested else ""
        who = f"Rank {self.rank} ran out of memory" if self.rank is not None else "Out of memory"
        lines = [f"{who} on {self.device}{f' ({self.name})' if self.name else ''}{asked}"]
        if self.total is not None and self.device == "cpu":
            lines.append(f"  machine: {fmt_bytes(self.total)} total, {fmt_bytes(self.free)} available; "
                         f"this kernel {fmt_bytes(self.kernel)}")
        elif self.total is not None:
            known = f"; this kernel {fmt_bytes(self.kernel)}, other processes {fmt_bytes(self.others)}" \
                if self.kernel is not None else ""
            lines.append(f"  device: {fmt_bytes(self.total)} total, {fmt_bytes(self.free)} free{known}")
        if self.allocated is not None:
            lines.append(f"  torch: {fmt_bytes(self.allocated)} allocated, {fmt_bytes(self.reserved)} reserved "
                         f"({fmt_bytes(self.unused_reserved)} reserved but unused)")
        if self.variables:
            names = ", ".join(f"{v.name} {fmt_bytes(v.nbytes)}" for v in self.variables)
            where = "the rank's variables" if self.rank is not None else "notebook variables"
            lines.append(f"  {where} on {self.device}: {names}")
        if self.batches:
            lines.append(f"  per-rank batch size: {'; '.join(self.batches)}")
        if self.frames:
            alone = f" (only the error holds {fmt_bytes(self.error_alone)} of it)" if self.error_alone else ""
            lines.append(f"  held by the failing frames{alone}:")
            for frame in self.frames:
                held = ", ".join(f"{n} {fmt_bytes(b)}" + (" (a notebook variable's)" if shared else "")
                                 for n, b, shared in frame.locals)
                lines.append(f"    {frame.label}: {held}")
        lines += [f"  {a}" for a in self.advice]
        return lines

    def text(self) -> str:
        return "\n".join(self.lines())

    def _repr_pretty_(self, p, cycle):
        p.text(self.text())

    def _repr_html_(self):
        import html
        body = "\n".join(html.escape(line) for line in self.lines())
        return ("<pre style='border-left:3px solid #d9534f;padding-left:8px;white-space:pre-wrap'>"
                f"{body}</pre>")

    def __repr__(self):
        return self.text()


def oom_report(error: BaseException, user_ns: dict, hidden=(), holders=(), shell=None,
               on_rank: bool = False) -> OomReport:
    """The report for out-of-memory ``error`` (kept by the shell as the last error, or given alone);
    ``on_rank``: made in a worker process, from its cell's namespace ``user_ns``."""
    torch = _torch()
    device = oom_device(error)
    report = OomReport(device=device, requested=requested_bytes(error))
    _device_figures(report, torch, on_rank)
    if torch is None:
        return report
    held = variable_memory(user_ns, hidden=hidden, device=device, holders=holders)
    report.variables = held.rows[:MOST_VARIABLES]
    alone = exclusive_bytes(user_ns, hidden, device, user_ns.get("Out"), holders)
    if alone:
        report.freeable = max(alone.items(), key=lambda item: item[1])
    notebook = set(held.storage_keys)
    report.frames, report.error_alone = _frame_holdings(torch, error, device, notebook,
                                                        _skip_ids(user_ns, holders), shell)
    report.advice = _advice(report)
    return report


def _skip_ids(user_ns: dict, holders) -> frozenset[int]:
    history = user_ns.get("Out")
    return frozenset(id(o) for o in (user_ns, history, *holders) if o is not None)


def _device_figures(report: OomReport, torch, on_rank: bool = False) -> None:
    """Total, free, this kernel and the others; torch's allocator figures on a GPU it set up.

    ``on_rank``: in a worker, which imports no IPython (the kernel's device discovery does): a GPU's
    figures come from torch, whose context there already exists."""
    if on_rank and report.device.startswith("cuda:") and torch is not None and torch.cuda.is_initialized():
        index = int(report.device.split(":")[1])
        report.free, report.total = (int(v) for v in torch.cuda.mem_get_info(index))
        report.name = torch.cuda.get_device_name(index)
        report.allocated = int(torch.cuda.memory_allocated(index))
        report.reserved = int(torch.cuda.memory_reserved(index))
        return
    from ..devices import discovery as devices
    from ..devices import memory
    if report.device == "cpu":
        row = memory.device_memory("cpu")
    elif report.device.startswith("cuda:"):
        gpus, _ = devices.bounded_gpus()
        gpu = next((g for g in gpus if g.device == report.device), None)
        if gpu is None:
            return
        row = memory.device_memory(gpu)
    else:
        row = memory.device_memory(report.device)
    report.name = "" if report.device == "cpu" else row.name
    report.total, report.free, report.kernel = row.total, row.free, row.process
    if row.used is not None and row.process is not None:
        report.others = max(0, row.used - row.process)
    if row.allocated is not None:
        report.allocated, report.reserved = row.allocated, row.reserved


def _frame_holdings(torch, error, device: str, notebook: set, skip: frozenset[int],
                    shell) -> tuple[list[FrameHolding], int]:
    """Each failing frame's locals that reach memory on ``device``, and what only the error holds there."""
    frames = [f for f in last_error.error_frames([error])
              if f.f_locals is not f.f_globals and not _shells_own(f.f_code.co_filename)]
    skip = skip | {id(e) for e in last_error.error_chain(error)}
    holdings: list[FrameHolding] = []
    alone: set[tuple] = set()
    sizes: dict[tuple, int] = {}
    for frame in frames:
        found = []
        for name, value in list(frame.f_locals.items()):
            collector = Collector(torch, 6, 100_000, skip=skip)
            try:
                collector.walk(value)
            except Exception:  # an odd local is left out of the report, never fatal to it
                logger.debug("reading local %r failed", name, exc_info=True)
                continue
            held = {k: r for k, r in {**collector.via_graph, **collector.via_optimizer,
                                      **collector.storages}.items() if r[0] == device}
            if not held:
                continue
            own = {k for k in held if k not in notebook}
            alone |= own
            sizes.update({k: r[1] for k, r in held.items()})
            found.append((name, sum(r[1] for r in held.values()), not own))
        if found:
            found.sort(key=lambda item: -item[1])
            holdings.append(FrameHolding(last_error.frame_label(frame, shell), found[:MOST_LOCALS]))
    return holdings[-MOST_FRAMES:], sum(sizes[k] for k in alone)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _shells_own(filename: str) -> bool:
    """A frame of IPython's, ipykernel's or gpumagic's own (``run_code``, a rank's loop): it holds the
    cell's result or what was shipped, not what the cell made."""
    if filename.startswith(_PACKAGE):
        return True
    for name in ("IPython", "ipykernel"):
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path and filename.startswith(os.path.dirname(path) + os.sep):
            return True
    return False


def _advice(report: OomReport) -> list[str]:
    """The commands that get memory back, in the order worth trying."""
    advice = []
    gpu = report.device != "cpu"
    if report.error_alone:
        if gpu:
            advice.append(f"to get it back: `%gpumem --rescue` moves the {fmt_bytes(report.error_alone)} only the "
                          "error holds to the CPU (%debug still shows it) and releases torch's cache; "
                          "`%gpumem --rescue --drop` lets go of it instead")
        else:
            advice.append(f"to get it back: `%gpumem --rescue --drop` (or `%gpumem --free`) lets go of the "
                          f"{fmt_bytes(report.error_alone)} only the error holds")
    unused = report.unused_reserved
    if unused and unused >= FRAGMENTED:
        advice.append(f"torch keeps {fmt_bytes(unused)} reserved but unused: `%gpumem --free` releases it; if "
                      "that recurs, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before torch starts) "
                      "avoids fragmentation")
    if report.requested and report.total and report.requested > report.total:
        advice.append(f"the allocation asked for more than the device has in all ({fmt_bytes(report.total)}): "
                      "no freeing makes room for it; a smaller size does")
    elif report.freeable is not None and report.freeable[1] >= FREEABLE_FLOOR:
        name, nbytes = report.freeable
        advice.append(f"`del {name}` then `%gpumem --free` gives back {fmt_bytes(nbytes)} (what no other "
                      "variable holds); a smaller batch needs less")
    if report.others and gpu:
        advice.append(f"other processes use {fmt_bytes(report.others)} of this device")
    return advice


def rank_oom_report(error: BaseException, ns: dict, rank: int, world: int) -> OomReport:
    """The report for a rank's out-of-memory ``error``: its device, what it held (the cell's variables
    on the rank and the failing frames' locals) and its loaders' per-rank batch sizes."""
    report = oom_report(error, ns, on_rank=True)
    report.rank = rank
    report.batches = _per_rank_batches(ns, world)
    # On a rank, the advice is the kernel's to give: the cell re-runs from the notebook.
    report.advice = [a for a in report.advice if "--rescue" not in a and "`del " not in a]
    if report.batches:
        report.advice.append("a smaller batch per rank needs less: a smaller batch_size in the notebook's "
                             "DataLoader, or more ranks")
    return report


def _per_rank_batches(ns: dict, world: int) -> list[str]:
    """``train_loader 32 (a batch of 128 over 4 ranks)`` for each DataLoader in the rank's namespace."""
    data = sys.modules.get("torch.utils.data")
    loader_type = getattr(data, "DataLoader", None)
    out = []
    for name, value in list(ns.items()):
        if loader_type is None or not isinstance(value, loader_type) or name.startswith("_"):
            continue
        sampler = getattr(value, "batch_sampler", None)
        size = getattr(sampler, "batch_size", None) or value.batch_size
        if size is None:
            continue
        ranks = getattr(sampler, "world_size", 0)
        if getattr(sampler, "split", None) == "batch" and ranks > 1:
            share = -(-size // ranks)
            out.append(f"{name} {share} (a batch of {size} over {ranks} ranks)")
        else:
            out.append(f"{name} {size}" + (f" (each of {world} ranks)" if world > 1 else ""))
    return out


@contextlib.contextmanager
def reporting_out_of_memory(ns: dict, rank: int, world: int):
    """Around a cell on a rank: an out-of-memory error leaves with its report attached
    (``error.gpumagic_report``), made while its frames still hold what they held."""
    try:
        yield
    except BaseException as exc:
        if is_out_of_memory(exc):
            try:
                exc.gpumagic_report = rank_oom_report(exc, ns, rank, world)   # type: ignore[attr-defined]
            except Exception:  # the error itself still reaches the kernel
                logger.warning("rank %d: the out-of-memory report could not be made", rank, exc_info=True)
        raise
