"""``%%dataparallel --strategy dp``: split each call of the model over the devices, in the kernel.

Every call ``model(x)`` of a module the cell trains is rewritten to go
through :class:`DataParallelCall`, which does what ``nn.DataParallel`` does
with the ``torch.nn.parallel`` primitives::

    replicas = replicate(model, devices)          # copies of the module, one per device
    inputs, kwargs = scatter_kwargs(args, kwargs, devices)   # split the batch (dim 0)
    outputs = parallel_apply(replicas, inputs, kwargs)       # run them in threads
    result = gather(outputs, devices[0])          # one output on the output device

Nothing runs in another process, so nothing needs shipping and any cell
works; it is also slower than one GPU for most models (the replicas are
rebuilt and the outputs gathered at every call, under one Python thread),
which is why ``ddp`` is the default. Warnings say what this strategy loses:
buffer updates made in forward on devices other than the first (BatchNorm
running statistics), batches too small to split, scalar outputs gathered
into a vector.

On a machine without GPUs, or with one device, each call runs whole on that
device: the cell runs as it is.
"""
from __future__ import annotations

import ast
import warnings
from dataclasses import dataclass, field

from ...cell import compile as cells
from ...cell.rewrite.helper import PlacementRewriter, follow, helper_name, made_for
from ...cell.values import find_modules
from ...display import note
from ...errors import usage_error
from .base import Strategy

__all__ = ["Dp", "DataParallelCall", "ModelCallRewriter", "DPResult", "HELPER"]

HELPER = "__gpumagic_dp__"


class ModelCallRewriter(ast.NodeTransformer):
    """``model(x, y=1)`` -> ``__gpumagic_dp__(model, x, y=1)`` for the names in ``modules``.

    >>> tree = ast.parse("out = model(x)")
    >>> print(ast.unparse(ModelCallRewriter({"model"}).visit(tree)))
    out = __gpumagic_dp__(model, x)
    """

    def __init__(self, modules, helper: str = HELPER):
        self.modules = set(modules)
        self.helper = helper
        self.rewrites = 0

    def visit_Call(self, node):
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id in self.modules:
            self.rewrites += 1
            new = ast.Call(func=ast.Name(id=self.helper, ctx=ast.Load()),
                           args=[ast.Name(id=node.func.id, ctx=ast.Load()), *node.args],
                           keywords=node.keywords)
            return ast.copy_location(new, node)
        return node


@dataclass
class DPResult:
    """What a ``--strategy dp`` cell did."""
    devices: list[str]
    modules: list[str]
    calls: int = 0
    warnings: list[str] = field(default_factory=list)
    value: object = None

    def notes(self) -> list[str]:
        """The cell's note: its warnings were shown as they happened."""
        return []


class DataParallelCall:
    """Calls a module with its batch split over ``devices`` (outputs on ``devices[0]``)."""

    def __init__(self, devices: list[str]):
        import torch
        self.devices = [torch.device(d) for d in devices]
        self.output_device = self.devices[0]
        self.calls = 0
        self.warned: list[str] = []
        self._checked: set = set()

    def _warn(self, kind: str, message: str) -> None:
        if kind in self.warned:
            return
        self.warned.append(kind)
        warnings.warn(message, UserWarning, stacklevel=3)

    def __call__(self, module, *args, **kwargs):
        __tracebackhide__ = True
        self.calls += 1
        if len(self.devices) == 1:
            if self.output_device.type == "cuda":
                from torch.nn.parallel.scatter_gather import scatter_kwargs
                inputs, kw = scatter_kwargs(args, kwargs, [self.output_device.index])
                if inputs:
                    return module(*inputs[0], **kw[0])
            return module(*args, **kwargs)
        return self._split_call(module, args, kwargs)

    def _split_call(self, module, args, kwargs):
        import torch
        from torch.nn.parallel import gather, parallel_apply, replicate
        from torch.nn.parallel.scatter_gather import scatter_kwargs

        if id(module) not in self._checked:
            self._check_module(module)
        indices = [d.index for d in self.devices]
        inputs, kw = scatter_kwargs(args, kwargs, indices, dim=0)
        if not inputs:
            return module(*args, **kwargs)
        if len(inputs) < len(indices):
            size = _batch_size(args, kwargs)
            self._warn("small-batch", f"a batch of {size} is smaller than the {len(indices)} devices: only "
                                      f"{len(inputs)} device(s) work on it")
        used = indices[: len(inputs)]
        buffers = [b for b in module.buffers()]
        versions = [b._version for b in buffers]
        replicas = replicate(module, used, not torch.is_grad_enabled())
        outputs = parallel_apply(replicas, inputs, kw, used)
        if buffers and "buffers" not in self.warned and any(b._version != v for b, v in zip(buffers, versions)):
            names = [n for n, b in module.named_buffers() if any(b is c for c, v in zip(buffers, versions)
                                                                 if c._version != v)]
            self._warn("buffers", f"{type(module).__name__} updates buffers in forward ({', '.join(names[:4])}"
                                  f"{'...' if len(names) > 4 else ''}): only the share of the batch on "
                                  f"{self.output_device} updates them, the other devices' updates are lost")
        if any(isinstance(o, torch.Tensor) and o.dim() == 0 for o in _flat(outputs)):
            self._warn("scalar", "the model returns a scalar: the devices' scalars are gathered into a vector "
                                 f"of {len(outputs)} (one per device), not averaged; reduce it with .mean()")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*all input tensors were scalars.*")
            return gather(outputs, self.output_device, dim=0)

    def _check_module(self, module) -> None:
        import torch

        self._checked.add(id(module))
        wrong = {str(t.device) for t in list(module.parameters()) + list(module.buffers())
                 if t.device != self.output_device}
        if wrong:
            raise usage_error(f"--strategy dp needs {type(module).__name__}'s parameters on {self.output_device} "
                              f"(the first device); some are on {', '.join(sorted(wrong))}: run "
                              f"model.to('{self.output_device}') first, or list that device first in --devices")
        if module.training and any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats
                                   for m in module.modules()):
            self._warn("buffers", f"{type(module).__name__} has BatchNorm layers: each device normalises its own "
                                  f"share of the batch, and only {self.output_device}'s share updates the "
                                  "running statistics (the other devices' updates are lost)")


