"""A ``%%dataparallel`` cell on one rank: the worker's side of :mod:`.run`.

:func:`rank_main` (a task of the :mod:`gpumagic.procs.worker` loop) rebuilds
the notebook values on the rank's device, wraps each trained module in DDP
and binds it to the cell's name (so ``model(x)`` averages gradients), splits
each DataLoader so the ranks share every global batch, seeds every rank
alike, runs the cell compiled under the notebook's cell name (tracebacks show
``Cell In[n], line k``), and sends back what the kernel loads: rank 0's
weights, optimizer state and plain values. Every rank keeps the large tensors
it trained for the next cell (:mod:`gpumagic.procs.tensor_cache`).

Runs in the workers: no IPython.
"""
from __future__ import annotations

import ast
import builtins
import contextlib
import logging
import time

from ..cell.compile import register_source
from ..cell.main_module import main_is_cell
from ..cell.rewrite.workers import bind_placement
from ..cell.trees import copy_tree, room_for, shipped
from ..memory.oom import reporting_out_of_memory
from ..procs import torch_settings
from ..procs.compile_settings import apply_compile_settings
from ..procs.loaders import ShardedBatchSampler, shard_loader
from ..procs.relays import rank_relays
from ..procs.seeding import seed_all
from ..procs.tensor_cache import TensorStore
from ..procs.wire import unpack_namespace
from .by_reference import notebook_objects
from .containers import snapshot as container_snapshot
from .grads import GRADS_KEY, start_from
from .launch import DistributionWatch, forget_kernel_process, launched
from .mode_guard import refusing_frameworks
from .rank_exports import exporting_once
from .rank_files import writing_once
from .rank_state import pack_state, rank0_state
from .returnable import attribute_snapshot
from .scripting import scripted_hint, scripting_users_modules
from .sharding import forget_kept, gather_into_notebook, kept_objects, shard_modules
from .touched import fingerprints
from .warm import Adopted, WarmModels, compile_counts, compile_forward, compile_note, follow_kept, forwards_set_aside
from .whole_values import whole_values
from .wrapping import (
    RankDevice,
    compressed_allreduce,
    held_objects_swapped,
    refuse_unaveraged_steps,
    wrap_in_ddp,
)

logger = logging.getLogger(__name__)

__all__ = ["rank_main", "TASK"]

TASK = "gpumagic.dataparallel.rank:rank_main"
PROGRESS_EVERY = 1.0   # seconds between a rank's progress messages


def _no_ipython():
    """``get_ipython()`` in a rank: None, as in any process that is not IPython (the kernel refuses
    magics and !commands in the cell before it starts)."""
    return None


def rank_main(ctx, meta: dict, data):
    """Run one cell on this rank; returns ``(payload, buffer)``."""
    store = ctx.state.setdefault("store", TensorStore())
    meta["tree"] = shipped(meta["tree"])
    try:
        return _run_cell(ctx, meta, data, store)
    except BaseException:
        store.clear()  # tensors handed to the failed cell may be half-updated
        forget_kept(ctx)
        warm = ctx.state.pop("warm", None)   # and so may a kept compiled model's weights and DDP state
        if warm is not None:
            ctx.state["warm_lost"] = warm.let_go("the last cell failed, which let the compiled model go")
        raise


