"""``torch.nn.parallel``'s data-parallel calls in a cell that runs on a device that is not a GPU.

The seed article shows what ``nn.DataParallel`` does inside::

    replicas = nn.parallel.replicate(module, device_ids)
    inputs = nn.parallel.scatter(input, device_ids)
    outputs = nn.parallel.parallel_apply(replicas, inputs)
    result = nn.parallel.gather(outputs, output_device)

torch builds these on CUDA's broadcast, scatter and gather, which refuse other
devices (``AssertionError: Broadcast function not implemented for CPU
tensors``). The rewrite (:mod:`.transform`) turns each call into
``H.dp_replicate(nn.parallel.replicate, module, device_ids)`` and so on
(:data:`PARALLEL_CALLS`); on a CUDA target, or with no target, the original
function runs unchanged. On cpu, meta or mps, :class:`ParallelCalls` does the
same work on the one device, with the numbers a GPU per device id would give:

==============================  ==============================================================
call                            on cpu / meta / mps
==============================  ==============================================================
``replicate(m, ids)``           ``len(ids)`` replicas, made as torch makes them: their
                                parameters are views of ``m``'s, so backward through them sums
                                each replica's gradient into ``m``'s ``.grad`` (as
                                ``Broadcast``'s backward does); the first replica shares ``m``'s
                                buffers (BatchNorm's running statistics), the others get copies
                                (whose updates, as on the other GPUs, are dropped)
``scatter(x, ids, dim=0)``      ``x.chunk(len(ids), dim)`` on DEVICE, through tuples, lists,
                                dicts and namedtuples as torch's scatter goes (a batch too small
                                gives fewer chunks, as torch's does); other objects repeated
``scatter_kwargs(...)``         torch's, on the chunks above
``parallel_apply(ms, xs, kw)``  each replica on its input and keyword arguments, one after the
                                other (one device runs in program order); the replica's own
                                exception propagates unchanged
``gather(outs, dev, dim=0)``    ``torch.cat`` along ``dim`` on DEVICE (``'cpu'`` or ``-1``:
                                the CPU), through the same containers as torch's gather
``data_parallel(m, x, ids)``    the four above, as torch's ``data_parallel`` does them
``nn.DataParallel(m, ids)``     what torch makes on a machine without a GPU: ``m`` run on the
                                whole batch (``device_ids`` is ``[]``); CUDA is not touched
==============================  ==============================================================

Every CUDA index means DEVICE, so ``device_ids=[0, 1]`` asks for two
replicas and two chunks, both on DEVICE; ``device_ids=None`` (``data_parallel``)
means every GPU, and ``torch.cuda.device_count()`` is 1 there: one chunk.
Nothing here imports torch until a call needs it.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any

from .part import PlacementPart

__all__ = ["PARALLEL_CALLS", "ParallelCalls"]

#: Dotted names of the calls -> the :class:`ParallelCalls` method that answers them (the rewrite's table).
PARALLEL_CALLS = {
    **{f"torch.nn.parallel.{name}": f"dp_{name}" for name in (
        "replicate", "scatter", "parallel_apply", "gather", "data_parallel")},
    # Where they are defined: ``from torch.nn.parallel.scatter_gather import scatter_kwargs`` and the like.
    "torch.nn.parallel.replicate.replicate": "dp_replicate",
    "torch.nn.parallel.scatter_gather.scatter": "dp_scatter",
    "torch.nn.parallel.scatter_gather.scatter_kwargs": "dp_scatter_kwargs",
    "torch.nn.parallel.scatter_gather.gather": "dp_gather",
    "torch.nn.parallel.parallel_apply.parallel_apply": "dp_parallel_apply",
    "torch.nn.parallel.data_parallel.data_parallel": "dp_data_parallel",
    **{f"{where}.DataParallel": "dp_module" for where in (
        "torch.nn", "torch.nn.parallel", "torch.nn.parallel.data_parallel")},
}


def _is_torch_own(fn, name: str) -> bool:
    """``fn`` is torch's ``name`` (a name the rewrite took for torch's may hold something else now)."""
    return getattr(fn, "__name__", None) == name and str(getattr(fn, "__module__", "")).startswith("torch.nn.parallel")


def _same_device(device, target) -> bool:
    """``device`` is ``target`` (``mps:0`` is ``mps``: a target without an index is its device 0)."""
    return device.type == target.type and (device.index or 0) == (target.index or 0)


def _is_namedtuple(obj) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


class ParallelCalls(PlacementPart):
    """``torch.nn.parallel`` calls of a :class:`~.placement.Placement` (see the module notes).

    Each method takes the original function first and calls it unchanged
    without a target or on a CUDA one.
    """


    def _here(self, fn, name: str) -> bool:
        """Whether this call of torch's ``name`` is done here, on a DEVICE that is not a GPU."""
        return self.target is not None and self._kind != "cuda" and _is_torch_own(fn, name)

    # -- the four steps -----------------------------------------------------------
    def dp_replicate(self, fn, *args, **kwargs):
        """``nn.parallel.replicate(network, devices, detach=False)``."""
        __tracebackhide__ = True
        if not self._here(fn, "replicate"):
            return fn(*args, **kwargs)
        return self._replicate(*args, **kwargs)

    def dp_scatter(self, fn, *args, **kwargs):
        """``nn.parallel.scatter(inputs, target_gpus, dim=0)``."""
        __tracebackhide__ = True
        if not self._here(fn, "scatter"):
            return fn(*args, **kwargs)
        return self._scatter(*args, **kwargs)

    def dp_scatter_kwargs(self, fn, *args, **kwargs):
        """``nn.parallel.scatter_gather.scatter_kwargs(inputs, kwargs, target_gpus, dim=0)``."""
        __tracebackhide__ = True
        if not self._here(fn, "scatter_kwargs"):
            return fn(*args, **kwargs)
        return self._scatter_kwargs(*args, **kwargs)

    def dp_parallel_apply(self, fn, *args, **kwargs):
        """``nn.parallel.parallel_apply(modules, inputs, kwargs_tup=None, devices=None)``."""
        __tracebackhide__ = True
        if not self._here(fn, "parallel_apply"):
            return fn(*args, **kwargs)
        return self._parallel_apply(*args, **kwargs)

    def dp_gather(self, fn, *args, **kwargs):
        """``nn.parallel.gather(outputs, target_device, dim=0)``."""
        __tracebackhide__ = True
        if not self._here(fn, "gather"):
            return fn(*args, **kwargs)
        return self._gather(*args, **kwargs)

    def dp_data_parallel(self, fn, *args, **kwargs):
        """``nn.parallel.data_parallel(module, inputs, device_ids=None, output_device=None, dim=0,
        module_kwargs=None)``."""
        __tracebackhide__ = True
        if not self._here(fn, "data_parallel"):
            return fn(*args, **kwargs)
        return self._data_parallel(*args, **kwargs)

    def dp_module(self, cls, *args, **kwargs):
        """``nn.DataParallel(module, device_ids=None, output_device=None, dim=0)``: off a GPU, what torch
        makes where there is none (the module, run on the whole batch), without asking CUDA anything."""
        __tracebackhide__ = True
        if not self._here(cls, "DataParallel") or not isinstance(cls, type):
            return cls(*args, **kwargs)
        import inspect
        bound = inspect.signature(cls.__init__).bind(None, *args, **kwargs)   # torch's TypeError for a bad call
        made = cls.__new__(cls)
        self._torch.nn.Module.__init__(made)
        made.module = bound.arguments["module"]
        made.device_ids = []
        return made

    # -- how each is done on the one device -------------------------------------------
    def _replicate(self, network, devices, detach: bool = False) -> list:
        """torch's ``replicate``, with ``Broadcast`` done on DEVICE (see the module notes)."""
        __tracebackhide__ = True
        _check_replicatable(network)
        count = len(devices)
        if not count:
            return []
        tensors: dict[int, list] = {}
        for param in network.parameters():
            tensors[id(param)] = self._broadcast(param, count, detach)
        for buf in network.buffers():
            tensors[id(buf)] = self._broadcast(buf, count, detach or not buf.requires_grad)
        modules = list(network.modules())
        index = {id(module): i for i, module in enumerate(modules)}
        copies: list[list[Any]] = [[] for _ in range(count)]
        for module in modules:
            for j in range(count):
                replica = module._replicate_for_data_parallel()
                # As torch's: DDP reads a replica's parameters from here.
                replica._former_parameters = OrderedDict()
                copies[j].append(replica)
        for i, module in enumerate(modules):
            for j in range(count):
                _wire_replica(module, copies[j][i], [copies[j][index[id(c)]] if c is not None else None
                                                     for c in module._modules.values()], tensors, j)
        return [copies[j][0] for j in range(count)]

    def _broadcast(self, tensor, count: int, detached: bool) -> list:
        """``tensor`` for ``count`` replicas, as CUDA's broadcast gives it (it must be on DEVICE, as there
        on ``device_ids[0]``)."""
        __tracebackhide__ = True
        if not _same_device(tensor.device, self.target):
            raise RuntimeError(f"replicate: the module's parameters and buffers must be on {self.target}, the "
                               f"device every CUDA index means in this cell (torch's: on device_ids[0]), but one "
                               f"is on {tensor.device}. Move the module first (module.cuda()).")
        if detached:
            # broadcast_coalesced: the first device's copy is the tensor itself, the others new tensors.
            return [tensor, *(tensor.detach().clone() for _ in range(count - 1))]
        # Broadcast: differentiable copies whose gradients are summed into the tensor's; a view is one
        # that costs no memory (a forward never writes its parameters).
        return [tensor.view_as(tensor) for _ in range(count)]

    def _scatter(self, inputs, target_gpus, dim: int = 0):
        """torch's ``scatter``: tensors chunked along ``dim`` on DEVICE (as ``Scatter``: ``x.chunk(len(ids), dim)``)."""
        __tracebackhide__ = True
        torch, target, count = self._torch, self.target, len(target_gpus)

        def scatter_map(obj):
            if isinstance(obj, torch.Tensor):
                return tuple(chunk.to(target) for chunk in obj.chunk(count, dim))
            if _is_namedtuple(obj):
                return [type(obj)(*args) for args in zip(*map(scatter_map, obj))]
            if isinstance(obj, tuple) and len(obj) > 0:
                return list(zip(*map(scatter_map, obj)))
            if isinstance(obj, list) and len(obj) > 0:
                return [list(i) for i in zip(*map(scatter_map, obj))]
            if isinstance(obj, dict) and len(obj) > 0:
                return [type(obj)(i) for i in zip(*map(scatter_map, obj.items()))]
            return [obj for _ in target_gpus]

        try:
            return scatter_map(inputs)
        finally:
            scatter_map = None  # type: ignore[assignment]   # the recursive closure's cycle, as torch breaks it

    def _scatter_kwargs(self, inputs, kwargs, target_gpus, dim: int = 0):
        """torch's ``scatter_kwargs`` (the keyword arguments padded as torch pads them)."""
        __tracebackhide__ = True
        scattered_inputs = self._scatter(inputs, target_gpus, dim) if inputs else []
        scattered_kwargs = self._scatter(kwargs, target_gpus, dim) if kwargs else []
        if len(scattered_inputs) < len(scattered_kwargs):
            scattered_inputs.extend(() for _ in range(len(scattered_kwargs) - len(scattered_inputs)))
        elif len(scattered_kwargs) < len(inputs):
            scattered_kwargs.extend({} for _ in range(len(scattered_inputs) - len(scattered_kwargs)))
        return tuple(scattered_inputs), tuple(scattered_kwargs)

    def _parallel_apply(self, modules, inputs, kwargs_tup=None, devices=None) -> list:
        """torch's ``parallel_apply``, the replicas one after the other on DEVICE."""
        __tracebackhide__ = True
        if len(modules) != len(inputs):
            raise AssertionError(f"The number of modules {len(modules)} is not equal to "
                                 f"the number of inputs {len(inputs)}")
        if kwargs_tup is not None:
            if len(modules) != len(kwargs_tup):
                raise AssertionError(f"The number of modules {len(modules)} is not equal to "
                                     f"the number of kwargs_tup {len(kwargs_tup)}")
        else:
            kwargs_tup = ({},) * len(modules)
        if devices is not None and len(modules) != len(devices):
            raise AssertionError(f"The number of modules {len(modules)} is not equal to "
                                 f"the number of devices {len(devices)}")
        outputs = []
        for module, args, kwargs in zip(modules, inputs, kwargs_tup):
            if not isinstance(args, (list, tuple)):   # as torch: a tensor is one argument, not sliced
                args = (args,)
            outputs.append(module(*args, **kwargs))
        return outputs

    def _gather_device(self, target_device):
        """Where ``gather`` puts its result: DEVICE for any CUDA index (and None), the CPU for ``'cpu'`` and -1."""
        torch = self._torch
        if target_device is None:
            return self.target
        if isinstance(target_device, int) and not isinstance(target_device, bool) and target_device == -1:
            return torch.device("cpu")
        return torch.device(self.map(target_device))

    def _gather(self, outputs, target_device, dim: int = 0):
        """torch's ``gather``: tensors concatenated along ``dim`` (as ``Gather``), through the same containers."""
        __tracebackhide__ = True
        torch = self._torch
        device = self._gather_device(target_device)

        def gather_map(outputs):
            out = outputs[0]
            if isinstance(out, torch.Tensor):
                tensors = list(outputs)
                if dim == 0 and all(t.dim() == 0 for t in tensors):
                    tensors = [t.view(1) for t in tensors]
                    warnings.warn("Was asked to gather along dimension 0, but all input tensors were scalars; "
                                  "will instead unsqueeze and return a vector.", stacklevel=4)
                return torch.cat([t.to(device) for t in tensors], dim)
            if out is None:
                return None
            if isinstance(out, dict):
                if not all(len(out) == len(d) for d in outputs):
                    raise ValueError("All dicts must have the same number of keys")
                return type(out)((k, gather_map([d[k] for d in outputs])) for k in out)
            if _is_namedtuple(out):
                return type(out)._make(map(gather_map, zip(*outputs)))
            return type(out)(map(gather_map, zip(*outputs)))

        try:
            return gather_map(outputs)
        finally:
            gather_map = None  # type: ignore[assignment]

    def _data_parallel(self, module, inputs, device_ids=None, output_device=None, dim: int = 0,
                       module_kwargs=None):
        """torch's ``data_parallel``, with the four steps above (``device_ids=None``: the one device there is)."""
        __tracebackhide__ = True
        import itertools
        if not isinstance(inputs, tuple):
            inputs = (inputs,) if inputs is not None else ()
        if device_ids is None:
            device_ids = [0]   # every GPU there is: torch.cuda.device_count() is 1 in this cell
        if output_device is None:
            output_device = device_ids[0]
        for t in itertools.chain(module.parameters(), module.buffers()):
            if not _same_device(t.device, self.target):
                raise RuntimeError("module must have its parameters and buffers on device "
                                   f"{self.target} (device_ids[0], in this cell) but found one of them on "
                                   f"device: {t.device}")
        inputs, module_kwargs = self._scatter_kwargs(inputs, module_kwargs, device_ids, dim)
        if not inputs and not module_kwargs:
            inputs, module_kwargs = ((),), ({},)
        if len(device_ids) == 1:
            return module(*inputs[0], **module_kwargs[0])
        used = list(device_ids)[:len(inputs)]
        replicas = self._replicate(module, used)
        outputs = self._parallel_apply(replicas, inputs, module_kwargs, used)
        return self._gather(outputs, output_device, dim)


def _check_replicatable(network) -> None:
    """torch's own refusal of a network whose Python modules are children of a ScriptModule."""
    try:
        from torch.nn.parallel.replicate import _replicatable_module
    except ImportError:  # pragma: no cover - a torch without the check
        return
    if not _replicatable_module(network):
        raise RuntimeError("Cannot replicate network where python modules are children of ScriptModule")


def _wire_replica(module, replica, children: list, tensors: dict, j: int) -> None:
    """``replica`` (replica ``j`` of ``module``) takes its replicated children and its tensors' ``j``-th copies."""
    for key, child in zip(module._modules, children):
        if child is None:
            replica._modules[key] = None
        else:
            setattr(replica, key, child)
    for key, param in module._parameters.items():
        if param is None:
            replica._parameters[key] = None
        else:
            # Not leaves any more: set as plain attributes, as torch's replicas have them.
            setattr(replica, key, tensors[id(param)][j])
            replica._former_parameters[key] = tensors[id(param)][j]
    for key, buf in module._buffers.items():
        if buf is None:
            replica._buffers[key] = None
        else:
            setattr(replica, key, tensors[id(buf)][j])
