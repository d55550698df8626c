"""``%%dataparallel`` with worker processes: DistributedDataParallel, one process per device.

The kernel's side of a cell (:func:`run_cell`): find what the cell trains
(modules, their optimizers, the DataLoaders it reads, LR schedulers and other
objects with a ``state_dict``), ship them and every other notebook value the
cell reads to the pool (:mod:`gpumagic.procs.pool`), stream rank 0's output
into the cell, and, when every rank has finished, load rank 0's weights,
buffers and optimizer state into the notebook's own objects in place and bind
the plain values the cell assigned (:mod:`.results`). Nothing in the notebook
changes unless every rank succeeded. The ranks' side is :mod:`.rank`.

Why the result equals single-process training: each global batch is split
into equal shares, each rank's loss is the mean over its share, DDP averages
the gradients, so the update is that of the mean loss over the whole batch.

In a notebook the magic is the way in::

    %%dataparallel --nprocs 2
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from ..cell.compile import compile_cell, refuse_shell_calls
from ..cell.definitions import define_in_notebook
from ..cell.names import names_deleted
from ..cell.rewrite.workers import rewrite_for_cpu_workers
from ..cell.trees import Flat, room_for
from ..cell.values import instead_of_sending
from ..cell.with_targets import quiet_targets
from ..display import note
from ..errors import usage_error
from ..procs import torch_settings
from ..procs.compile_settings import notebook_compile_settings
from ..procs.output import RankOutput
from ..procs.relays import Relays
from ..procs.rendezvous import free_loopback_port
from ..procs.seeding import draw_seed
from ..procs.teardown import interrupts_deferred
from ..procs.wire import Packed, Unshippable, pack_namespace
from . import held
from .detect import choose_mode
from .fsdp import (
    choose_all_blocks,
    gather_deferred_state,
    load_gathered,
    on_meta,
    prepare_shipment,
    private_again,
)
from .grads import GRADS_KEY, notebook_grads
from .plan import POOL_NAME, Plan, check_launch
from .progress import Progress
from .rank import TASK
from .results import CellResult, NotebookName, adopt_cell_classes, cloned, load_into_notebook, unbind_not_returned
from .survey import CellSurvey, item_notes, read_names, survey_cell, warn_in_cell

logger = logging.getLogger(__name__)

__all__ = ["run_cell", "last_result", "CellSurvey", "survey_cell"]

# Modules each rank imports while the pool starts: DistributedDataParallel's constructor imports
# torch._dynamo (over a second), better paid then than in the user's first cell.
RANK_PRELOAD = ("gpumagic.dataparallel.rank", "torch._dynamo", "torch.nn.parallel")

_last: CellResult | None = None


def last_result() -> CellResult | None:
    """The :class:`CellResult` of the last ``%%dataparallel`` cell run with worker processes."""
    return _last


def _tensor_targets(survey: CellSurvey, modules_to: str = "rank") -> dict:
    """Tensors of the trained modules go to the rank's device (``modules_to``: fsdp shards them from
    the CPU); optimizer state stays put until the optimizer places it beside its parameter."""
    import torch
    targets = {}
    for m in survey.modules.values():
        for t in m.state_dict(keep_vars=True).values():
            targets[id(t)] = modules_to
        for p in m.parameters():   # (the notebook's gradients, which the ranks start from: grads.py)
            if p.grad is not None:
                targets[id(p.grad)] = modules_to
    for opt in survey.optimizers.values():
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    targets[id(v)] = "keep" if modules_to == "rank" else modules_to
    return targets


def _backend_flags() -> dict:
    """The kernel's torch settings (matmul precision, default dtype...) and torch.compile's config."""
    return {**torch_settings.current(), "compile_settings": notebook_compile_settings()}


def _pool(plan: Plan):
    """This machine's worker pool (started if needed), or the cluster's engines; and whether it started."""
    if plan.cluster is not None:
        from .cluster_setup import connect, form
        ranks = connect(plan.cluster)
        formed = ranks.formed
        return form(ranks, plan.nprocs, plan.backend, plan.timeout), not formed
    from ..procs import pool as poolmod
    return poolmod.get_pool(POOL_NAME, plan.devices, plan.backend, timeout=plan.timeout, preload=RANK_PRELOAD)


def _on_cluster(plan: Plan) -> tuple[Plan, bool]:
    """A ``--cluster`` plan with the engines' devices and backend: the engines are found and formed into
    ranks now, before anything of the cell travels (``UsageError`` where they cannot be). Also whether
    they were formed now."""
    import dataclasses
    ranks, formed_now = _pool(plan)
    return dataclasses.replace(plan, devices=list(ranks.devices), backend=ranks.backend), formed_now


def _unshippable(exc: Unshippable):
    what = "; ".join(f"{name} ({type(value).__name__}: {error})" for name, value, error in exc.problems)
    advice = [a for a in (instead_of_sending(n, v) for n, v, _ in exc.problems) if a]
    return usage_error(f"cannot send to the worker processes: {what}. "
                       + ("; ".join(advice) or "Create such objects inside the cell")
                       + ", or run the cell with --strategy dp (in the kernel)")


def _read_cell(shell, cell: str, plan: Plan, header: str) -> tuple:
    """The cell compiled, what it trains and reads (its survey), whether it runs in launch mode, the fsdp
    blocks, and the tree the ranks run (with its placement helper): ``UsageError`` where it cannot run."""
    ns = shell.user_ns
    compiled = compile_cell(shell, cell, header=header)
    with room_for(compiled.tree):   # (what reads the cell walks its tree recursively: a deep cell needs room)
        refuse_shell_calls(compiled.tree, "%%dataparallel")
        used = read_names(compiled.tree, shell)
        mode, why = choose_mode(compiled.tree, ns, used, launch=plan.launch)
        launch = mode == "launch"
        if launch:
            if plan.strategy == "fsdp":
                raise usage_error(f"--strategy fsdp shards a hand-written loop's model, but {why}, which distributes "
                                  "by itself (launch mode): ask it for FSDP (TrainingArguments(fsdp=...), accelerate's "
                                  "FSDP plugin, Lightning's FSDPStrategy) and drop --strategy fsdp",
                                  ["%%dataparallel", "%%dataparallel --launch"])
            check_launch(plan, why)
        survey = survey_cell(compiled.tree, shell, plan, launch=launch, used=used, filename=compiled.filename)
        blocks = choose_all_blocks(survey.modules, plan.wrap) if plan.strategy == "fsdp" else None
        if launch and not plan.launch:
            note(f"%%dataparallel: launch mode, because {why}: every rank runs the cell as a process torchrun "
                 "started, and the cell's own code wraps the model and splits the data")
        # On CPU ranks, a cell written for .cuda() runs on the CPU (the %%ondevice rewrite).
        ship_tree, helper = rewrite_for_cpu_workers(compiled.tree, ns) if plan.devices[0] == "cpu" \
            else (compiled.tree, None)
    return compiled, survey, launch, blocks, ship_tree, helper


def run_cell(shell, cell: str, plan: Plan, header: str = "%%dataparallel") -> CellResult:
    """Run ``cell`` on the pool described by ``plan``; returns a :class:`~.results.CellResult`.

    Raises ``UsageError`` before anything runs when the cell trains no
    module, ``WorkerError`` when a rank fails (the notebook unchanged), and
    re-raises ``KeyboardInterrupt`` after ending the ranks.
    """
    global _last
    t_begin = time.monotonic()
    t_cluster, cluster_formed = 0.0, False
    if plan.cluster is not None and not plan.devices:
        plan, cluster_formed = _on_cluster(plan)
        t_cluster = time.monotonic() - t_begin if cluster_formed else 0.0
    ns = shell.user_ns
    compiled, survey, launch, blocks, ship_tree, helper = _read_cell(shell, cell, plan, header)
    if plan.cluster is None:
        from ..procs import pool as poolmod
        local = poolmod.current_pool(POOL_NAME)
        held.check_cell(ns, set(survey.used), plan.strategy, local,
                        local is not None and local.serves(plan.devices, plan.backend, plan.timeout))
    on_meta_device = [n for n, m in survey.modules.items() if on_meta(m)]
    if on_meta_device and blocks is None and not launch:
        raise usage_error(f"{', '.join(on_meta_device)} is on the meta device (it has no weights to copy to the "
                          "ranks): --strategy fsdp initialises such a model on the ranks and trains it there",
                          ["--strategy fsdp"])
    t_before_pool = time.monotonic()
    pool, started = _pool(plan)
    t_pool = time.monotonic()
    shipment = prepare_shipment(compiled.tree, survey.modules, survey.optimizers, pool, blocks,
                                plan.keep_optimizer, ns) if blocks is not None else None
    try:
        ran = _ship_run_load(shell, plan, compiled, survey, pool, shipment, launch, (ship_tree, helper))
    except BaseException:
        if shipment is not None:   # however the cell ends, the optimizer's state is the notebook's own again
            private_again(survey.optimizers, shipment)
        raise
    packed, results, started_at, state = ran.packed, ran.results, ran.started_at, ran.state
    payload = results[0][0]
    defined, not_defined = state["defined_names"], state["not_defined"]
    t_packed, t_ranks_done = ran.t_packed, ran.t_ranks_done
    t_end = time.monotonic()
    started = started or cluster_formed
    pool_start = ((t_pool - t_before_pool) if started else 0.0) + t_cluster
    user_ends = [p["t_user"][1] for p, _ in results]
    _last = CellResult(
        devices=list(pool.devices), backend=plan.backend or "", modules=list(survey.modules),
        # (a notebook optimizer whose state a framework sharded is left as it was: not named as loaded)
        optimizers=[n for n in survey.optimizers if shipment is not None or n in state.get("optimizers", {})],
        loaders=list(survey.loaders), stateful=survey.stateful,
        values=state["bound"], defined=defined, made=state["made_names"], stayed=state.get("stayed", []),
        strategy=plan.strategy,
        not_returned=state.get("not_returned", []) + state["not_loaded"] + not_defined + item_notes(
            survey.item_targets),
        value=ns.get(state["value"].name) if isinstance(state.get("value"), NotebookName) else state.get("value"),
        per_rank={r: p["stats"] for r, (p, _) in enumerate(results)}, pids=list(pool.pids), pool_started=started,
        shipped_bytes=packed.shipped_bytes, cached_bytes=packed.cached_bytes,
        returned_bytes=payload.get("returned_bytes", 0),
        timings={
            "total": t_end - t_begin,
            "pool_start": pool_start,
            "pack": t_packed - t_pool,
            # cell start: from the magic's first line to every rank running the user's code,
            # not counting the pool's start
            "start": (max(started_at.values()) - t_begin - pool_start)
            if len(started_at) == pool.world_size else None,
            "run": max(user_ends) - min(started_at.values()) if started_at else None,
            # weight return: from the last rank finishing the user's code to the notebook loaded
            "return": t_end - max(user_ends),
            "load": t_end - t_ranks_done,
        },
    )
    return _last


@dataclass
class _Ran:
    """A cell the ranks ran, and its result loaded into the notebook."""
    packed: Packed
    results: list
    started_at: dict
    state: dict
    t_packed: float
    t_ranks_done: float


def _ship_run_load(shell, plan: Plan, compiled, survey: CellSurvey, pool, shipment, launch: bool,
                   ship: tuple) -> _Ran:
    """Pack what the cell reads, run it on every rank, and load rank 0's result into the notebook."""
    ns = shell.user_ns
    ship_tree, helper = ship
    relays = Relays()   # the notebook's loggers (a SummaryWriter) stay here; rank 0's calls come back to them
    values = {n: ns[n] for n in survey.used}
    values[GRADS_KEY] = notebook_grads(survey.modules, fsdp=shipment is not None, launch=launch)  # (rank's)
    try:
        packed, _ = pack_namespace(values, ns, targets=_tensor_targets(survey, "cpu" if shipment else "rank"),
                                   held=pool.held, scratch=pool.outgoing,
                                   share=shipment.share if shipment else None,
                                   stand_ins=shipment.stand_ins if shipment else None,
                                   stand_in_for=relays.stand_in_for)
    except Unshippable as exc:
        raise _unshippable(exc) from None
    # From here the ranks replace what they hold; until the cell's end says what that is, the
    # kernel counts on nothing (an interrupt anywhere after this ships everything next time).
    pool.held = set()
    t_packed = time.monotonic()
    meta = _meta(shell, plan, compiled, survey, pool, packed, shipment, launch, ship_tree, helper, relays)
    results, started_at = _run_on_pool(pool, meta, packed.data(), shell, plan.all_output, relays)
    t_ranks_done = time.monotonic()
    payload, buffer = results[0]
    # Writing the trained state back takes about as long as copying the model once; an interrupt
    # meanwhile would leave some tensors trained and others not, so it waits for the end.
    with interrupts_deferred() as interrupted:
        state = _load(ns, pool, payload, buffer, survey, shipment,
                      define=lambda names: define_in_notebook(ns, compiled.tree, compiled.filename, names))
        if shipment is not None:
            held.keep(pool, state.get("stayed", []), [*survey.modules, *survey.optimizers], ns)
        torch_settings.apply(state.get("torch_settings") or {})   # what the cell set: torch.set_default_dtype...
        adopt_cell_classes(ns, state["made_names"] + state["object_names"], state["defined_names"])
        # Every rank holds these tensors now; the notebook holds the same bytes (rank 0's).
        pool.held = set.intersection(*(set(p["keys"]) for p, _ in results))
    if interrupted:
        note("%%dataparallel: interrupted while the trained state was written back into the notebook; the "
             "write was finished first, so the notebook holds the whole result of the cell")
        raise KeyboardInterrupt
    return _Ran(packed, results, started_at, state, t_packed, t_ranks_done)