def _run_cell(ctx, meta: dict, data, store: TensorStore):
    device = ctx.torch_device
    _apply_flags(meta["flags"], device)
    fsdp = meta.get("fsdp")
    stand_ins = rank_relays(meta.get("relays") or {}, ctx.send, active=ctx.rank == 0)   # the notebook's loggers
    if fsdp:
        stand_ins.update(kept_objects(ctx, fsdp))
    ns, tensors = unpack_namespace(meta["header"], data, device=device, store=store, shared=meta.get("shared"),
                                   stand_ins=stand_ins)
    grads = ns.pop(GRADS_KEY, None) or {}   # the notebook's gradients, which a plain cell would add to
    _prepare_namespace(ns, meta, device)
    seed_all(meta["seed"])
    launch = meta.get("launch")
    opts = {name: ns[name] for name in meta["optimizers"]}
    warm = _warm_models(ctx, meta)
    compiled_anew: dict = {}   # --compile: the models compiled anew this cell, with why
    if fsdp:
        inner = shard_modules(ctx, ns, meta, device)    # the optimizers follow their parameters into shards
    elif launch:
        # Launch mode: the cell's framework wraps and moves the modules; they train in place.
        inner = {name: ns[name] for name in meta["modules"]}
    else:
        inner, compiled_anew, tensors = _wrap_modules(ns, meta, device, warm, tensors)
        tensors = start_from(inner, grads, tensors, store)
    if not fsdp:
        # Optimizers: their own load_state_dict puts each state tensor beside its parameter.
        for opt in opts.values():
            opt.load_state_dict(opt.state_dict())
    shapes_before = {name: _shapes(module) for name, module in inner.items()} if not fsdp else {}
    # In launch mode the framework reads the data: its samples are not counted (None, shown as "-").
    stats = {"steps": 0, "samples": None if launch else 0, "seconds": 0.0}
    # what the cell's names now stand in for: a module inside its wrapper, a loader the rank's share of it
    swaps = {id(module): (module, ns[name]) for name, module in inner.items() if ns.get(name) is not module}
    if not launch:
        originals = {name: ns[name] for name in meta["loaders"]}
        _shard_loaders(ns, meta, ctx.rank, ctx.world_size, stats,
                       notify=lambda text: ctx.send({"kind": "warning", "text": text}))
        swaps.update({id(loader): (loader, ns[name]) for name, loader in originals.items() if ns[name] is not loader})
    compiling = warm is not None   # (--compile is refused with fsdp and in launch mode)
    counts_before = compile_counts() if compiling else (0, 0)
    gathered: dict = {}   # launch mode: modules the cell's framework sharded, whole (rank 0's)
    # Rank 0 answers for the notebook's other objects the cell may change (kept with the cell's meta).
    meta["attributes_before"] = attribute_snapshot(ns, meta.get("watched", []), meta.get("set_attributes", {})) \
        if ctx.rank == 0 else {}
    # and for names the cell binds to the notebook's own objects (alias = args): held, so ids stay theirs
    meta["objects_before"] = {id(v): (k, v) for k, v in ns.items() if not k.startswith("__")} \
        if ctx.rank == 0 else {}
    # and for the notebook's datasets and tensors, which datasets the cell sets on its objects may hold
    meta["notebook_objects"] = notebook_objects(ns, meta["assigned"], meta["attributes_before"]) \
        if ctx.rank == 0 else {}
    # and for the notebook tensors and arrays it reaches, whose contents a function it calls may set
    meta["arrays_before"] = fingerprints(ns, meta.get("arrays", [])) if ctx.rank == 0 else {}
    # and for its dicts and lists holding objects, whose items it may set (containers.py)
    meta["containers_before"] = container_snapshot(ns, meta.get("containers", [])) if ctx.rank == 0 else {}
    if launch:
        with launched(ctx.rank, ctx.world_size, launch["master_port"], launch["run_id"],
                      on_cpu=device.type == "cpu", master_addr=launch.get("master_addr", "127.0.0.1"),
                      node=getattr(ctx, "node", None), notebook=launch.get("notebook", False)), \
                DistributionWatch() as watch:
            forget_kernel_process(ns)
            value, t_start, t_end = _execute(ctx, ns, meta, device, stats)
        gathered = watch.sharded_state(inner)
        if stats["steps"] and ctx.world_size > 1 and ctx.rank == 0 and not watch.distributed(inner.values()):
            ctx.send({"kind": "warning", "text": (
                f"launch mode: the cell took {stats['steps']} optimizer steps on each rank, but nothing wrapped a "
                "model in DistributedDataParallel or FSDP: unless the cell averages gradients itself, every "
                f"rank did the whole training ({ctx.world_size} times the work of one process for the same "
                "result). Let the framework see the ranks (a Lightning Trainer with devices=N, an Accelerator "
                "made in the cell), or run a hand-written loop without --launch")})
    else:
        # DDP averages the modules it wraps (a module without trainable parameters is not wrapped);
        # FSDP the modules it sharded. Stepping anything else would train a copy per rank.
        wrapped = [name for name, m in inner.items() if fsdp or ns.get(name) is not m]
        averaged = [inner[name] for name in wrapped]
        frozen = [name for name in inner if name not in wrapped]
        wrappers = {name: ns[name] for name in wrapped if not fsdp and ns.get(name) is not inner[name]}
        scripted = meta["scripted"] = {}   # torch.jit.script(model): the user's module, as in a plain cell
        guard = refuse_unaveraged_steps(lambda: averaged, ns, wrapped, frozen, wrappers,
                                        hint=lambda name: scripted_hint(name, scripted)) \
            if ctx.world_size > 1 else None
        try:
            # (fsdp's ranks each hold a shard: a save there is the user's per-rank file, as written)
            with refusing_frameworks(), writing_once(ctx.rank) if not fsdp else contextlib.nullcontext(), \
                    exporting_once(ctx.rank), held_objects_swapped(ns, swaps), \
                    scripting_users_modules(wrappers, scripted):
                value, t_start, t_end = _execute(ctx, ns, meta, device, stats)
        finally:
            if guard is not None:
                guard.remove()
    if compiling and ctx.rank == 0:
        ctx.send({"kind": "note", "text": compile_note(counts_before, compile_counts(), stats, compiled_anew)})
    # Rank 0's gradients go back with the weights (a plain cell leaves them on the model). DDP's
    # average is the same on every rank: each keeps it with the weights, as one process holds its
    # gradients between cells, and the next cell, which starts from the notebook's (grads.py),
    # sends only their keys. (A framework's, in launch mode, are its own: not kept.)
    grads = _plain_grads(inner) if not fsdp else {}
    kept_grads = [g for n, held in grads.items() if n not in gathered for g in held.values() if g is not None] \
        if not launch else []
    for module in inner.values():
        for p in module.parameters():
            p.grad = None
    if fsdp:
        # The shards stay with sharding's own keeping; the store keeps the data the cell read.
        keys = store.rebuild(_trained_tensors(tensors, {}, {}))
        # A sharded value (clip_grad_norm_'s norm, a state_dict) is useless in the kernel: whole first.
        value, not_whole = whole_values(ctx, ns, meta["return_names"], value)
        return _gathered_payload(ctx, ns, meta, inner, opts, value, {
            "stats": stats, "t_user": (t_start, t_end), "keys": keys, "state": None}, not_whole)
    # A sharded module's tensors are shards: the workers keep none of them for the next cell.
    keys = store.rebuild(_trained_tensors(tensors + kept_grads, {n: m for n, m in inner.items() if n not in gathered},
                                          opts))
    payload: dict = {"stats": stats, "t_user": (t_start, t_end), "keys": keys, "state": None}
    buffer = None
    if ctx.rank == 0:
        state = rank0_state(ns, meta, inner, opts, value)
        state["grads"] = {n: g for n, g in grads.items() if n not in gathered}
        state["modules"].update(gathered)
        if gathered:
            _drop_sharded_optimizers(state, opts)
        # A module whose layers the cell replaced comes back whole: the notebook's takes its layers.
        state["reshaped"] = {n: m for n, m in inner.items() if n not in gathered and _shapes(m) != shapes_before[n]}
        with forwards_set_aside(inner.values()):   # reshaped models travel whole
            packed = pack_state(state, ctx.outgoing)
        payload["state"] = packed.header
        payload["returned_bytes"] = packed.nbytes
        buffer = packed.data()
    return payload, buffer