def _flat(obj):
    if isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _flat(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _flat(o)
    else:
        yield obj


def _batch_size(args, kwargs):
    import torch
    for o in _flat(list(args) + list(kwargs.values())):
        if isinstance(o, torch.Tensor) and o.dim() > 0:
            return o.shape[0]
    return "?"


def _run_in_kernel(notebook, cell: str, plan, header: str) -> DPResult:
    """Run ``cell`` in the kernel with each call of its model split over ``plan.devices``."""
    ns, hidden = notebook.ns, notebook.hidden
    modules = find_modules(notebook.compile(cell, header).tree, ns, plan.models)
    helper = DataParallelCall(plan.devices)
    rewriter = ModelCallRewriter(modules)
    transformers: list = [rewriter]
    placement = None
    if plan.devices[0] == "cpu":
        # No GPU: code written for .cuda() runs on the CPU, as under %%ondevice cpu.
        placement = PlacementRewriter(ns, helper_name("cpu"))
        transformers.append(placement)
    compiled = notebook.compile(cell, header, transformers)
    if not rewriter.rewrites:
        note(f"--strategy dp: the cell never calls {', '.join(modules)} directly (as name(...)), so nothing is split")
    _install_passthrough()
    if placement is not None and placement.rewrites:
        ns[helper_name("cpu")] = hidden[helper_name("cpu")] = made_for("cpu")
    had = ns.get(HELPER, _MISSING)
    ns[HELPER] = hidden[HELPER] = helper
    try:
        # Functions made under %%ondevice place their tensors where the model's first device is.
        with follow(plan.devices[0]):
            value = cells.run_compiled(compiled, ns)
    finally:
        if had is _MISSING:
            ns.pop(HELPER, None)
        else:
            ns[HELPER] = had
        hidden.pop(HELPER, None)
    return DPResult(list(plan.devices), list(modules), helper.calls, list(helper.warned), value)


@dataclass
class Dp(Strategy):
    """``--strategy dp``: in the kernel, each call of the model split over the devices; no options of its own."""

    name = "dp"
    OPTIONS = ()
    processes = False

    @classmethod
    def from_options(cls) -> Dp:
        return cls()

    @classmethod
    def refuse(cls, flags: list[str]) -> None:
        raise usage_error(f"{', '.join(flags)} appl{'ies' if len(flags) == 1 else 'y'} to worker processes "
                          "(--strategy ddp or fsdp); --strategy dp runs the cell in the kernel",
                          ["--strategy ddp " + " ".join(flags), "--strategy dp"])

    def for_launch(self, why: str, devices=(), on_cluster: bool = False):
        raise usage_error("--launch runs the cell in worker processes, as torchrun would; --strategy dp runs it in "
                          "the kernel", ["--strategy ddp --launch", "--strategy dp"])

    def on_cluster(self) -> None:
        raise usage_error("--cluster: the engines run --strategy ddp (and launch mode); --strategy dp runs on this "
                          "machine", ["--cluster with --strategy ddp", "--strategy dp without --cluster"])

    def place(self, devices: list[str], backend: str | None, notes: list[str]) -> None:
        if backend is not None:
            raise usage_error("--backend applies to --strategy ddp (worker processes); dp runs in the kernel",
                              ["--strategy ddp --backend " + backend])
        if devices[0] == "cpu":
            if len(devices) > 1:
                notes.append("--strategy dp on the CPU runs on one device: the cell runs as is, without splitting")
            notes.append("--strategy dp on cpu: one device, so each call of the model runs whole (no parallelism)")
        elif len(devices) == 1:
            notes.append(f"--strategy dp with one device ({devices[0]}): each call runs whole on it")
        return None

    def devices_for(self, placed: list[str]) -> list[str]:
        return ["cpu"] if placed[0] == "cpu" else placed

    def run(self, notebook, cell: str, plan, header: str, on_ranks) -> DPResult:
        """In the kernel: no ranks."""
        return _run_in_kernel(notebook, cell, plan, header)


_MISSING = object()


def _passthrough(module, *args, **kwargs):
    return module(*args, **kwargs)


def _install_passthrough() -> None:
    """Functions defined in a dp cell call the helper later too: outside the cell it calls the model as is."""
    import builtins
    if getattr(builtins, HELPER, None) is not _passthrough:
        setattr(builtins, HELPER, _passthrough)
