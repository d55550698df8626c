"""Parking the notebook's GPU memory in host memory: ``%gpumem --park`` and ``--unpark``.

For a GPU shared with another job: :func:`park` moves every tensor storage the
notebook reaches on a device (its variables, the output history, the last error)
to pinned host memory in place (:mod:`.moving`: the same tensor, parameter,
module and optimizer objects; views and tied weights still share; optimizer
state still keyed by the same parameters), then releases torch's caches, so the
kernel keeps only its CUDA context there. :func:`unpark` brings each storage back
to the device it came from.

What cannot move is named and left where it is: a device where a CUDA graph is
kept or being captured (a graph reads its tensors at fixed addresses) is not
touched at all; memory only C++ holds is reported as left. An autograd graph in
flight (``loss`` before its ``backward()``) moves with the rest: its saved tensors
share their tensor objects with what moves; ``backward()`` after ``--unpark``
gives the gradients it would have given. A saved tensor that cannot be pointed
elsewhere stays, named with the variable that holds it.
"""
from __future__ import annotations

import gc
import logging
import weakref
from dataclasses import dataclass, field

from ..display import fmt_bytes
from . import last_error, moving
from .free import release_caches
from .holders import who_holds
from .variables import _torch, variable_memory

logger = logging.getLogger(__name__)

__all__ = ["ParkReport", "park", "unpark", "parked_bytes"]


@dataclass
class _Parked:
    """One parked storage: where it came from, and weak references to the tensors over it."""
    device: str
    nbytes: int
    tensors: list = field(default_factory=list)   # weakref.ref to each tensor pointed at the copy


_parked: dict[tuple, _Parked] = {}   # (cpu, data_ptr) of the host copy -> what it was


def parked_bytes() -> int:
    """Bytes parked now whose tensors still exist."""
    return sum(p.nbytes for key, p in _parked.items() if _still_parked(key, p))


@dataclass
class ParkReport:
    """What ``--park`` or ``--unpark`` did: bytes moved per device and how fast, what stayed and why."""
    action: str
    moved: moving.MoveResult = field(default_factory=moving.MoveResult)
    before: dict[str, int] = field(default_factory=dict)   # allocated bytes per device
    after: dict[str, int] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # device -> why nothing there moved
    graphs: list[str] = field(default_factory=list)        # variables holding autograd graphs in flight
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        m = self.moved
        return {"action": self.action, "moved": dict(m.moved), "tensors": m.tensors,
                "copy_seconds": m.copy_seconds, "seconds": m.seconds, "rate": m.rate,
                "stayed": [{"device": d, "bytes": b, "why": w} for d, b, w in m.stayed],
                "before": dict(self.before), "after": dict(self.after), "refused": dict(self.refused),
                "graphs": list(self.graphs), "notes": list(self.notes)}

    def lines(self) -> list[str]:
        m = self.moved
        verb, where = ("parked", "in pinned host memory") if self.action == "park" else ("brought back", "")
        lines = []
        for device, nbytes in sorted(m.moved.items()):
            speed = f" at {m.rate / 1e9:.1f} GB/s ({m.copy_seconds:.2f} s copying, {m.seconds:.2f} s in all)" \
                if m.rate else ""
            target = f" from {device} {where}" if self.action == "park" else " to the GPUs"
            lines.append(f"{verb} {fmt_bytes(nbytes)}{target}: {m.tensors} tensors{speed}")
        for device in sorted(self.after):
            lines.append(f"{device}: torch allocated {fmt_bytes(self.before.get(device))} -> "
                         f"{fmt_bytes(self.after[device])}")
        for device, why in sorted(self.refused.items()):
            lines.append(f"nothing on {device} moved: {why}")
        for device, nbytes, why in m.stayed:
            lines.append(f"left {fmt_bytes(nbytes)} on {device}: {why}")
        return [*lines, *self.notes]

    def text(self) -> str:
        return "\n".join(self.lines())

    def _repr_pretty_(self, p, cycle):
        p.text(self.text())

    def _repr_html_(self):
        import html
        return "".join(f"<div>{html.escape(line)}</div>" for line in self.lines())

    def __repr__(self):
        return self.text()


def _roots(shell, user_ns: dict, hidden) -> list:
    """What the notebook reaches: its variables, the output history, the errors IPython keeps."""
    hidden = set(hidden)
    roots = [v for k, v in list(user_ns.items()) if not k.startswith("_") and k not in hidden]
    history = user_ns.get("Out")
    if isinstance(history, dict):
        roots.append(history)
    roots += [k.error for k in last_error.kept_errors(shell)]
    return roots


def _skip_ids(user_ns: dict, holders) -> frozenset[int]:
    return frozenset(id(o) for o in (user_ns, *holders) if o is not None)


def _allocated(torch, devices) -> dict[str, int]:
    return {d: int(torch.cuda.memory_allocated(int(d.split(":")[1]))) for d in devices}