def _gathered_payload(ctx, ns: dict, meta: dict, inner: dict, opts: dict, value, payload: dict,
                      not_whole: list[str]):
    """--strategy fsdp: rank 0's plain values packed, then every rank gathers the sharded state
    (rank 0 writing it into the notebook's tensors or after those values)."""
    prefix = None
    if ctx.rank == 0:
        state = rank0_state(ns, meta, inner, opts, value)
        state["not_returned"] += not_whole
        state["modules"], state["optimizers"] = {}, {}   # these are gathered below, a tensor at a time
        packed = pack_state(state, None)
        payload["state"], prefix = packed.header, packed.data()
    gathered, buffer = gather_into_notebook(ctx, meta, inner, opts, prefix)
    payload["fsdp"] = gathered
    payload["returned_bytes"] = buffer.numel() if buffer is not None else 0
    return payload, buffer


def _drop_sharded_optimizers(state: dict, opts: dict) -> None:
    """Notebook optimizers whose state the cell's FSDP sharded stay as they were in the notebook
    (named among what was not returned): their moments are per-rank shards of the framework's
    parameters, which the notebook's optimizer cannot take."""
    from torch.distributed.tensor import DTensor
    for name, opt in opts.items():
        tensors = [p for g in opt.param_groups for p in g["params"]] + [
            v for st in opt.state.values() for v in st.values()]
        if any(isinstance(t, DTensor) for t in tensors):
            state["optimizers"].pop(name, None)
            state["not_returned"].append(f"{name} (its state is sharded by the cell's FSDP; the notebook's "
                                         "optimizer is left as it was)")


