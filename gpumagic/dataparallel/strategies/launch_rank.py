"""Launch mode on a rank: the process looks as if ``torchrun`` had started it; the cell's code distributes.

While a launch-mode cell runs, :func:`launched` sets the environment torch's
elastic agent sets (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, ...). The rank's GPU is already its
current device, so ``"cuda"`` means it, and the pool's process group is
formed: a framework that checks ``is_initialized()`` uses it, one that calls
``init_process_group`` gets its own through ``MASTER_ADDR:MASTER_PORT``
(:mod:`gpumagic.procs.process_group`). Nothing is wrapped or split: the
framework does that.

Lightning's notebook and spawn strategies (``"ddp_notebook"``,
``"ddp_spawn"``) start their own processes; under ``torchrun`` people choose
``"ddp"`` instead. Here the processes exist already, so those strategies run
their function in place, as ``"ddp"`` does under ``torchrun``
(:func:`run_lightning_launchers_in_place`).

A rank is no notebook, so the Hugging Face Trainer would draw text bars; in a
notebook kernel's cell rank 0 uses transformers' notebook progress table instead,
relayed to the cell as a plain cell shows it (:func:`notebook_progress`); tqdm's bars (accelerate
loops, Lightning's) show as notebook bars through :mod:`gpumagic.procs.tqdm_relay`, as in any task.

Runs in the workers: no IPython.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ...procs.import_patches import patch_module
from ..protocol import CellWarning
from ..rank.cell import RankCell
from .base import RankStrategy
from .collect import collect, keep, name_trained, plain_grads, reload_optimizers, remember_shapes

logger = logging.getLogger(__name__)

__all__ = ["LaunchRank", "launched", "torchrun_environment", "run_lightning_launchers_in_place",
           "forget_kernel_process", "forget_accelerate_state", "DistributionWatch", "notebook_progress"]

LOOPBACK = "127.0.0.1"


def torchrun_environment(rank: int, world_size: int, master_port: int, run_id: str,
                         master_addr: str = LOOPBACK, on_cpu: bool = False, node: dict | None = None) -> dict[str, str]:
    """What ``torchrun --nproc-per-node=world_size`` sets in rank ``rank``'s environment (one machine;
    ``node``: ``local_rank``, ``local_world_size``, ``node_rank``, ``nodes`` where ranks span machines).

    ``on_cpu``: also ``ACCELERATE_USE_CPU``, as ``accelerate launch --cpu`` sets; without it accelerate
    (and the Hugging Face Trainer) treat CPU processes as one process each.
    """
    node = {"local_rank": rank, "local_world_size": world_size, "node_rank": 0, "nodes": 1, **(node or {})}
    values = {
        "RANK": rank, "LOCAL_RANK": node["local_rank"], "GROUP_RANK": node["node_rank"], "ROLE_RANK": rank,
        "ROLE_NAME": "default", "WORLD_SIZE": world_size, "LOCAL_WORLD_SIZE": node["local_world_size"],
        "ROLE_WORLD_SIZE": world_size, "GROUP_WORLD_SIZE": node["nodes"], "MASTER_ADDR": master_addr,
        "MASTER_PORT": master_port,
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": 0, "TORCHELASTIC_MAX_RESTARTS": 0,
        # The store behind MASTER_PORT is rank 0's (as with torchrun --standalone), not an agent's.
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    if on_cpu:
        values["ACCELERATE_USE_CPU"] = "true"
    return {k: str(v) for k, v in values.items()}


@contextmanager
def launched(rank: int, world_size: int, master_port: int, run_id: str, on_cpu: bool,
             master_addr: str = LOOPBACK, node: dict | None = None, notebook: bool = False) -> Iterator[None]:
    """The environment of a ``torchrun`` process while the block runs; the worker's own after it.

    ``notebook``: the kernel is a notebook's (not terminal IPython): rank 0 shows the Hugging Face
    Trainer's notebook progress table (:func:`notebook_progress`)."""
    import torch
    env = torchrun_environment(rank, world_size, master_port, run_id, master_addr, on_cpu=on_cpu, node=node)
    # torchrun sets OMP_NUM_THREADS, and accelerate cuts torch to one thread where it is unset: give
    # the share of cores the worker already runs with.
    env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS") or str(torch.get_num_threads()))
    # All of it comes back after the cell, as the next torchrun process would start without what this
    # one set: a framework's own settings (accelerate's ACCELERATE_USE_FSDP from an FSDP plugin) would
    # otherwise reach the next cell's framework, which never asked for them.
    saved = dict(os.environ)
    os.environ.update(env)
    forget_accelerate_state()
    run_lightning_launchers_in_place()
    _cell_namespaces.clear()
    _unmark_returning()
    try:
        notebook_progress(notebook and rank == 0)
        yield
    finally:
        notebook_progress(False)
        for ns in _cell_namespaces:
            _mark_returning(ns)
        _cell_namespaces.clear()
        for k in [k for k in os.environ if k not in saved]:
            os.environ.pop(k, None)
        for k, v in saved.items():
            if os.environ.get(k) != v:
                os.environ[k] = v