def _meta(shell, plan: Plan, compiled, survey: CellSurvey, pool, packed, shipment, launch: bool, ship_tree,
          helper, relays: Relays) -> dict:
    """What every rank is told about the cell (beside the packed values)."""
    notebook = getattr(shell, "kernel", None) is not None
    return {
        # (Flat: a deep cell's tree pickles without recursion, and unpickles as the tree)
        "header": packed.header, "tree": Flat(ship_tree), "filename": compiled.filename, "source": compiled.source,
        "modules": list(survey.modules), "optimizers": list(survey.optimizers), "loaders": list(survey.loaders),
        "stateful": survey.stateful, "device_strings": survey.device_strings,
        "return_names": survey.return_names, "filled": survey.filled, "arrays": survey.arrays,
        "containers": survey.containers,
        "assigned": survey.assigned, "deleted": names_deleted(compiled.tree),
        "watched": survey.watched, "watched_if_kept": survey.watched_if_kept,
        "set_attributes": survey.set_attributes,
        "loop_targets": quiet_targets(compiled.tree),   # (a profiler bound by `with ... as` is not one)
        "seed": plan.seed if plan.seed is not None else draw_seed(),
        "flags": _backend_flags(), "all_output": plan.all_output, "placement": helper,
        # a notebook kernel shows rich output: the ranks' tqdm bars are drawn as HTML (procs.tqdm_relay),
        # and in launch mode rank 0 draws the frameworks' notebook progress
        "notebook": notebook,
        "launch": {**_launch_address(pool, plan), "notebook": notebook}
        if launch else None,
        "relays": relays.found,
        "fsdp": shipment.config if shipment else None,
        "shared": packed.shared,   # tensors sent by reference (shared memory): the fsdp models
        "ddp": {"static_graph": plan.static_graph, "find_unused": plan.find_unused, "bucket_mb": plan.bucket_mb,
                "grad_dtype": plan.grad_dtype, "compile": plan.compile},
    }