def _prepare_namespace(ns: dict, meta: dict, device) -> None:
    ns["__name__"] = "__main__"
    ns["__builtins__"] = builtins
    ns["get_ipython"] = _no_ipython
    for name in meta["device_strings"]:
        ns[name] = str(device) if device.type == "cuda" else "cpu"
    bind_placement(ns, meta.get("placement"), device)


def _warm_models(ctx, meta: dict) -> WarmModels | None:
    """This rank's kept compiled models (``--compile``), holding only those this cell may train;
    None without ``--compile``, when none are kept."""
    if not meta["ddp"].get("compile"):
        warm = ctx.state.pop("warm", None)
        if warm is not None:
            ctx.state["warm_lost"] = warm.let_go("a cell without --compile let the compiled model go")
        return None
    warm = ctx.state.get("warm") or ctx.state.setdefault("warm", WarmModels(ctx.state.pop("warm_lost", None)))
    warm.retain_only(meta["modules"])
    return warm


def _wrap_modules(ns: dict, meta: dict, device, warm: WarmModels | None, tensors: list):
    """Modules on the rank's device, wrapped in DDP, the cell's name bound to the wrapper.

    With ``--compile``, a model the rank compiled in an earlier cell is trained again when the
    shipped one is the same (:mod:`.warm`). Returns the user's modules by name, why each
    ``--compile`` model was compiled anew (name: reason), and ``tensors`` less the shipped
    copies that went into kept models.
    """
    ddp_kwargs: dict = {"gradient_as_bucket_view": True,
                  "static_graph": bool(meta["ddp"]["static_graph"]),
                  "find_unused_parameters": bool(meta["ddp"]["find_unused"])}
    if meta["ddp"]["bucket_mb"]:
        ddp_kwargs["bucket_cap_mb"] = meta["ddp"]["bucket_mb"]
    if device.type == "cuda":
        ddp_kwargs["device_ids"] = [device.index]
    after_build = []
    if meta["ddp"].get("grad_dtype", "fp32") != "fp32":
        hook = compressed_allreduce(meta["ddp"]["grad_dtype"])
        after_build.append(lambda wrapper: wrapper.register_comm_hook(None, hook))
    mode = meta["ddp"].get("compile")
    if mode:
        # The wrapped module's forward, in place (see compile_forward); traced while DDP's forward
        # is active, dynamo splits the graph at DDP's gradient buckets, so communication still
        # overlaps the backward pass.
        after_build.append(lambda wrapper: compile_forward(wrapper.module, mode))
    options = (tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(ddp_kwargs.items())),
               meta["ddp"].get("grad_dtype", "fp32"), mode, str(device))
    inner: dict = {}
    anew: dict = {}
    replaced: dict = {}   # by id: the shipped objects stay alive (in `shipped`) until it is used
    copied: set = set()
    shipped = []
    for name in meta["modules"]:
        module = ns[name]
        if warm is not None:
            found = warm.adopt(name, module, options)
            if isinstance(found, Adopted):
                ns[name], inner[name] = found.wrapper, found.module
                replaced.update(found.replaced)
                copied |= found.copied
                shipped.append(module)
                continue
            anew[name] = found
        module.to(device)
        inner[name] = module
        if any(p.requires_grad for p in module.parameters()):
            ns[name] = wrap_in_ddp(module, ddp_kwargs, after_build)
        elif mode:
            compile_forward(module, mode)
        if warm is not None:
            warm.keep(name, ns[name], module, options)
    if replaced:
        follow_kept(ns, replaced)
        tensors = [t for t in tensors if (t.device, t.data_ptr()) not in copied]
    del shipped
    return inner, anew, tensors


def _shard_loaders(ns: dict, meta: dict, rank: int, world: int, stats: dict, notify) -> None:
    for name in meta["loaders"]:
        sharded = shard_loader(ns[name], rank, world, split="batch", seed=meta["seed"], whole_without_grad=True,
                               sampler_class=TrainingPassSampler, follow_seed=True)   # every rank seeded alike
        sampler = sharded.batch_sampler
        assert isinstance(sampler, TrainingPassSampler)
        sampler.watch(name, stats, notify=notify if rank == 0 else None)
        ns[name] = sharded


