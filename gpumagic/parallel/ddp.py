"""``%%dataparallel`` with worker processes: DistributedDataParallel, one process per device.

Kernel side (:func:`run_cell`): find what the cell trains (modules, their
optimizers, the DataLoaders it reads, LR schedulers and other objects with a
``state_dict``), ship them and every other notebook value the cell reads to
the pool, stream rank 0's output into the cell, and, when every rank has
finished, load rank 0's weights, buffers and optimizer state into the
notebook's own objects in place and bind the plain values the cell assigned.
Nothing in the notebook changes unless every rank succeeded.

Worker side (:func:`rank_main`): rebuild the values on the rank's device,
wrap each module in :class:`CellDDP` and bind it to the cell's name (so
``model(x)`` goes through DDP and gradients are averaged), shard each
DataLoader so the ranks split every global batch, seed every rank alike, run
the cell compiled under the notebook's cell name (tracebacks show
``Cell In[n], line k``) and send back what the kernel loads.

Why the result equals single-process training: each global batch is split
into equal shares, each rank's loss is the mean over its share, DDP averages
the gradients, so the update is that of the mean loss over the whole batch.
"""
from __future__ import annotations

import ast
import builtins
import copy
import re
import sys
import time
import types
import warnings
from dataclasses import dataclass, field

from ..cell import compile as cells
from ..errors import usage_error
from ..cell.names import find_loaders, find_modules, find_optimizers, is_plain_value, names_assigned
from . import POOL_NAME, Plan

__all__ = ["run_cell", "rank_main", "CellDDP", "CellResult", "used_names", "last_result"]

TASK = "gpumagic.parallel.ddp:rank_main"
_GLOBALS_KEY = "__gpumagic_globals__"
_HISTORY = re.compile(r"^(_+|_i+|_i?\d+|_(dh|oh|ih)|In|Out)$")
_CUDA_STRING = re.compile(r"^cuda(:\d+)?$")

_last: "CellResult | None" = None


def last_result() -> "CellResult | None":
    """The :class:`CellResult` of the last ``%%dataparallel`` cell run with worker processes."""
    return _last


@dataclass
class CellResult:
    """What a ``%%dataparallel`` cell did, for display and for benchmarks."""
    devices: list[str]
    backend: str
    modules: list[str]
    optimizers: list[str]
    loaders: list[str]
    stateful: list[str]
    values: list[str] = field(default_factory=list)          # plain values bound in the notebook
    not_returned: list[str] = field(default_factory=list)    # assigned names left in the workers
    value: object = None                                     # rank 0's last expression
    per_rank: dict = field(default_factory=dict)             # rank -> steps, samples, seconds
    pids: list = field(default_factory=list)
    pool_started: bool = False
    timings: dict = field(default_factory=dict)
    shipped_bytes: int = 0
    cached_bytes: int = 0
    returned_bytes: int = 0

    def summary(self) -> str:
        what = ", ".join(self.modules + self.optimizers + self.stateful)
        ranks = f"{len(self.devices)} rank{'s' if len(self.devices) != 1 else ''} ({self.backend})"
        steps = {s.get("steps", 0) for s in self.per_rank.values()}
        step_text = f", {next(iter(steps))} optimizer steps each" if len(steps) == 1 and steps != {0} else ""
        text = f"%%dataparallel: {ranks}{step_text}; trained state loaded into {what}"
        if self.values:
            text += f"; values: {', '.join(self.values)}"
        return text


