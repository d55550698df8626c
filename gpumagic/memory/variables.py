"""Which notebook variables hold memory: ``%gpumem --vars``.

:func:`variable_memory` gives the bytes held by tensors, modules, optimizers and
containers in a namespace, per device, each storage counted once.

It never imports torch nor initialises CUDA: where torch was never imported
no tensor exists, and torch is asked only about devices it has already set up.
Nothing here needs IPython.
"""
from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable, Container
from dataclasses import dataclass, field

from ..display import fmt_bytes, html_table, text_table
from . import autograd_graph
from .storages import AUTOGRAD, Collector

logger = logging.getLogger(__name__)

__all__ = ["VarMemory", "VarsReport", "variable_memory", "exclusive_bytes"]


def _torch():
    """torch if this process imported it; nothing here imports it itself."""
    return sys.modules.get("torch")


# --------------------------------------------------------------------------- variables

@dataclass
class VarMemory:
    """Bytes that notebook variable ``name`` holds on ``device``.

    ``parts`` splits them (``params``, ``buffers``, ``grads``, ``state``,
    ``tensors``); ``shared`` is how many of them other listed variables hold too,
    ``shared_with`` which variables those are.
    """
    name: str
    type: str
    device: str
    nbytes: int
    parts: dict = field(default_factory=dict)
    shared: int = 0
    truncated: bool = False
    shared_with: list[str] = field(default_factory=list)


class VarsReport:
    """What ``%gpumem --vars`` shows: :class:`VarMemory` rows, largest first.

    ``totals`` maps each device to the bytes all listed variables hold there,
    each storage counted once however many variables or views reach it.
    """

    header = ["variable", "type", "device", "size", "made of", "shared"]

    def __init__(self, rows: list[VarMemory], totals: dict[str, int], notes: list[str] | None = None,
                 storage_keys: frozenset = frozenset()):
        self.rows = rows
        self.totals = totals
        self.notes = notes or []
        self.storage_keys = storage_keys   # (device, data_ptr) of every storage counted: what the variables hold

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
                           "parts": dict(r.parts), "shared": r.shared, "shared_with": list(r.shared_with),
                           "truncated": r.truncated}
                          for r in self.rows],
            "totals": dict(self.totals),
            "notes": list(self.notes),
        }

    def _cells(self) -> list[list[str]]:
        cells = []
        for r in self.rows:
            parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in r.parts.items() if v) or "-"
            if r.truncated:
                parts += " (first items only)"
            cells.append([r.name, r.type, r.device, fmt_bytes(r.nbytes), parts, _shared_cell(r)])
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


def _shared_cell(row: VarMemory, most: int = 3) -> str:
    """``1.0 MiB with model, opt`` (at most ``most`` names, then how many more)."""
    if not row.shared:
        return "-"
    names = ", ".join(row.shared_with[:most])
    more = len(row.shared_with) - most
    return f"{fmt_bytes(row.shared)} with {names}" + (f" +{more}" if more > 0 else "")


def _is_user_variable(name: str, hidden) -> bool:
    return not name.startswith("_") and name not in hidden