def _execute(ctx, ns: dict, meta: dict, device, stats: dict):
    """Run the cell; returns its last expression's value and when the user's code started and ended."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    tree = meta["tree"]
    filename = meta["filename"]
    register_source(filename, meta["source"])
    with room_for(tree):   # (a deep cell, which the kernel took: rewritten and compiled here too)
        if device.type == "cuda":
            tree = ast.fix_missing_locations(RankDevice(device.index).visit(copy_tree(tree)))
        body_nodes = list(tree.body)
        last_expr = None
        if body_nodes and isinstance(body_nodes[-1], ast.Expr):
            last_expr = compile(ast.Expression(body_nodes.pop().value), filename, "eval")
        body = compile(ast.Module(body_nodes, type_ignores=[]), filename, "exec")

    t_start = time.monotonic()
    last_sent = [t_start]

    def on_step(optimizer, args, kwargs):
        stats["steps"] += 1
        now = time.monotonic()
        if stats["steps"] == 1:
            stats["first_step"] = now - t_start
        if now - last_sent[0] >= PROGRESS_EVERY:
            last_sent[0] = now
            stats["seconds"] = now - t_start
            ctx.send({"kind": "progress", "stats": dict(stats)})

    handle = register_optimizer_step_post_hook(on_step)
    ctx.send({"kind": "started", "t": t_start})
    try:
        with main_is_cell(ns), _counting_backwards(stats), \
                reporting_out_of_memory(ns, ctx.rank, ctx.world_size):   # (classes pickle as __main__.X)
            exec(body, ns)
            value = eval(last_expr, ns) if last_expr is not None else None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        handle.remove()
    t_end = time.monotonic()
    stats["seconds"] = t_end - t_start
    return value, t_start, t_end


@contextlib.contextmanager
def _counting_backwards(stats: dict):
    """``stats["backwards"]`` counts the cell's backward passes (``loss.backward()`` goes through
    ``torch.autograd.backward``): a split pass that steps no optimizer but runs backward accumulates
    gradients for a later cell, which is training, not an evaluation that forgot ``no_grad()``."""
    import torch.autograd
    original = torch.autograd.backward
    stats.setdefault("backwards", 0)

    def backward(*args, **kwargs):
        stats["backwards"] += 1
        return original(*args, **kwargs)
    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = original


def _trained_tensors(tensors: list, inner: dict, opts: dict) -> list:
    """What every rank holds for the next cell: what it trained, and the data it read."""
    import torch
    held = list(tensors)
    for module in inner.values():
        held += list(module.state_dict(keep_vars=True).values())
    for opt in opts.values():
        for st in opt.state.values():
            held += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return held


def _plain_grads(inner: dict) -> dict:
    """``{module: {parameter: grad or None}}``; a module with sharded gradients (the cell's own FSDP)
    has none to give."""
    import torch
    grads = {}
    for name, module in inner.items():
        params = dict(module.named_parameters())
        if all(p.grad is None or type(p.grad) is torch.Tensor for p in params.values()):
            grads[name] = {k: p.grad for k, p in params.items()}
    return grads


def _shapes(module) -> dict:
    return {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items()}


def _apply_flags(flags: dict, device) -> None:
    """The kernel's torch settings (matmul precision, cuDNN, default dtype and device, deterministic
    algorithms...) and torch.compile's, which decide results as much as the code."""
    torch_settings.apply({k: v for k, v in flags.items() if k != "compile_settings"}, device=device)
    apply_compile_settings(flags.get("compile_settings", {}))


class TrainingPassSampler(ShardedBatchSampler):
    """A rank's share of a loader's batches, counted for the progress display.

    A pass read whole (gradients off: an evaluation) is not training: its
    samples are not counted. A split pass in which no optimizer steps is
    probably an evaluation that forgot ``torch.no_grad()`` (unless it ran
    backward, accumulating gradients for a later cell): what the cell
    computes from it covers rank 0's share only, and a warning says so.
    """

    def watch(self, name: str, stats: dict, notify=None) -> None:
        """Count into ``stats``; ``notify(text)`` shows a warning in the notebook (rank 0's)."""
        self.name, self.stats, self.notify = name, stats, notify
        self.warned = False

    def __iter__(self):
        split = self.splits_this_pass()
        steps_before, backwards_before = self.stats["steps"], self.stats.get("backwards", 0)
        for batch in super().__iter__():
            if split:
                self.stats["samples"] += len(batch)
            yield batch
        trained = self.stats["steps"] != steps_before or self.stats.get("backwards", 0) != backwards_before
        if split and not trained and self.notify is not None and not self.warned:
            self.warned = True
            self.notify(
                f"DataLoader {self.name!r} was split across the ranks but no optimizer step followed: what the "
                "cell computed from it covers rank 0's share only. Read it under torch.no_grad() (as an "
                "evaluation) and every rank reads it whole.")