class RemoteRepr:
    """Rank 0's last expression when it cannot travel: shown by its repr."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self):
        return self.text


# ====================================================================== kernel side

def used_names(tree: ast.AST, namespace: dict, depth: int = 3) -> list[str]:
    """Notebook names the cell reads (see :func:`free_reads`), plus the globals of the
    notebook functions it calls (``train(...)``), transitively."""
    found: dict[str, None] = dict.fromkeys(free_reads(tree))
    frontier = list(found)
    seen_code: set = set()
    for _ in range(depth):
        nxt = []
        for name in frontier:
            for code in _code_objects(namespace.get(name), namespace):
                if id(code) in seen_code:
                    continue
                seen_code.add(id(code))
                for g in _global_names(code):
                    if g not in found and g in namespace:
                        found[g] = None
                        nxt.append(g)
        frontier = nxt
    return list(found)


def _code_objects(value, namespace):
    """Code of notebook functions (and of methods of notebook classes) that ``value`` is."""
    if isinstance(value, types.FunctionType) and value.__globals__ is namespace:
        yield value.__code__
    elif isinstance(value, type) and getattr(value, "__module__", None) == namespace.get("__name__", "__main__"):
        for attr in vars(value).values():
            if isinstance(attr, (staticmethod, classmethod)):
                attr = attr.__func__
            if isinstance(attr, types.FunctionType) and attr.__globals__ is namespace:
                yield attr.__code__


def _global_names(code):
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def free_reads(tree: ast.AST) -> list[str]:
    """Names the cell may read before binding them itself: the notebook values it needs.

    ``it = iter(loader)`` or ``x, y = batch`` inside the loop bind before they
    read, so the notebook's old ``it``, ``x``, ``y`` are not shipped (an old
    iterator would not even pickle; old batches would cost memory and time).
    Bindings inside ``if``/``for``/``while``/``try`` count only inside them,
    since they may not run; functions and lambdas count all their reads.
    """
    reads: dict[str, None] = {}
    _block(getattr(tree, "body", []), set(), reads)
    return list(reads)


def _expr_reads(node, bound: set, reads: dict, local: frozenset = frozenset()) -> None:
    if node is None:
        return
    if isinstance(node, ast.Name):
        if isinstance(node.ctx, ast.Load) and node.id not in bound and node.id not in local:
            reads.setdefault(node.id, None)
        return
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
        targets = {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        inner = local | targets
        for g in node.generators:
            _expr_reads(g.iter, bound, reads, inner)
            for cond in g.ifs:
                _expr_reads(cond, bound, reads, inner)
        for part in ([node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]):
            _expr_reads(part, bound, reads, inner)
        return
    if isinstance(node, ast.Lambda):
        args = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
        for d in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            _expr_reads(d, bound, reads, local)
        _expr_reads(node.body, bound, reads, local | args)
        return
    for child in ast.iter_child_nodes(node):
        _expr_reads(child, bound, reads, local)


def _store_names(node) -> set:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _block(stmts, bound: set, reads: dict) -> None:
    """Walk statements in execution order; ``bound`` grows with what is surely bound."""
    for st in stmts:
        if isinstance(st, ast.Assign):
            _expr_reads(st.value, bound, reads)
            for t in st.targets:
                _expr_reads(t, bound, reads)          # subscripts/attributes read their base
                bound |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(st, ast.AnnAssign):
            _expr_reads(st.value, bound, reads)
            if st.value is not None and isinstance(st.target, ast.Name):
                bound.add(st.target.id)
            elif not isinstance(st.target, ast.Name):
                _expr_reads(st.target, bound, reads)
        elif isinstance(st, ast.AugAssign):
            _expr_reads(st.value, bound, reads)
            if isinstance(st.target, ast.Name):
                if st.target.id not in bound:
                    reads.setdefault(st.target.id, None)
            else:
                _expr_reads(st.target, bound, reads)
        elif isinstance(st, (ast.For, ast.AsyncFor)):
            _expr_reads(st.iter, bound, reads)
            _block(st.body, bound | _store_names(st.target), reads)
            _block(st.orelse, set(bound), reads)
        elif isinstance(st, ast.While):
            _expr_reads(st.test, bound, reads)
            _block(st.body, set(bound), reads)
            _block(st.orelse, set(bound), reads)
        elif isinstance(st, ast.If):
            _expr_reads(st.test, bound, reads)
            _block(st.body, set(bound), reads)
            _block(st.orelse, set(bound), reads)
        elif isinstance(st, (ast.With, ast.AsyncWith)):
            for item in st.items:
                _expr_reads(item.context_expr, bound, reads)
                if item.optional_vars is not None:
                    bound |= _store_names(item.optional_vars)
            _block(st.body, bound, reads)               # a with-body always starts
        elif isinstance(st, ast.Try) or type(st).__name__ == "TryStar":
            _block(st.body, set(bound), reads)
            for h in st.handlers:
                _expr_reads(h.type, bound, reads)
                _block(h.body, bound | ({h.name} if h.name else set()), reads)
            _block(st.orelse, set(bound), reads)
            _block(st.finalbody, set(bound), reads)
        elif isinstance(st, (ast.Import, ast.ImportFrom)):
            for alias in st.names:
                if alias.name != "*":
                    bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            # Reads inside may happen at any later call: count them all (minus the function's own names).
            own = {a.arg for a in ast.walk(st) if isinstance(a, ast.arg)} | _store_names(st)
            for node in ast.walk(st):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) \
                        and node.id not in bound and node.id not in own:
                    reads.setdefault(node.id, None)
            bound.add(st.name)
        elif isinstance(st, (ast.Global, ast.Nonlocal)):
            continue
        elif type(st).__name__ == "Match":
            _expr_reads(st.subject, bound, reads)
            for case in st.cases:
                for node in ast.walk(case):
                    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in bound:
                        reads.setdefault(node.id, None)
        else:
            _expr_reads(st, bound, reads)


def _loop_targets(tree: ast.AST) -> list[str]:
    """Names bound by ``for`` and ``with ... as`` (batches, files): not worth a note when left behind."""
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.For, ast.AsyncFor)):
            targets = [node.target]
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            targets = [item.optional_vars for item in node.items if item.optional_vars is not None]
        for target in targets:
            found.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return sorted(found)


def _names_tree(names: list[str]) -> ast.Module:
    """A tree that reads exactly ``names`` (to ask the namespace helpers about them)."""
    return ast.Module([ast.Expr(ast.Name(id=n, ctx=ast.Load())) for n in names], type_ignores=[])


def _shippable_names(names: list[str], shell) -> list[str]:
    ns = shell.user_ns
    hidden = getattr(shell, "user_ns_hidden", {})
    out = []
    for n in names:
        if n not in ns or _HISTORY.match(n):
            continue
        if n in hidden and hidden[n] is ns[n]:
            continue
        out.append(n)
    return out


def _is_stateful(value) -> bool:
    import torch
    if isinstance(value, (type, types.ModuleType, torch.nn.Module, torch.optim.Optimizer, torch.Tensor)):
        return False
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _backend_flags() -> dict:
    import torch
    flags = {"float32_matmul_precision": torch.get_float32_matmul_precision()}
    try:
        flags["cudnn_benchmark"] = torch.backends.cudnn.benchmark
        flags["cudnn_deterministic"] = torch.backends.cudnn.deterministic
        flags["cudnn_allow_tf32"] = torch.backends.cudnn.allow_tf32
        flags["matmul_allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
    except Exception:
        pass
    return flags


def _placement_for_cpu(tree, namespace):
    """On CPU ranks, a cell written for ``.cuda()`` runs on the CPU (the %%ondevice rewrite)."""
    try:
        from ..cell.placement import HELPER, rewrite_placement
    except ImportError:
        return tree, None
    tree, rewriter = rewrite_placement(copy.deepcopy(tree), namespace)
    return tree, (HELPER if rewriter.rewrites else None)


def run_cell(shell, cell: str, plan: Plan, header: str = "%%dataparallel") -> CellResult:
    """Run ``cell`` on the pool described by ``plan``; returns a :class:`CellResult`.

    Raises ``UsageError`` before anything runs when the cell trains no
    module, ``WorkerError`` when a rank fails (the notebook unchanged), and
    re-raises ``KeyboardInterrupt`` after killing the ranks.
    """
    global _last
    import torch

    from . import ship
    from .progress import Progress

    t_begin = time.monotonic()
    ns = shell.user_ns
    compiled = cells.compile_cell(shell, cell, header=header)
    tree = compiled.tree
    used = _shippable_names(used_names(tree, ns), shell)
    probe = _names_tree(used)
    modules = find_modules(probe if not plan.models else tree, ns, plan.models)
    optimizers = find_optimizers(probe, ns, modules)
    loaders = find_loaders(probe, ns)
    for name, loader in loaders.items():
        if loader.batch_sampler is None:
            raise usage_error(f"DataLoader {name!r} has batch_size=None: it cannot be split into per-rank "
                              "batches; give it a batch_size")
    stateful = [n for n in used if n not in modules and _is_stateful(ns[n])]
    skip_loader_split = [n for n, l in loaders.items()
                         if isinstance(l.dataset, torch.utils.data.IterableDataset)]
    if not loaders:
        warnings.warn("the cell reads no DataLoader: every rank sees the same data, so the ranks repeat each "
                      "other's work (same result, no speed-up). Iterate a torch.utils.data.DataLoader to "
                      "split each batch across the ranks.", stacklevel=2)
    for n in skip_loader_split:
        warnings.warn(f"DataLoader {n!r} reads an IterableDataset: every rank reads all of it; shard it "
                      "inside the dataset with torch.distributed.get_rank()", stacklevel=2)

    on_cpu = plan.devices[0] == "cpu"
    ship_tree, helper = _placement_for_cpu(tree, ns) if on_cpu else (tree, None)

    assigned = names_assigned(tree)
    names = list(dict.fromkeys(list(modules) + used))
    values = {n: ns[n] for n in names}
    plain_read = [n for n in names if n not in modules and is_plain_value(ns[n])]
    device_strings = [n for n in names if isinstance(ns[n], str) and _CUDA_STRING.match(ns[n])]
    trained = set(modules) | set(optimizers) | set(loaders)
    return_names = [n for n in dict.fromkeys(assigned + plain_read) if n not in trained and n not in stateful]

    # Tensors of the trained modules go to the rank's device; optimizer state stays put
    # until the optimizer's own load_state_dict places it beside its parameter.
    targets = {}
    for m in modules.values():
        for t in m.state_dict(keep_vars=True).values():
            targets[id(t)] = "rank"
    for opt in optimizers.values():
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    targets[id(v)] = "keep"

    t_before_pool = time.monotonic()
    pool, started = _pool(plan)
    t_pool = time.monotonic()
    pool_start = (t_pool - t_before_pool) if started else 0.0
    if started:
        # A fresh pool holds nothing from the notebook.
        pool.held = set()
    scratch = pool.outgoing       # shared memory the local ranks map: written once for all of them
    dummy = types.FunctionType(compile("None", "<gpumagic>", "eval"), ns)
    try:
        packed = ship.pack({_GLOBALS_KEY: dummy, "values": values}, targets=targets, held=pool.held,
                           scratch=scratch)
    except Exception as exc:
        raise _unshippable(values, exc) from None
    t_packed = time.monotonic()

    seed = plan.seed if plan.seed is not None else int(torch.empty((), dtype=torch.int64).random_(0, 2**31 - 1))
    meta = {
        "header": packed.header,
        "tree": ship_tree,
        "filename": compiled.filename,
        "source": (header.rstrip("\n") + "\n" + cell),
        "modules": list(modules),
        "optimizers": list(optimizers),
        "loaders": [n for n in loaders if n not in skip_loader_split],
        "stateful": stateful,
        "device_strings": device_strings,
        "return_names": return_names,
        "assigned": assigned,
        "loop_targets": _loop_targets(tree),
        "seed": seed,
        "flags": _backend_flags(),
        "all_output": plan.all_output,
        "placement": helper,
        "ddp": {"static_graph": plan.static_graph, "find_unused": plan.find_unused,
                "bucket_mb": plan.bucket_mb},
    }
    progress = Progress(pool.devices, shell)
    output = _Output(plan.all_output)
    started_at: dict[int, float] = {}

    def on_message(rank, msg):
        if msg.get("kind") == "started":
            started_at[rank] = msg["t"]
        elif msg.get("kind") == "progress":
            progress.update(rank, msg["stats"])

    try:
        results = pool.run(TASK, meta, packed.data(),
                           on_output=output.write, on_message=on_message, on_tick=progress.tick)
    except BaseException:
        pool.held = set()
        output.flush()
        raise
    output.flush()
    t_ranks_done = time.monotonic()
    for rank, (payload, _) in enumerate(results):
        progress.update(rank, payload["stats"])
    progress.tick(final=True)

    payload, buffer = results[0]
    try:
        state, _ = ship.unpack(payload["state"], buffer, device="cpu", copy=False)
        # Weights are copied into the notebook's tensors; values are kept: they must not be
        # views of the receive buffer that the next cell reuses.
        state["values"], state["value"] = _cloned(state["values"]), _cloned(state.get("value"))
        loaded = _load_into_notebook(ns, state, modules, optimizers, stateful)
    except BaseException:
        pool.held = set()
        raise
    # Every rank holds these tensors now; the notebook holds the same bytes (rank 0's).
    held = None
    for p, _ in results:
        held = set(p["keys"]) if held is None else held & set(p["keys"])
    pool.held = held or set()
    t_end = time.monotonic()

    user_ends = [p["t_user"][1] for p, _ in results]
    result = CellResult(
        devices=list(pool.devices), backend=plan.backend, modules=list(modules),
        optimizers=list(optimizers), loaders=list(loaders), stateful=stateful,
        values=loaded["values"], not_returned=state.get("not_returned", []),
        value=state.get("value"), per_rank={r: p["stats"] for r, (p, _) in enumerate(results)},
        pids=list(pool.pids), pool_started=started,
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
    _last = result
    return result


def _pool(plan: Plan):
    from .. import pool as poolmod
    if plan.remote:
        return poolmod.get_pool(POOL_NAME, plan.devices, plan.backend, timeout=plan.timeout,
                                remote=plan.remote, master_addr=plan.listen)
    return poolmod.get_pool(POOL_NAME, plan.devices, plan.backend, timeout=plan.timeout)


def _unshippable(values: dict, exc: Exception):
    from . import ship
    bad = []
    for name, value in values.items():
        try:
            ship.pack(value, fingerprint=False)
        except Exception as inner:  # noqa: BLE001
            bad.append(f"{name} ({type(value).__name__}: {inner})")
    what = "; ".join(bad) if bad else f"{type(exc).__name__}: {exc}"
    return usage_error(f"cannot send to the worker processes: {what}. Create such objects inside the cell, "
                       "or run the cell with --strategy dp (in the kernel)")


class _Output:
    """Rank output into the cell: rank 0's as is, or every rank's prefixed ``[rank N]``."""

    def __init__(self, all_output: bool):
        self.all_output = all_output
        self._partial: dict = {}

    def write(self, rank: int, stream: str, text: str) -> None:
        target = sys.stdout if stream == "stdout" else sys.stderr
        if not self.all_output:
            target.write(text)
            return
        key = (rank, stream)
        buf = self._partial.get(key, "") + text
        lines = buf.split("\n")
        self._partial[key] = lines.pop()
        for line in lines:
            target.write(f"[rank {rank}] {line}\n")

    def flush(self) -> None:
        for (rank, stream), rest in self._partial.items():
            if rest:
                (sys.stdout if stream == "stdout" else sys.stderr).write(f"[rank {rank}] {rest}\n")
        self._partial = {}
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except Exception:
                pass


def _load_into_notebook(ns: dict, state: dict, modules: dict, optimizers: dict, stateful: list) -> dict:
    """Check everything first, then copy rank 0's state into the notebook's objects in place."""
    import torch
    problems = []
    for name, module in modules.items():
        got = state["modules"][name]
        have = module.state_dict()
        missing = sorted(set(have) - set(got))
        extra = sorted(set(got) - set(have))
        if missing or extra:
            problems.append(f"{name}: the cell changed its structure (missing {missing[:3]}, new {extra[:3]})")
            continue
        for k, v in have.items():
            if tuple(v.shape) != tuple(got[k].shape):
                problems.append(f"{name}.{k}: shape {tuple(v.shape)} became {tuple(got[k].shape)} in the cell")
    for name, opt in optimizers.items():
        got = state["optimizers"][name]
        if len(got["param_groups"]) != len(opt.param_groups) or any(
                len(g["params"]) != len(h["params"]) for g, h in zip(got["param_groups"], opt.param_groups)):
            problems.append(f"{name}: the cell changed the optimizer's parameter groups")
    if problems:
        raise RuntimeError("the ranks finished, but their state does not fit the notebook's objects, which are "
                           "left as they were: " + "; ".join(problems))
    with torch.no_grad():
        for name, module in modules.items():
            module.load_state_dict(state["modules"][name])
    for name, opt in optimizers.items():
        opt.load_state_dict(_optimizer_state_to_keep(opt, state["optimizers"][name]))
    for name in stateful:
        if name in state["stateful"]:
            ns[name].load_state_dict(_cloned(state["stateful"][name]))
    bound = []
    for name, value in state["values"].items():
        old = ns.get(name, _MISSING)
        if isinstance(old, list) and isinstance(value, list) and name not in state.get("assigned", ()):
            if old != value:
                old[:] = value        # a list the cell appended to: same object, new contents
                bound.append(name)
        elif isinstance(old, dict) and isinstance(value, dict) and name not in state.get("assigned", ()):
            if old != value:
                old.clear()
                old.update(value)
                bound.append(name)
        elif name in state.get("assigned", ()) or not _equal(old, value):
            ns[name] = value
            bound.append(name)
    return {"values": bound}


_MISSING = object()


def _optimizer_state_to_keep(opt, sd: dict) -> dict:
    """``sd`` whose tensors the optimizer may keep: the received ones are views of a reused buffer.

    ``load_state_dict`` copies a state tensor to its parameter's GPU anyway; it keeps CPU ones
    (and ``step``) as they are, so those are cloned here.
    """
    import torch
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {}
    for idx, st in sd["state"].items():
        on_gpu = isinstance(idx, int) and idx < len(params) and params[idx].device.type != "cpu"
        state[idx] = {k: (v.clone() if isinstance(v, torch.Tensor) and (not on_gpu or k == "step" or v.dim() == 0)
                          else _cloned(v) if not isinstance(v, torch.Tensor) else v)
                      for k, v in st.items()}
    return {**sd, "state": state}


def _equal(a, b) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:
        return False


def _cloned(obj):
    import torch
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _cloned(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cloned(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_cloned(v) for v in obj)
    return obj


# ====================================================================== worker side

def _make_cell_ddp():
    from torch.nn.parallel import DistributedDataParallel

    class CellDDP(DistributedDataParallel):
        """DDP that answers like the module it wraps.

        The cell's ``model`` is this wrapper, so ``model(x)`` synchronises
        gradients; ``model.fc``, ``model.state_dict()`` and
        ``model.named_parameters()`` look as they do in the notebook (no
        ``module.`` prefix), so checkpoints saved in the cell load anywhere.
        """

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                # Only once the wrapped module is in place (DDP's own __init__ probes attributes),
                # and never for dunders (copy, pickle and friends ask for those).
                modules = self.__dict__.get("_modules")
                if name.startswith("__") or not modules or "module" not in modules:
                    raise
                return getattr(modules["module"], name)

        def state_dict(self, *args, **kwargs):
            return self.module.state_dict(*args, **kwargs)

        def load_state_dict(self, *args, **kwargs):
            return self.module.load_state_dict(*args, **kwargs)

        def named_parameters(self, *args, **kwargs):
            return self.module.named_parameters(*args, **kwargs)

        def named_buffers(self, *args, **kwargs):
            return self.module.named_buffers(*args, **kwargs)

    return CellDDP


CellDDP = None  # built on first use: importing torch.distributed stays out of the kernel's import path


def _cell_ddp_class():
    global CellDDP
    if CellDDP is None:
        CellDDP = _make_cell_ddp()
    return CellDDP


class _RankDevice(ast.NodeTransformer):
    """On GPU ranks: ``'cuda:0'``, ``.cuda(0)``, ``device=0`` in the cell mean this rank's GPU."""

    def __init__(self, index: int):
        self.index = index

    def visit_Constant(self, node):
        if isinstance(node.value, str) and _CUDA_STRING.match(node.value) and ":" in node.value:
            return ast.copy_location(ast.Constant(f"cuda:{self.index}"), node)
        return node

    def visit_JoinedStr(self, node):
        return node  # f-strings are text, not devices

    def visit_Call(self, node):
        self.generic_visit(node)
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in ("cuda", "set_device") and node.args:
            node.args = [self._index(a) for a in node.args[:1]] + node.args[1:]
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name == "device" and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) \
                and node.args[0].value == "cuda":
            node.args[1] = self._index(node.args[1])      # torch.device("cuda", 0)
        for kw in node.keywords:
            if kw.arg == "device":
                kw.value = self._index(kw.value)
        return node

    def _index(self, arg):
        if isinstance(arg, ast.Constant) and isinstance(arg.value, int) and not isinstance(arg.value, bool):
            return ast.copy_location(ast.Constant(self.index), arg)
        return arg