def variable_memory(user_ns: dict, hidden=(), device: str | None = None, max_depth: int = 6,
                    max_items: int = 100_000, history: dict | None = None, holders=(),
                    last_error: BaseException | None = None, max_nodes: int | None = None) -> VarsReport:
    """Which variables in ``user_ns`` hold tensor memory, on which device, largest first.

    Tensors, modules (parameters, buffers, gradients, tensors kept as plain
    attributes), optimizers (their state; their parameters too where no
    variable holds the model) and tensors inside lists, tuples, sets, dicts,
    deques, objects' attributes and slots, started generators' locals and
    kept errors' frames (``max_depth`` levels deep, ``max_items`` per
    container); numpy arrays on the cpu (a ``torch.from_numpy`` tensor and
    its array are one storage). A result with a ``grad_fn`` (a loss kept
    before ``backward()``) holds what its autograd graph saved for backward,
    part ``autograd`` (at most ``max_nodes`` nodes read per variable, default
    :data:`.autograd_graph.MAX_NODES`; saved
    tensors are read as torch stores them, no unpack hook is run); what
    the graph holds of other variables (the model's weights, the batch)
    counts for those variables alone. A kept ``grad_fn``, and gradients made
    with ``backward(create_graph=True)``, hold their graphs the same way; a note
    names graphs with nodes torch shows nothing of (TorchScript's), whose saved
    tensors are not counted.
    ``history`` (IPython's ``Out``) and ``last_error`` (``sys.last_value``:
    its traceback's frames keep their locals) are not variables, but a note
    says what they alone hold. Each row counts every storage
    it reaches once, so a view costs what its whole storage costs and tied
    weights count once; ``totals`` counts each byte once over all rows.
    Names starting with ``_`` and names in ``hidden`` (IPython's own) are
    skipped. Functions count what their closures and defaults hold, bound
    methods their object, ``functools.partial`` its arguments: a name gets
    everything it keeps alive, and ``shared`` says which other names keep
    the same storage. The walk never enters ``user_ns`` itself, ``history``
    or ``holders`` (the shell: ``ip = get_ipython()`` holds every variable
    through it). Never imports torch, never initialises CUDA, never reads a property.

    In a notebook::

        x = torch.zeros(1024, 1024, device="cuda:0")
        from gpumagic.memory.variables import variable_memory
        variable_memory(globals())["x"].nbytes
        4194304
    """
    torch = _torch()
    if torch is None:  # no torch imported, so no tensors exist
        return VarsReport([], {})
    max_nodes = autograd_graph.MAX_NODES if max_nodes is None else max_nodes
    skip = _skip(user_ns, history, holders)
    per_var, owners, unread = _collect(torch, user_ns, hidden, max_depth, max_items, skip, max_nodes)
    rows: list[VarMemory] = []
    counted: dict[tuple, tuple[str, int]] = {}
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
                row.shared_with.extend(n for n in sorted(owners[key]) if n != name and n not in row.shared_with)
            if key not in counted or nbytes > counted[key][1]:
                counted[key] = (dev, nbytes)
        rows.extend(r for r in by_device.values() if r.nbytes)
    rows.sort(key=lambda r: (-r.nbytes, r.name, r.device))
    notes = []
    if any(r.shared for r in rows):
        notes.append("shared: bytes other listed variables hold too (views, tied weights, the same "
                     "tensor under two names, a function or partial over a variable); totals count them once.")
    if unread:
        notes.append(f"not read, so not listed: {', '.join(unread)} (reading them failed; "
                     "the log of gpumagic.memory.variables says why).")
    if any(r.truncated for r in rows):
        notes.append(f"(first items only): a container had more than {max_items} items; the rest were not read.")
    notes += _graph_notes(per_var, rows, max_nodes)
    notes += _kept_notes(history, last_error, device, lambda: owners, _skip(user_ns, None, holders))
    totals = _totals(counted)
    return VarsReport(rows, {d: b for d, b in totals.items() if b}, notes, frozenset(counted))


def _graph_notes(per_var: dict, rows: list[VarMemory], max_nodes: int) -> list[str]:
    """What ``autograd`` means where a row has it, and which graphs were too big to read whole."""
    notes = []
    if any(r.parts.get(AUTOGRAD) for r in rows):
        notes.append("autograd: what a result's graph keeps for backward (activations; weights and inputs "
                     "once no variable holds them); backward() or `del` of the result frees it, and "
                     "results computed under torch.no_grad() keep none.")
    cut = sorted(name for name, (_, collector) in per_var.items() if collector.graph_truncated)
    if cut:
        notes.append(f"autograd graphs of {', '.join(cut)}: more than {max_nodes:,} nodes; the saved tensors "
                     "of the rest were not counted.")
    hidden: dict[str, dict[str, int]] = {}
    for name, (_, collector) in per_var.items():
        for node, count in collector.graph.opaque.items():
            hidden.setdefault(node, {})[name] = count
    for node, names in sorted(hidden.items()):
        most = max(names.values())
        notes.append(f"autograd graphs of {', '.join(sorted(names))}: what {most:,} {node} node"
                     f"{'s' if most > 1 else ''} saved is hidden inside torch (TorchScript, a C++ extension's "
                     "autograd Function), so it is not counted.")
    if any(not collector.graph.readable and collector.graph.saw_saved for _, collector in per_var.values()):
        notes.append("autograd: this torch cannot show a saved tensor without unpacking it (which may run "
                     "notebook code), so what graphs saved for backward is not counted.")
    return notes