def forget_accelerate_state() -> None:
    """Clear accelerate's process-wide singletons, as a fresh ``torchrun`` process starts without them.

    accelerate keeps what it found about the processes in class attributes
    (``PartialState``, ``AcceleratorState``, ``GradientState``) for the life of
    the process. A rank lives across cells, so an ``Accelerator`` made in an
    earlier cell outside launch mode (one process, no ``WORLD_SIZE``) would make
    every later one think it runs alone.
    """
    state = sys.modules.get("accelerate.state")
    if state is None:
        return
    for name in ("AcceleratorState", "PartialState", "GradientState"):
        cls = getattr(state, name, None)
        shared = getattr(cls, "_shared_state", None)
        if isinstance(shared, dict):
            shared.clear()


_notebook_progress = False            # while a launch cell runs on rank 0 of a notebook kernel
_own_progress: dict[str, type] = {}   # transformers.trainer's own choice of progress callback


def notebook_progress(on: bool) -> None:
    """The Hugging Face Trainer's progress: transformers' notebook table (``on``) or its own choice again.

    transformers picks its progress callback as ``transformers.trainer`` is imported, from
    ``is_in_notebook()``, which asks IPython: false in a rank. Set now if imported (a rank that ran an
    earlier cell), else as it is imported (the cell's first ``import transformers``); the table's
    display and its updates reach the cell through :mod:`gpumagic.procs.display_relay`.
    """
    global _notebook_progress
    _notebook_progress = on
    patch_module("transformers.trainer", _choose_progress)


def _choose_progress(module) -> None:
    if not hasattr(module, "DEFAULT_PROGRESS_CALLBACK"):
        logger.debug("transformers.trainer without DEFAULT_PROGRESS_CALLBACK: its progress is left as it is")
        return
    own = _own_progress.setdefault(module.__name__, module.DEFAULT_PROGRESS_CALLBACK)
    chosen = own
    if _notebook_progress:
        try:
            from transformers.utils.notebook import NotebookProgressCallback
            chosen = NotebookProgressCallback
        except ImportError:   # (it needs IPython): the text bars stay
            logger.warning("transformers' notebook progress does not import; text progress bars instead",
                           exc_info=True)
    module.DEFAULT_PROGRESS_CALLBACK = chosen


# The cell's namespaces seen by forget_kernel_process while launched() runs, marked as it ends.
_cell_namespaces: list[dict] = []
_marked: list[weakref.ref] = []   # values whose pickling _mark_returning changed, until the next cell


def forget_kernel_process(ns: dict) -> list[str]:
    """Values made in the kernel that cached which process they were in, made to look again here.

    A Hugging Face ``TrainingArguments`` made in an earlier cell has worked out
    its device and accelerate's state there (one process, ``cuda:0``); in the
    rank it must be this rank's, as if it had been made here; a model, optimizer
    or loader accelerate prepared there is unprepared again. Call inside
    :func:`launched`; returns the names of the arguments refreshed. As :func:`launched` ends, the
    other way round: those in ``ns`` go back to the kernel to be worked out there.
    """
    _cell_namespaces.append(ns)
    refreshed = []
    for name, value in ns.items():
        _forget_accelerate_prepared(value)
        if _is_training_arguments(value) and "_setup_devices" in vars(value):
            del value.__dict__["_setup_devices"]
            value.distributed_state = None
            value._setup_devices   # noqa: B018 - worked out again now, under this rank's environment
            refreshed.append(name)
    return refreshed


def _forget_accelerate_prepared(value) -> None:
    """accelerate marks what it prepared (``_is_accelerate_prepared``) and leaves it as it is when asked
    again: a model a plain cell's ``Trainer`` or ``Accelerator`` prepared in the kernel (one process: not
    wrapped) would train unwrapped here, each rank on its own share of the data, nothing averaged."""
    import torch
    objects = value.modules() if isinstance(value, torch.nn.Module) else (value,)
    for obj in objects:
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict) and attrs.get("_is_accelerate_prepared") is True:
            del attrs["_is_accelerate_prepared"]