def _launch_address(pool, plan: Plan) -> dict:
    """Launch mode's MASTER_ADDR and MASTER_PORT (rank 0's host, a port free there) and run id."""
    address, port = pool.launch_address() if plan.cluster is not None else ("127.0.0.1", free_loopback_port())
    return {"master_addr": address, "master_port": port, "run_id": f"gpumagic-{os.getpid()}-{pool.pids[0]}"}


def _run_on_pool(pool, meta: dict, data, shell, all_output: bool, relays: Relays | None = None) -> tuple[list, dict]:
    """Run the cell on every rank, showing output and progress; returns results and start times."""
    progress = Progress(pool.devices, shell)
    output = RankOutput(prefix=all_output)
    started_at: dict[int, float] = {}
    writing = []

    def on_message(rank, msg):
        if msg.get("kind") == "writing":
            writing.append(rank)
        elif msg.get("kind") == "started":
            started_at[rank] = msg["t"]
        elif msg.get("kind") == "progress":
            progress.update(rank, msg["stats"])
        elif msg.get("kind") == "warning":
            warn_in_cell(msg["text"], meta["filename"])
        elif msg.get("kind") == "note":
            note(msg["text"])
        elif msg.get("kind") == "relay" and relays is not None:
            failed = relays.replay(msg)
            if failed:
                note(failed)

    try:
        results = pool.run(TASK, meta, data, on_output=output.write, on_message=on_message, on_tick=progress.tick)
    except BaseException as exc:
        pool.held = set()
        pool.fsdp_records = None   # the ranks dropped their shards
        held.lost("the cell failed, so they dropped what they kept", shell.user_ns)
        if "CellDDP" in str(exc) and not meta.get("launch"):
            # a framework the cell reaches in a way detection missed (getattr, a helper module) got our wrapper
            note("%%dataparallel: the cell's code was handed gpumagic's DDP wrapper (CellDDP) and refused it: if "
                 "the cell distributes by itself (a framework's trainer, your own DDP), run it with --launch")
        if writing:
            note("%%dataparallel --strategy fsdp: stopped while rank 0 was writing the trained state into the "
                 "notebook's tensors: the model and optimizer hold a mix of their state before and after the "
                 "cell. Load a checkpoint, or run the training again")
        elif isinstance(exc, KeyboardInterrupt) and getattr(pool, "name", "") == "cluster":
            # a cluster's engines are signalled, not ended: they stay (a note names any that were stopped)
            note("%%dataparallel --cluster: interrupted; the cell ended on the engines, and the notebook's objects "
                 "are as they were before the cell")
        elif isinstance(exc, KeyboardInterrupt):
            note("%%dataparallel: interrupted; the ranks were stopped, and the notebook's objects are as they "
                 "were before the cell")
        raise
    finally:
        output.flush()
    for rank, (payload, _) in enumerate(results):
        progress.update(rank, payload["stats"])
    progress.tick(final=True)
    return results, started_at