def _skip(user_ns: dict | None, history: dict | None, holders) -> frozenset[int]:
    """ids of what a variable's walk never enters: the namespace, the history, their holders.

    The shell is always among the holders where the namespace is IPython's (its ``get_ipython``
    is the shell's bound method), so ``variable_memory(globals())`` in a notebook does not list
    ``exit``, ``quit`` and ``get_ipython`` as holding every variable through the shell.
    """
    getter = (user_ns or {}).get("get_ipython")
    shell = getter.__self__ if type(getter) is types.MethodType else None
    return frozenset(id(o) for o in (user_ns, history, shell, *holders) if o is not None)


def _collect(torch, user_ns: dict, hidden, max_depth: int, max_items: int, skip: frozenset[int] = frozenset(),
             max_nodes: int | None = None):
    """Each listed variable's collector, which variables reach each storage, and the names
    whose walk failed (``name (ErrorType)``)."""
    per_var, unread = _walk_variables(torch, user_ns, hidden, max_depth, max_items, skip, max_nodes)
    owners: dict[tuple, set[str]] = {}
    for name, (_, collector) in per_var.items():
        for key in collector.storages:
            owners.setdefault(key, set()).add(name)
    orphans = _orphans(per_var, owners)
    for name, (_, collector) in per_var.items():
        # in this order: a parameter an optimizer holds and a graph reaches is "params", not "autograd"
        for held in (collector.via_optimizer, collector.via_graph, collector.via_optimizer_graph):
            for key, record in held.items():
                if name in orphans.get(key, ()):
                    collector.storages.setdefault(key, record)
    for key, names in orphans.items():
        owners[key] = names
    return per_var, owners, unread


def _walk_variables(torch, user_ns: dict, hidden, max_depth: int, max_items: int, skip: frozenset[int],
                    max_nodes: int | None) -> tuple[dict[str, tuple[str, Collector]], list[str]]:
    """``{name: (type name, collector)}`` for each variable that reaches a storage, and the unread."""
    hidden = set(hidden)
    per_var: dict[str, tuple[str, Collector]] = {}
    unread: list[str] = []
    walked: dict[int, Collector] = {}   # one walk per object, however many names it has
    slots: dict = {}
    for name, value in list(user_ns.items()):
        if not _is_user_variable(name, hidden):
            continue
        collector = walked.get(id(value))
        if collector is None:
            collector = Collector(torch, max_depth, max_items, slots, skip, max_nodes)
            try:
                collector.walk(value)
            except Exception as exc:  # an odd object must not spoil the report; a note names it
                logger.debug("skipping variable %r: walking it for tensors failed", name, exc_info=True)
                unread.append(f"{name} ({type(exc).__name__})")
                continue
            walked[id(value)] = collector
        if collector.storages or collector.via_optimizer or collector.via_graph or collector.via_optimizer_graph:
            per_var[name] = (type(value).__name__, collector)
    return per_var, unread


def _orphans(per_var: dict, owners: dict[tuple, set[str]]) -> dict[tuple, set[str]]:
    """Storages no variable holds itself, and the variables that keep them through an optimizer or a graph.

    An optimizer's parameters count for it only where no variable holds them (`del model` leaves
    them, and their gradients, alive through the optimizer alone). So does what an autograd graph
    keeps: a loss's activations are its own, the model's weights and the batch it saved are the
    model's and the batch's while those variables hold them. The graphs of an optimizer's gradients
    (create_graph=True) count for it only where no variable reaches them through a graph either: the
    model holding those gradients does.
    """
    orphans: dict[tuple, set[str]] = {}
    for name, (_, collector) in per_var.items():
        for key in (*collector.via_optimizer, *collector.via_graph):
            if key not in owners:
                orphans.setdefault(key, set()).add(name)
    through_graphs = set(orphans)
    for name, (_, collector) in per_var.items():
        for key in collector.via_optimizer_graph:
            if key not in owners and (key not in through_graphs or name in orphans[key]):
                orphans.setdefault(key, set()).add(name)
    return orphans