def _mark_returning(ns: dict) -> None:
    """``TrainingArguments`` in ``ns`` pickle without what they worked out in this rank (two processes,
    this rank's device), and work it out again as they arrive, as if made in the kernel: else a plain
    cell's ``Trainer`` using one made in a launch cell waits for a process group the kernel has not.
    (Worked out at once, as ``TrainingArguments()`` does: later, it would reset the state of an
    ``Accelerator`` made already.) Set on the object, not its class, so the cell's own saves
    (``training_args.bin``) pickle as under torchrun."""
    for value in ns.values():
        if _is_training_arguments(value) and "__reduce_ex__" not in vars(value):
            value.__reduce_ex__ = functools.partial(_reduced_for_kernel, value)
            _marked.append(weakref.ref(value))


def _unmark_returning() -> None:
    for ref in _marked:
        value = ref()
        if value is not None:
            vars(value).pop("__reduce_ex__", None)
    _marked.clear()


def _reduced_for_kernel(value, protocol: int) -> tuple:
    state = {k: v for k, v in vars(value).items() if k not in ("_setup_devices", "distributed_state", "__reduce_ex__")}
    return _training_arguments_here, (type(value), state)


def _training_arguments_here(cls, state: dict):
    """A ``TrainingArguments`` as if made in this process: its device and processes worked out here."""
    value = cls.__new__(cls)
    value.__dict__.update(state)
    value.distributed_state = None
    value._setup_devices   # noqa: B018 - as TrainingArguments.__post_init__ does
    return value


def _is_training_arguments(value) -> bool:
    return any(c.__name__ == "TrainingArguments" and c.__module__.startswith("transformers.")
               for c in type(value).__mro__)


class DistributionWatch:
    """Whether anything in a launch-mode cell distributed the training: a model wrapped in DDP or
    FSDP (the frameworks all use torch's), or parameters sharded as DTensors (FSDP2).

    A cell that took optimizer steps without either ran the whole training on every rank: the
    same result as one process, N times over. ``with watch: ...`` then ``watch.distributed(modules)``.
    """

    def __init__(self) -> None:
        self.wrapped = 0
        self.fsdp_wrappers: list = []    # weak references to the FullyShardedDataParallel wrappers made

    def __enter__(self):
        from torch.nn.parallel import DistributedDataParallel
        self._patched = [(DistributedDataParallel, DistributedDataParallel.__init__)]
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel
            self._patched.append((FullyShardedDataParallel, FullyShardedDataParallel.__init__))
        except ImportError:   # a torch without FSDP
            pass
        for cls, init in self._patched:
            cls.__init__ = self._counting(init)
        return self

    def _counting(self, init):
        def counted(wrapper, /, *args, **kwargs):
            self.wrapped += 1
            if type(wrapper).__name__ == "FullyShardedDataParallel" or hasattr(wrapper, "_fsdp_wrapped_module"):
                self.fsdp_wrappers.append(weakref.ref(wrapper))
            return init(wrapper, *args, **kwargs)
        return counted

    def __exit__(self, *exc) -> None:
        for cls, init in self._patched:
            cls.__init__ = init

    def sharded_state(self, modules: dict) -> dict:
        """Every rank, after the cell: the whole trained state of each module the cell's framework
        sharded (FSDP2's DTensors, or inside an FSDP wrapper), gathered to the CPU on rank 0 (other
        ranks get empty dicts): ``{name: state_dict}``. A collective: every rank must call it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.tensor import DTensor
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        gathered = {}
        for name, module in modules.items():
            root, prefix = self._fsdp_root(module)
            if root is not None:
                whole = get_model_state_dict(root, options=options)
                gathered[name] = {k[len(prefix):]: v for k, v in whole.items() if k.startswith(prefix)}
            elif any(isinstance(t, DTensor) for t in module.state_dict().values()):
                gathered[name] = get_model_state_dict(module, options=options)
        return gathered

    def _fsdp_root(self, module) -> tuple:
        """The outermost FSDP wrapper holding ``module``, and ``module``'s name in it plus a dot."""
        wrappers = [w for w in (ref() for ref in self.fsdp_wrappers) if w is not None]
        for wrapper in wrappers:
            if any(wrapper is not other and any(wrapper is m for m in other.modules()) for other in wrappers):
                continue   # a unit inside another wrapper
            inner = wrapper.module
            if inner is module:
                return wrapper, ""
            for name, sub in inner.named_modules():
                if sub is module:
                    return wrapper, name.replace("_fsdp_wrapped_module.", "") + "."
        return None, ""

    def distributed(self, modules) -> bool:
        if self.wrapped:
            return True
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:
            return False
        return any(isinstance(p, DTensor) for m in modules for p in m.parameters())