def _no_ipython():
    raise RuntimeError("IPython magics and !commands are not available inside a %%dataparallel cell: "
                       "the cell runs in worker processes without IPython")


def rank_main(ctx, meta: dict, data):
    """Run one cell on this rank (see the module notes); returns (payload, buffer)."""
    from . import ship
    store = ctx.state.setdefault("store", ship.TensorStore())
    try:
        return _rank_main(ctx, meta, data, store)
    except BaseException:
        store.clear()  # tensors handed to the failed cell may be half-updated
        raise


def _rank_main(ctx, meta, data, store):
    import random

    import torch

    from ..loaders import shard_loader
    from . import ship

    device = ctx.torch_device
    rank, world = ctx.rank, ctx.world_size
    _apply_flags(meta["flags"])

    obj, tensors = ship.unpack(meta["header"], data, device=device, store=store)
    ns = obj[_GLOBALS_KEY].__globals__
    ns.update(obj["values"])
    ns["__name__"] = "__main__"
    ns["__builtins__"] = builtins
    ns.setdefault("get_ipython", _no_ipython)
    for name in meta["device_strings"]:
        ns[name] = str(device) if device.type == "cuda" else "cpu"
    if meta.get("placement"):
        from ..cell.placement import Placement, install_passthrough
        install_passthrough()
        ns[meta["placement"]] = Placement(device)

    torch.manual_seed(meta["seed"])
    random.seed(meta["seed"])
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(meta["seed"] % 2**32)

    # Modules: on the rank's device, wrapped in DDP, the cell's name bound to the wrapper.
    inner = {}
    ddp_kwargs = {"gradient_as_bucket_view": True,
                  "static_graph": bool(meta["ddp"]["static_graph"]),
                  "find_unused_parameters": bool(meta["ddp"]["find_unused"])}
    if meta["ddp"]["bucket_mb"]:
        ddp_kwargs["bucket_cap_mb"] = meta["ddp"]["bucket_mb"]
    if device.type == "cuda":
        ddp_kwargs["device_ids"] = [device.index]
    wrapper_cls = _cell_ddp_class()
    for name in meta["modules"]:
        module = ns[name]
        module.to(device)
        inner[name] = module
        if any(p.requires_grad for p in module.parameters()):
            ns[name] = wrapper_cls(module, **ddp_kwargs)
    # Optimizers: their own load_state_dict puts each state tensor beside its parameter.
    opts = {name: ns[name] for name in meta["optimizers"]}
    for opt in opts.values():
        opt.load_state_dict(opt.state_dict())
    stateful = {name: ns[name] for name in meta["stateful"]}

    stats = {"steps": 0, "samples": 0, "seconds": 0.0}
    for name in meta["loaders"]:
        sharded = shard_loader(ns[name], rank, world, split="batch", seed=meta["seed"])
        sharded.batch_sampler.__class__ = _counting_sampler_class(type(sharded.batch_sampler))
        sharded.batch_sampler._gpumagic_stats = stats
        ns[name] = sharded

    tree = meta["tree"]
    if device.type == "cuda":
        tree = ast.fix_missing_locations(_RankDevice(device.index).visit(copy.deepcopy(tree)))
    filename = meta["filename"]
    cells.register_source(filename, meta["source"])
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
        if now - last_sent[0] >= 1.0:
            last_sent[0] = now
            stats["seconds"] = now - t_start
            ctx.send({"kind": "progress", "stats": dict(stats)})

    from torch.optim.optimizer import register_optimizer_step_post_hook
    handle = register_optimizer_step_post_hook(on_step)
    ctx.send({"kind": "started", "t": t_start})
    try:
        exec(body, ns)
        value = eval(last_expr, ns) if last_expr is not None else None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        handle.remove()
    t_end = time.monotonic()
    stats["seconds"] = t_end - t_start

    # Gradients do not go back to the notebook: free them now rather than keep them with the weights.
    for module in inner.values():
        for p in module.parameters():
            p.grad = None
    # Every rank holds what it trained (and the data it read) for the next cell.
    held = list(tensors)
    for module in inner.values():
        held += list(module.state_dict(keep_vars=True).values())
    for opt in opts.values():
        for st in opt.state.values():
            held += [v for v in st.values() if isinstance(v, torch.Tensor)]
    keys = store.rebuild(held)

    payload = {"stats": stats, "t_user": (t_start, t_end), "keys": keys, "state": None}
    buffer = None
    if rank == 0:
        state = {
            "modules": {n: m.state_dict() for n, m in inner.items()},
            "optimizers": {n: o.state_dict() for n, o in opts.items()},
            "stateful": {},
            "values": {},
            "assigned": meta["assigned"],
            "not_returned": [],
            "value": _returnable(value),
        }
        for n, o in stateful.items():
            try:
                state["stateful"][n] = o.state_dict()
            except Exception:
                pass
        trained = set(meta["modules"]) | set(meta["optimizers"]) | set(meta["loaders"])
        for n in meta["return_names"]:
            if n not in ns:
                continue
            v = ns[n]
            if is_plain_value(v):
                state["values"][n] = _detached(v)
            elif n in meta["assigned"] and n not in trained and n not in meta["loop_targets"] \
                    and not isinstance(v, (types.ModuleType, type, types.FunctionType)):
                state["not_returned"].append(n)
        packed = ship.pack(state, targets=_all_cpu(state), fingerprint=False, scratch=ctx.outgoing)
        payload["state"] = packed.header
        payload["returned_bytes"] = packed.nbytes
        buffer = packed.data()
    return payload, buffer