def _totals(counted: dict[tuple, tuple[str, int]]) -> dict[str, int]:
    """Bytes per device, each byte once: storages over one memory (torch.from_numpy of
    an array and of a slice of it) overlap, so address ranges are merged."""
    totals: dict[str, int] = {}
    spans: dict[str, list[tuple[int, int]]] = {}
    for key, (dev, nbytes) in counted.items():
        # CPU and CUDA pointers are addresses; MPS's are buffer handles, whose ranges mean nothing.
        if isinstance(key[1], int) and (dev == "cpu" or dev.startswith("cuda:")):
            spans.setdefault(dev, []).append((key[1], key[1] + nbytes))
        else:
            totals[dev] = totals.get(dev, 0) + nbytes
    for dev, ranges in spans.items():
        end = 0
        for start, stop in sorted(ranges):
            start = max(start, end)
            if stop > start:
                totals[dev] = totals.get(dev, 0) + stop - start
                end = stop
    return totals


def _kept_notes(history: dict | None, last_error: BaseException | None, device: str | None,
                held: Callable[[], Container], skip: frozenset[int] = frozenset()) -> list[str]:
    """What IPython's output history (``Out``) and the last error's traceback alone keep alive:
    memory no variable holds, yet nothing frees. Storages ``held()`` names (a variable's too) are
    left out: letting these go would not free them. ``held`` is called only where one of them
    holds tensors at all."""
    sources = [(history, "the output history (Out[...])", "`%gpumem --free --history` lets them go."),
               (last_error, "the last error's traceback (its frames' locals)", "`%gpumem --free` lets them go.")]
    notes: list[str] = []
    held_keys: Container | None = None
    for source, what, how in sources:
        if source is None:   # never bool(): an error class's __bool__ or __len__ is notebook code
            continue
        collector = Collector(_torch(), 6, 100_000, skip=skip)
        try:
            collector.walk(source)
        except Exception:
            logger.debug("walking %s for tensors failed", what, exc_info=True)
            continue
        if (collector.storages or collector.via_graph or collector.via_optimizer_graph) and held_keys is None:
            held_keys = held()
        kept: dict[str, int] = {}
        for key, (dev, nbytes, _) in {**collector.via_optimizer_graph, **collector.via_graph,
                                      **collector.storages}.items():
            if key not in (held_keys or ()) and (device is None or dev == device):
                kept[dev] = kept.get(dev, 0) + nbytes
        kept = {d: b for d, b in kept.items() if b}
        if kept:
            held_text = ", ".join(f"{fmt_bytes(b)} on {d}" for d, b in sorted(kept.items()))
            if source is last_error and any(d != "cpu" for d in kept):
                how = how[:-1] + "; `%gpumem --rescue` moves them to the CPU instead, where %debug still shows them."
            notes.append(f"{what} still holds tensors: {held_text} that no variable holds; {how}")
    return notes


def exclusive_bytes(user_ns: dict, hidden=(), device: str | None = None, history: dict | None = None,
                    holders=()) -> dict[str, int]:
    """Bytes on ``device`` that ``del name`` (then ``gc`` and ``empty_cache``) would free: the storages
    ``name`` reaches that no other variable nor the output history reaches, by any route (an optimizer
    reaches its model's parameters, a kept result its graph's activations).

    In a notebook::

        from gpumagic.memory.variables import exclusive_bytes
        exclusive_bytes(globals(), device="cuda:0")["opt"]
    """
    torch = _torch()
    if torch is None:
        return {}
    skip = _skip(user_ns, history, holders)
    per_var, _, _ = _collect(torch, user_ns, hidden, 6, 100_000, skip)
    reach: dict[tuple, set[str]] = {}
    sizes: dict[tuple, int] = {}
    for name, (_, collector) in per_var.items():
        for held in (collector.storages, collector.via_optimizer, collector.via_graph,
                     collector.via_optimizer_graph):
            for key, (dev, nbytes, _) in held.items():
                if device is None or dev == device:
                    reach.setdefault(key, set()).add(name)
                    sizes[key] = max(sizes.get(key, 0), nbytes)
    if history is not None:
        kept = Collector(torch, 6, 100_000, skip=_skip(user_ns, None, holders))
        kept.walk(history)
        for key in (*kept.storages, *kept.via_graph):
            reach.setdefault(key, set()).add("Out")
    alone: dict[str, int] = {}
    for key, names in reach.items():
        if len(names) == 1 and "Out" not in names:
            name = next(iter(names))
            alone[name] = alone.get(name, 0) + sizes.get(key, 0)
    return alone