# Lightning's launchers that start processes, under both of its package names.
_LAUNCHER_MODULES = (
    "lightning.pytorch.strategies.launchers.multiprocessing",
    "lightning.fabric.strategies.launchers.multiprocessing",
    "pytorch_lightning.strategies.launchers.multiprocessing",
    "lightning_fabric.strategies.launchers.multiprocessing",
)


def run_lightning_launchers_in_place() -> None:
    """Lightning's process-starting launchers run their function in this process when the processes
    were started outside (``cluster_environment.creates_processes_externally``), now or once imported."""
    for name in _LAUNCHER_MODULES:
        patch_module(name, _patch_launcher)


def _patch_launcher(module) -> None:
    cls = getattr(module, "_MultiProcessingLauncher", None)
    if cls is None or getattr(cls.launch, "_gpumagic_in_place", False):
        return
    original = cls.launch

    def launch(self, function, *args, **kwargs):
        environment = getattr(self._strategy, "cluster_environment", None)
        if environment is not None and environment.creates_processes_externally:
            kwargs.pop("trainer", None)   # what _SubprocessScriptLauncher.launch does under torchrun
            return function(*args, **kwargs)
        return original(self, function, *args, **kwargs)

    launch._gpumagic_in_place = True  # type: ignore[attr-defined]
    cls.launch = launch


@dataclass(frozen=True)
class LaunchRank(RankStrategy):
    """Launch mode on a rank: where rank 0 listens (``MASTER_ADDR:MASTER_PORT``), the run's id, and whether the
    kernel is a notebook's (rank 0 shows the Hugging Face Trainer's notebook progress)."""
    master_addr: str
    master_port: int
    run_id: str
    notebook: bool = False

    def start(self, cell: RankCell) -> None:
        # the cell's framework wraps and moves the modules, and reads the data: its samples are not counted
        cell.inner = {name: cell.ns[name] for name in cell.order.roles.modules}
        cell.stats.samples = None
        reload_optimizers(cell)
        remember_shapes(cell)
        name_trained(cell)

    def running(self, cell: RankCell) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        stack.enter_context(launched(cell.rank, cell.world_size, self.master_port, self.run_id,
                                     on_cpu=cell.device.type == "cpu", master_addr=self.master_addr,
                                     node=cell.ctx.node, notebook=self.notebook))
        cell.scratch["watch"] = stack.enter_context(DistributionWatch())
        forget_kernel_process(cell.ns)
        return stack

    def finish(self, cell: RankCell) -> None:
        watch = cell.scratch["watch"]
        gathered = watch.sharded_state(cell.inner)   # (a collective: every rank)
        if cell.stats.steps and cell.world_size > 1 and cell.rank0 and not watch.distributed(cell.inner.values()):
            cell.send(CellWarning(
                f"launch mode: the cell took {cell.stats.steps} optimizer steps on each rank, but nothing wrapped a "
                "model in DistributedDataParallel or FSDP: unless the cell averages gradients itself, every "
                f"rank did the whole training ({cell.world_size} times the work of one process for the same "
                "result). Let the framework see the ranks (a Lightning Trainer with devices=N, an Accelerator "
                "made in the cell), or run a hand-written loop without --launch"))
        grads = plain_grads(cell.inner)
        if cell.rank0:
            collect(cell, grads, gathered)
            if gathered:
                _drop_sharded_optimizers(cell)
        # (a framework's gradients are its own: not kept)
        keep(cell, grads, kept_grads=False, gathered=gathered)


def _drop_sharded_optimizers(cell: RankCell) -> None:
    """Notebook optimizers whose state the cell's FSDP sharded stay as they were in the notebook (named among
    what was not returned): their moments are per-rank shards of the framework's parameters, which the
    notebook's optimizer cannot take."""
    from torch.distributed.tensor import DTensor
    for name, opt in cell.opts.items():
        tensors = [p for g in opt.param_groups for p in g["params"]] + [
            v for st in opt.state.values() for v in st.values()]
        if any(isinstance(t, DTensor) for t in tensors):
            cell.trained.optimizers.pop(name, None)
            cell.not_returned.append(f"{name} (its state is sharded by the cell's FSDP; the notebook's optimizer "
                                     "is left as it was)")