def park(shell, user_ns: dict, hidden=(), holders=(), device: str | None = None) -> ParkReport:
    """Move the notebook's storages on ``device`` (None: every GPU) to pinned host memory, in place.

    In a notebook::

        %gpumem --park            # another job may use the GPU now
        %gpumem --unpark          # and back, the same objects
    """
    torch = _torch()
    report = ParkReport("park")
    if torch is None or not torch.cuda.is_initialized():
        report.notes.append("this kernel has not initialised CUDA: it holds nothing on a GPU to park.")
        return report
    devices = [device] if device is not None else [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    report.before = _allocated(torch, devices)
    for d in devices:
        why = _cuda_graph_refusal(torch, d, user_ns)
        if why is not None:
            report.refused[d] = why
    movable = set(devices) - set(report.refused)
    groups, _ = moving.gather(torch, _roots(shell, user_ns, hidden), skip_ids=_skip_ids(user_ns, holders),
                              devices=movable)
    report.moved = moving.move(torch, groups, to="cpu", pinned=True, repack_saved=False)
    _remember(report.moved, groups)
    if any(why.startswith("saved for backward") for _, _, why in report.moved.stayed):
        report.graphs = _graph_holders(user_ns, hidden, holders, movable)
    groups.clear()
    release_caches(torch)
    report.after = _allocated(torch, devices)
    report.notes += _park_notes(report)
    return report


def _remember(moved: moving.MoveResult, groups: dict) -> None:
    for old, new in moved.placed.items():
        group = groups[old]
        _parked[new] = _Parked(group.device, group.nbytes, [weakref.ref(t) for t in group.tensors])


def _still_parked(key: tuple, parked: _Parked) -> bool:
    """The host copy ``key`` still holds the tensors parked there (not freed and its address reused)."""
    for ref in parked.tensors:
        t = ref()
        if t is not None and t.device.type == "cpu" and t.untyped_storage().data_ptr() == key[1]:
            return True
    return False


def unpark(shell, user_ns: dict, hidden=(), holders=()) -> ParkReport:
    """Bring every parked storage the notebook still reaches back to the device it came from."""
    torch = _torch()
    report = ParkReport("unpark")
    for key, parked in list(_parked.items()):
        if not _still_parked(key, parked):
            del _parked[key]   # its tensors are gone: nothing to bring back
    if torch is None or not _parked:
        report.notes.append("nothing is parked.")
        return report
    devices = sorted({p.device for p in _parked.values()})
    report.before = _allocated(torch, devices)
    groups, _ = moving.gather(torch, _roots(shell, user_ns, hidden), skip_ids=_skip_ids(user_ns, holders),
                              devices={"cpu"})
    groups = {k: g for k, g in groups.items() if k in _parked}
    report.moved = moving.move(torch, groups, to=lambda g: _parked[g.key].device, repack_saved=False)
    for old in report.moved.placed:
        del _parked[old]
    groups.clear()
    gc.collect()
    empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
    if empty_host_cache is not None:
        empty_host_cache()   # the pinned copies' memory back to the system, not kept for reuse
    report.after = _allocated(torch, devices)
    if _parked:
        report.notes.append(f"{fmt_bytes(parked_bytes())} stay parked (see above): `%gpumem --unpark` again "
                            "once there is room.")
    return report


def _cuda_graph_refusal(torch, device: str, user_ns: dict) -> str | None:
    """Why ``device`` must not be parked: a CUDA graph is captured there now, or one is kept (its
    private memory pool is alive) and would read its tensors at their old addresses. The graphs are
    named by the notebook variables that hold them, else by what holds them."""
    index = int(device.split(":")[1])
    with torch.cuda.device(index):
        if torch.cuda.is_current_stream_capturing():
            return "a CUDA graph is being captured there"
    pools = sum(seg.get("total_size", 0) for seg in torch.cuda.memory_snapshot()
                if seg.get("device") == index and tuple(seg.get("segment_pool_id") or (0, 0)) != (0, 0))
    if not pools:
        return None
    graph_type = getattr(torch.cuda, "CUDAGraph", None)
    holders = sorted(name for name, value in list(user_ns.items())
                     if graph_type is not None and isinstance(value, graph_type))
    if not holders:
        holders = [who_holds(o) for o in gc.get_objects() if graph_type is not None and isinstance(o, graph_type)]
    named = f" (held by {', '.join(sorted(set(holders))[:3])})" if holders else \
        " (a model compiled with mode='reduce-overhead'; torch._dynamo.reset() lets go of its graphs)"
    return (f"CUDA graphs keep {fmt_bytes(pools)} there{named}, and a graph reads its tensors at fixed "
            "addresses: delete the graphs first")


def _graph_holders(user_ns: dict, hidden, holders, devices) -> list[str]:
    """Variables whose autograd graphs in flight saved tensors on ``devices``."""
    names = set()
    for device in devices:
        report = variable_memory(user_ns, hidden=hidden, device=device, holders=holders)
        names |= {r.name for r in report.rows if r.parts.get("autograd")}
    return sorted(names)


def _park_notes(report: ParkReport) -> list[str]:
    notes = []
    if report.graphs:
        notes.append(f"{', '.join(report.graphs)} hold{'s' if len(report.graphs) == 1 else ''} an autograd graph in "
                     "flight, whose saved tensors stay on the GPU: backward() or del first, then park again.")
    if report.moved.moved:
        notes.append("the notebook's tensors are in host memory now: `%gpumem --unpark` brings them back "
                     "before the next GPU cell.")
    return notes