def _load(ns: dict, pool, payload: dict, buffer, survey: CellSurvey, shipment=None, define=None) -> dict:
    """Rank 0's state into the notebook's objects; returns it with ``bound``, the values bound,
    ``defined_names`` and ``not_defined`` (``define``: :func:`~.results.load_into_notebook`'s), and
    ``stayed`` (fsdp state left in the workers)."""
    from ..procs.wire import unpack
    try:
        state, _ = unpack(payload["state"], buffer, device="cpu", views_from=0)
        # Weights are copied into the notebook's tensors; values are kept: they must not be
        # views of the receive buffer that the next cell reuses.
        state["values"], state["value"] = cloned(state["values"]), cloned(state.get("value"))
        for key in ("attributes", "attributes_filled", "attribute_items", "containers"):
            state[key] = cloned(state.get(key) or {})
        modules, optimizers = ({}, {}) if shipment else (survey.modules, survey.optimizers)
        loaded = load_into_notebook(ns, state, modules, optimizers, survey.stateful, define)
        state["bound"], state["made_names"] = loaded["values"], loaded["made"]
        state["defined_names"], state["not_defined"] = loaded["defined"], loaded["not_defined"]
        state["object_names"], state["not_loaded"] = loaded["objects"], loaded["not_loaded"]
        unbind_not_returned(ns, survey.assigned, state.get("not_returned", []) + state["not_loaded"],
                            state.get("still_bound", []))
        if shipment:
            made = gather_deferred_state(payload["fsdp"], pool)
            state["stayed"] = load_gathered(payload["fsdp"], buffer, survey.modules, survey.optimizers, pool,
                                            shipment, made, state.get("settings"))
    except BaseException:
        pool.held = set()
        pool.fsdp_records = None
        held.lost("loading the trained state failed, so they dropped what they kept", ns)
        # fsdp's rank 0 wrote into the notebook's tensors before the kernel began: those stay written
        written = sorted({ref[1] for ref, offset, *_ in (payload.get("fsdp") or {}).get("tensors", []) if offset < 0})
        if shipment and written:
            note(f"%%dataparallel --strategy fsdp: loading the cell's result failed after rank 0 had written the "
                 f"trained tensors of {', '.join(written)} into the notebook's in place: those hold their state after "
                 "the cell, the rest (other optimizer state, schedulers, values) as before it. Run the training "
                 "again, or load a checkpoint")
        raise
    return state
