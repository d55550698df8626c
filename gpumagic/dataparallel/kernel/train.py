"""A ``%%dataparallel`` cell from start to end, in the kernel: :func:`run_cell` (the magic's) and
:func:`train_parallel` (the same from plain Python).

:func:`run_cell` reads the cell (:mod:`.read`: what it trains, which mode), lets its strategy prepare
(:meth:`~..strategies.base.Strategy.before`), packs the notebook values the cell reads (:mod:`gpumagic.procs.wire`:
tensors once, in shared memory, those the ranks hold already by fingerprint) into a
:class:`~..protocol.CellOrder`, runs it on every rank (:mod:`..ranks`: this machine's pool or a cluster's
engines, :mod:`..rank.task` on each), streaming rank 0's output and every rank's progress into the cell, and,
once every rank has finished, loads rank 0's answer into the notebook: the trained state into its own objects
in place (the strategy's :meth:`~..strategies.base.Strategy.after`), then what else the cell changed
(:mod:`..sync.apply`). Nothing in the notebook changes unless every rank succeeded; an interrupt during the
write-back waits for its end.

Why the result equals single-process training: each global batch is split into equal shares, each rank's loss
is the mean over its share, DDP averages the gradients, so the update is that of the mean loss over the whole
batch.

In a notebook the magic is the way in::

    %%dataparallel --nprocs 2
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

From plain Python::

    result = train_parallel(namespace, cell_source, nprocs=2)
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from ...cell.definitions import define_in_notebook
from ...cell.trees import Flat
from ...cell.values import instead_of_sending
from ...cell.with_targets import quiet_targets
from ...display import note
from ...errors import usage_error
from ...procs import torch_settings
from ...procs.compile_settings import notebook_compile_settings
from ...procs.output import RankOutput
from ...procs.relays import Relays
from ...procs.seeding import draw_seed
from ...procs.teardown import interrupts_deferred
from ...procs.wire import Packed, Unshippable, pack_namespace, unpack
from ..plan import Plan, make_plan
from ..protocol import (
    GRADS_KEY,
    CellCode,
    CellOrder,
    CellWarning,
    Note,
    Progress,
    RankDone,
    Settings,
    Started,
    Writing,
)
from ..rank.task import TASK
from ..ranks import local
from ..strategies.base import Prepared
from ..sync.apply import Applied, apply_changes
from . import held
from .notebook import Notebook
from .progress import Progress as ProgressDisplay
from .read import ReadCell, read_cell
from .result import DataParallelResult
from .survey import warn_in_cell

logger = logging.getLogger(__name__)

__all__ = ["run_cell", "train_parallel", "run_on_ranks"]


def run_cell(target, cell: str, plan: Plan, header: str = "%%dataparallel"):
    """Run ``cell`` against ``target`` (an IPython shell, or a namespace dict) as ``plan`` says; returns what it
    did (a :class:`~.result.DataParallelResult`; ``--strategy dp``'s own in the kernel).

    Raises ``UsageError`` before anything runs when the cell trains no module, ``WorkerError`` when a rank fails
    (the notebook unchanged), and re-raises ``KeyboardInterrupt`` after ending the ranks.
    """
    return plan.strategy.run(Notebook.of(target), cell, plan, header, run_on_ranks)


def train_parallel(target, cell: str, **options) -> DataParallelResult:
    """``%%dataparallel`` from plain Python: train the cell's model on every device; the trained weights come back.

    Parameters
    ----------
    target : InteractiveShell or dict
        The shell (its ``user_ns`` is the notebook) or a namespace dict: the cell's names, changed in place.
    cell : str
        The training cell, as under ``%%dataparallel``.
    **options
        The magic's options by their Python names: ``devices="0,1"``, ``nprocs=2``, ``strategy="fsdp"``,
        ``backend``, ``timeout``, ``seed``, ``all_output``, ``model``, ``cluster``, ``launch``, ``static_graph``,
        ``find_unused``, ``bucket_mb``, ``grad_dtype``, ``compile``, ``wrap``, ``keep_optimizer``,
        ``oversubscribe``.

    Returns
    -------
    DataParallelResult
        What the cell did; its last expression's value is ``.value``.

    Examples
    --------
    ::

        ns = {"model": model, "opt": opt, "loader": loader}
        result = train_parallel(ns, "for x, y in loader:\\n    ...", nprocs=2)
        result.summary()
    """
    if "model" in options:
        options["models"] = options.pop("model")
    plan = make_plan(**options)
    for text in plan.notes:
        note(text)
    return run_cell(target, cell, plan, header="%%dataparallel")


@dataclasses.dataclass
class _Ran:
    """A cell the ranks ran, and its answer loaded into the notebook."""
    packed: Packed
    dones: list                 # each rank's (RankDone, buffer)
    started_at: dict            # rank -> when its user's code began (its clock)
    applied: Applied
    loaded: Any                 # the strategy's Loaded


@dataclasses.dataclass
class _Clock:
    begin: float
    cluster: float = 0.0        # forming a cluster's ranks, where this cell did
    before_ranks: float = 0.0
    ranks: float = 0.0
    packed: float = 0.0
    ranks_done: float = 0.0


def _on_cluster(plan: Plan, clock: _Clock):
    """A ``--cluster`` plan's engines, found and formed into ranks before anything of the cell travels
    (``UsageError`` where they cannot be); the plan with their devices and backend; whether they formed now."""
    from ..ranks.cluster_setup import connect, form
    assert plan.cluster is not None
    ranks = connect(plan.cluster)
    formed = ranks.formed
    ranks = form(ranks, plan.nprocs, plan.backend, plan.timeout)
    clock.cluster = time.monotonic() - clock.begin if not formed else 0.0
    return ranks, dataclasses.replace(plan, devices=list(ranks.devices), backend=ranks.backend), not formed


def run_on_ranks(strategy, notebook: Notebook, cell: str, plan: Plan, header: str) -> DataParallelResult:
    """Every strategy's cell but DP's: read, prepared, run on the ranks, loaded (see the module's docstring)."""
    clock = _Clock(time.monotonic())
    ranks, started = None, False
    if plan.cluster is not None:
        ranks, plan, started = _on_cluster(plan, clock)
    read = read_cell(notebook, cell, plan, header)
    if ranks is None:
        here = local.current()
        held.check_cell(notebook.ns, set(read.survey.used), read.strategy, here,
                        here is not None and here.serves(plan.devices, plan.backend, plan.timeout))
    read.strategy.check_cell(read)
    clock.before_ranks = time.monotonic()
    if ranks is None:
        ranks, started = local.local_ranks(plan.devices, plan.backend, plan.timeout)
    clock.ranks = time.monotonic()
    prepared = read.strategy.before(read, ranks)
    try:
        ran = _ship_run_load(read, plan, ranks, prepared, clock)
    except BaseException:
        read.strategy.failed(read, ranks)
        raise
    return _result(read, plan, ranks, ran, started, clock)


def _unshippable(exc: Unshippable):
    what = "; ".join(f"{name} ({type(value).__name__}: {error})" for name, value, error in exc.problems)
    advice = [a for a in (instead_of_sending(n, v) for n, v, _ in exc.problems) if a]
    return usage_error(f"cannot send to the worker processes: {what}. "
                       + ("; ".join(advice) or "Create such objects inside the cell")
                       + ", or run the cell with --strategy dp (in the kernel)")


def _order(read: ReadCell, plan: Plan, packed, rank_strategy, relays: Relays) -> CellOrder:
    """What every rank is told about the cell, beside the packed values."""
    compiled = read.compiled
    # (Flat: a deep cell's tree pickles without recursion, and unpickles as the tree)
    code = CellCode(Flat(read.ship_tree), compiled.filename, compiled.source, read.placement,
                    tuple(quiet_targets(compiled.tree)))   # (a profiler bound by `with ... as` is not one)
    return CellOrder(values=packed.header, shared=packed.shared, code=code, roles=read.survey.roles(),
                     watch=read.survey.watch(compiled.tree), strategy=rank_strategy,
                     seed=plan.seed if plan.seed is not None else draw_seed(),
                     settings=Settings(torch_settings.current(), notebook_compile_settings()),
                     relays=relays.found, all_output=plan.all_output,
                     # a notebook kernel shows rich output: the ranks' tqdm bars are drawn as HTML (procs.tqdm_relay)
                     notebook=read.notebook.is_kernel)


def _ship_run_load(read: ReadCell, plan: Plan, ranks, prepared: Prepared, clock: _Clock):
    """Pack what the cell reads, run it on every rank, and load rank 0's answer into the notebook."""
    ns, survey = read.ns, read.survey
    relays = Relays()   # the notebook's loggers (a SummaryWriter) stay here; rank 0's calls come back to them
    values = {n: ns[n] for n in survey.used}
    values[GRADS_KEY] = prepared.grads   # (each rank starts from them)
    try:
        packed, _ = pack_namespace(values, ns, targets=prepared.targets, held=ranks.kept.tensors,
                                   scratch=ranks.outgoing, share=prepared.share, stand_ins=prepared.stand_ins,
                                   stand_in_for=relays.stand_in_for)
    except Unshippable as exc:
        raise _unshippable(exc) from None
    # From here the ranks replace what they hold; until the cell's end says what that is, the kernel counts on
    # nothing (an interrupt anywhere after this ships everything next time).
    ranks.kept.tensors = set()
    clock.packed = time.monotonic()
    order = _order(read, plan, packed, prepared.rank, relays)
    dones, started_at = _run_on(ranks, order, packed.data(), read, relays)
    clock.ranks_done = time.monotonic()
    # Writing the trained state back takes about as long as copying the model once; an interrupt meanwhile
    # would leave some tensors trained and others not, so it waits for the end.
    with interrupts_deferred() as interrupted:
        applied, loaded = _load(read, ranks, dones)
        # Every rank holds these tensors now; the notebook holds the same bytes (rank 0's).
        ranks.kept.tensors = set.intersection(*(set(done.keys) for done, _ in dones))
    if interrupted:
        note("%%dataparallel: interrupted while the trained state was written back into the notebook; the write "
             "was finished first, so the notebook holds the whole result of the cell")
        raise KeyboardInterrupt
    return _Ran(packed, dones, started_at, applied, loaded)


class _Messages:
    """What the ranks send while the cell runs, shown in the cell."""

    def __init__(self, progress: ProgressDisplay, relays: Relays, filename: str):
        self.progress, self.relays, self.filename = progress, relays, filename
        self.started_at: dict[int, float] = {}
        self.writing: list[int] = []

    def __call__(self, rank: int, msg) -> None:
        if isinstance(msg, Started):
            self.started_at[rank] = msg.t
        elif isinstance(msg, Progress):
            self.progress.update(rank, msg.stats)
        elif isinstance(msg, CellWarning):
            warn_in_cell(msg.text, self.filename)
        elif isinstance(msg, Note):
            note(msg.text)
        elif isinstance(msg, Writing):
            self.writing.append(rank)
        elif msg["kind"] == "relay":   # (the notebook's loggers: procs.relays, dicts of its own)
            failed = self.relays.replay(msg)
            if failed:
                note(failed)
        else:
            warn_in_cell(msg["text"], self.filename)


def _run_on(ranks, order: CellOrder, data, read: ReadCell, relays: Relays) -> tuple[list, dict]:
    """Run the cell on every rank, showing output and progress; each rank's ``(RankDone, buffer)``, and when each
    began the user's code."""
    progress = ProgressDisplay(ranks.devices, read.notebook.shell)
    output = RankOutput(prefix=order.all_output)
    messages = _Messages(progress, relays, order.code.filename)
    try:
        results = ranks.run(TASK, order, data, on_output=output.write, on_message=messages, on_tick=progress.tick)
    except BaseException as exc:
        _failed(ranks, read, exc, messages.writing)
        raise
    finally:
        output.flush()
    for rank, (done, _) in enumerate(results):
        progress.update(rank, done.stats)
    progress.tick(final=True)
    return results, messages.started_at


def _failed(ranks, read: ReadCell, exc: BaseException, writing: list) -> None:
    """A rank failed, or the cell was interrupted: the ranks dropped what they kept, and the note says what the
    notebook holds."""
    ranks.kept.forget()
    held.lost("the cell failed, so they dropped what they kept", read.ns)
    if "CellDDP" in str(exc) and read.strategy.splits:
        # a framework the cell reaches in a way detection missed (getattr, a helper module) got our wrapper
        note("%%dataparallel: the cell's code was handed gpumagic's DDP wrapper (CellDDP) and refused it: if the cell "
             "distributes by itself (a framework's trainer, your own DDP), run it with --launch")
    if writing:
        note("%%dataparallel --strategy fsdp: stopped while rank 0 was writing the trained state into the notebook's "
             "tensors: the model and optimizer hold a mix of their state before and after the cell. Load a "
             "checkpoint, or run the training again")
    elif isinstance(exc, KeyboardInterrupt):
        note(ranks.interrupted_note())


def _load(read: ReadCell, ranks, dones: list):
    """Rank 0's answer into the notebook: the trained state (the strategy's), then what else the cell changed."""
    ns = read.ns
    done, buffer = dones[0]
    try:
        returned, _ = unpack(done.returned, buffer, device="cpu", views_from=0)
        loaded = read.strategy.after(read, returned, done, buffer, ranks)
        applied = apply_changes(ns, returned.changes, assigned=read.survey.assigned, value=returned.value,
                                define=lambda names: define_in_notebook(ns, read.compiled.tree,
                                                                        read.compiled.filename, names))
        torch_settings.apply(returned.torch_settings)   # what the cell set: torch.set_default_dtype...
    except BaseException:
        ranks.kept.forget()
        held.lost("loading the trained state failed, so they dropped what they kept", ns)
        read.strategy.failed(read, ranks, done)
        raise
    return applied, loaded


def _timings(clock: _Clock, started: bool, dones: list, started_at: dict, world_size: int) -> dict:
    end = time.monotonic()
    pool_start = ((clock.ranks - clock.before_ranks) if started else 0.0) + clock.cluster
    user_ends = [done.ended for done, _ in dones]
    return {
        "total": end - clock.begin,
        "pool_start": pool_start,
        "pack": clock.packed - clock.ranks,
        # cell start: from the magic's first line to every rank running the user's code, not counting the
        # pool's start
        "start": (max(started_at.values()) - clock.begin - pool_start) if len(started_at) == world_size else None,
        "run": max(user_ends) - min(started_at.values()) if started_at else None,
        # weight return: from the last rank finishing the user's code to the notebook loaded
        "return": end - max(user_ends),
        "load": end - clock.ranks_done,
    }


def _result(read: ReadCell, plan: Plan, ranks, ran: _Ran, started: bool, clock: _Clock) -> DataParallelResult:
    survey, applied, loaded = read.survey, ran.applied, ran.loaded
    done0: RankDone = ran.dones[0][0]
    return DataParallelResult(
        devices=list(ranks.devices), backend=plan.backend or "", modules=list(survey.modules),
        optimizers=loaded.optimizers, loaders=list(survey.loaders), stateful=survey.stateful,
        values=applied.bound + loaded.bound, defined=applied.defined, made=applied.made_names,
        stayed=loaded.stayed, strategy=read.strategy.name, tag=read.strategy.tag,
        not_returned=applied.not_returned + loaded.not_loaded + applied.not_defined + survey.notes,
        value=applied.value, per_rank={r: done.stats for r, (done, _) in enumerate(ran.dones)},
        pids=list(ranks.pids), pool_started=started, shipped_bytes=ran.packed.shipped_bytes,
        cached_bytes=ran.packed.cached_bytes, returned_bytes=done0.returned_bytes,
        timings=_timings(clock, started, ran.dones, ran.started_at, ranks.world_size))