def _all_cpu(state) -> dict:
    import torch
    targets = {}

    def walk(o):
        if isinstance(o, torch.Tensor):
            targets[id(o)] = "cpu"
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
    walk(state)
    return targets


def _detached(value):
    """Plain values without autograd history (``loss`` kept as a tensor is common)."""
    import torch
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, list):
        return [_detached(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def _returnable(value):
    import torch
    if value is None or is_plain_value(value):
        return value
    if isinstance(value, torch.Tensor) and type(value) is torch.Tensor:
        return value.detach()
    try:
        import numpy as np
        if isinstance(value, np.ndarray):
            return value
    except ImportError:
        pass
    return RemoteRepr(repr(value))


def _apply_flags(flags: dict) -> None:
    import torch
    try:
        torch.set_float32_matmul_precision(flags.get("float32_matmul_precision", "highest"))
        torch.backends.cudnn.benchmark = flags.get("cudnn_benchmark", False)
        torch.backends.cudnn.deterministic = flags.get("cudnn_deterministic", False)
        torch.backends.cudnn.allow_tf32 = flags.get("cudnn_allow_tf32", True)
        torch.backends.cuda.matmul.allow_tf32 = flags.get("matmul_allow_tf32", False)
    except Exception:
        pass


_COUNTING: dict = {}


def _counting_sampler_class(base):
    """``base`` with its batches counted into ``_gpumagic_stats['samples']`` (for the progress display)."""
    cls = _COUNTING.get(base)
    if cls is None:
        def __iter__(self):
            stats = self._gpumagic_stats
            for batch in base.__iter__(self):
                stats["samples"] += len(batch)
                yield batch
        cls = type(base.__name__, (base,), {"__iter__": __iter__})
        _COUNTING[base] = cls
    return cls
