"""What a rank changes so that a cell written for one device trains on its own.

* :func:`wrap_in_ddp` - DistributedDataParallel that answers like the module it wraps;
* :func:`compressed_allreduce` - gradients all-reduced in bf16 or fp16 (``--grad-dtype``);
* :func:`refuse_unaveraged_steps` - no optimizer steps a parameter that no rank averages.

Runs in the workers: no IPython.
"""
from __future__ import annotations

import operator

__all__ = ["cell_ddp_class", "wrap_in_ddp", "user_module", "GRAD_DTYPES", "compressed_allreduce",
           "refuse_unaveraged_steps", "UnaveragedParameters"]

GRAD_DTYPES = ("fp32", "bf16", "fp16")   # what --grad-dtype takes


def compressed_allreduce(grad_dtype: str):
    """A DDP communication hook that averages each gradient bucket in ``grad_dtype`` ("bf16", "fp16").

    Half the bytes on the wire; the gradient the optimizer sees is the
    average rounded to that type (bf16 keeps 8 bits of mantissa). Each
    bucket is divided by the world size before the cast, as torch's
    ``fp16_compress_hook`` does, so the sum cannot overflow fp16. Unlike
    torch's ``bf16_compress_hook`` it needs no NCCL: gloo reduces bf16 too.

    >>> ddp_model.register_comm_hook(None, compressed_allreduce("bf16"))   # doctest: +SKIP
    """
    import torch
    import torch.distributed as dist
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[grad_dtype]

    def hook(state, bucket):
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(dist.get_world_size())
        future = dist.all_reduce(compressed, async_op=True).get_future()

        def decompress(done):
            buffer.copy_(done.value()[0])
            return buffer

        return future.then(decompress)

    hook.__name__ = f"{grad_dtype}_allreduce"
    return hook


# What a container module answers (nn.Sequential, nn.ModuleList, nn.ModuleDict): the wrapper answers
# the same where the wrapped module's class has them, and nothing more.
_CONTAINER_METHODS = ("__getitem__", "__setitem__", "__delitem__", "__len__", "__iter__", "__contains__",
                      "__reversed__")
_RESHAPING = ("__setitem__", "__delitem__")


def _make_cell_ddp():
    import torch
    from torch.nn.parallel import DistributedDataParallel

    class CellDDP(DistributedDataParallel):
        """DDP that answers like the module it wraps.

        The cell's ``model`` is this wrapper, so ``model(x)`` synchronises
        gradients; ``model.fc``, ``model[0]``, ``len(model)``, ``model.state_dict()``
        and ``model.named_parameters()`` look as they do in the notebook (no
        ``module.`` prefix), so checkpoints saved in the cell load anywhere.
        Assigning a layer (``model.fc = ...``, ``model[1] = ...``) changes the
        wrapped module, and DDP is built again over its new parameters.
        """

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return _get_from_module(self, name)

        def __setattr__(self, name, value):
            if not _set_on_module(self, name, value):
                super().__setattr__(name, value)

        def _gpumagic_rebuild(self):
            """DDP over the wrapped module's parameters as they are now (a layer was replaced)."""
            module, kwargs, after = self.module, self._gpumagic_kwargs, self._gpumagic_after_build
            self.__dict__["_gpumagic_built"] = False
            DistributedDataParallel.__init__(self, module, **kwargs)
            self._gpumagic_finish(kwargs, after)

        def _gpumagic_finish(self, kwargs, after):
            for step in after:
                step(self)
            self.__dict__.update(_gpumagic_kwargs=kwargs, _gpumagic_after_build=after, _gpumagic_built=True)

        def __reduce_ex__(self, protocol):
            # torch.save(model, PATH) (the recipes' "save the entire model"), copy.deepcopy(model) and
            # pickle give the module the user wrote, as in a plain cell: this class is local to the rank
            # and bound to its process group, so pickling it failed and a copy would be a second DDP.
            # (The wrapped module is the argument of a stdlib callable that returns it: pickle refuses a
            # reduction that rebuilds an object of another class, and the file must not need gpumagic.)
            return operator.itemgetter(0), ((self.module,),)

        def state_dict(self, *args, **kwargs):
            return self.module.state_dict(*args, **kwargs)

        def load_state_dict(self, *args, **kwargs):
            return self.module.load_state_dict(*args, **kwargs)

        def named_parameters(self, *args, **kwargs):
            return self.module.named_parameters(*args, **kwargs)

        def named_buffers(self, *args, **kwargs):
            return self.module.named_buffers(*args, **kwargs)

        def forward(self, *args, **kwargs):
            # counted (in __dict__, which a rebuild keeps): a step whose gradients came by no call of the
            # wrapper was not averaged (see refuse_unaveraged_steps)
            if torch.is_grad_enabled():
                self.__dict__["_gpumagic_forwards"] = self.__dict__.get("_gpumagic_forwards", 0) + 1
            return super().forward(*args, **kwargs)

    return CellDDP


def _get_from_module(wrapper, name: str):
    """``wrapper.name`` that DDP has not: the wrapped module's. Only once the wrapped module is in place (DDP's
    own __init__ probes attributes), and never for dunders (copy, pickle and friends ask for those)."""
    modules = wrapper.__dict__.get("_modules")
    if name.startswith("__") or not modules or "module" not in modules:
        raise AttributeError(name)
    return getattr(modules["module"], name)


def _set_on_module(wrapper, name: str, value) -> bool:
    """``wrapper.name = value`` on the wrapped module where a plain cell would set it there (new public names,
    the module's own attributes: ``model.label = ...``); DDP's own attributes (set in its __init__, or private)
    stay on the wrapper (False). A layer or parameter replaced builds DDP again over the new parameters."""
    import torch
    state = wrapper.__dict__
    inner = state.get("_modules", {}).get("module") if state.get("_gpumagic_built") else None
    layered = (torch.nn.Module, torch.nn.Parameter)
    if inner is None or name in state or name == "module" or not (
            hasattr(inner, name) or not name.startswith("_") or isinstance(value, layered)):
        return False
    old = getattr(inner, name, None)
    setattr(inner, name, value)
    if isinstance(old, layered) or isinstance(value, layered):
        wrapper._gpumagic_rebuild()
    return True


_base_class = None   # CellDDP, built on first use: importing torch.distributed stays out of the kernel
_classes: dict = {}   # the wrapped module's class -> CellDDP with its container methods


def _delegate(method: str, reshapes: bool):
    def call(self, *args):
        result = getattr(self.module, method)(*args)
        if reshapes:
            self._gpumagic_rebuild()
        return result
    call.__name__ = method
    return call


def cell_ddp_class(module_type: type | None = None):
    """The CellDDP class for wrapping a ``module_type``: with its container methods, where it has them."""
    global _base_class
    if _base_class is None:
        _base_class = _make_cell_ddp()
    if module_type is None:
        return _base_class
    cls = _classes.get(module_type)
    if cls is None:
        methods = {m: _delegate(m, m in _RESHAPING) for m in _CONTAINER_METHODS if hasattr(module_type, m)}
        if "__len__" in methods:
            methods["__bool__"] = _delegate_bool
        cls = _classes[module_type] = type(_base_class.__name__, (_base_class,), methods) if methods else _base_class
    return cls


def _delegate_bool(self) -> bool:
    return bool(self.module)


def user_module(module):
    """The module the user wrote: ``module`` itself, or the one inside torch.compile's wrapper
    (``model = torch.compile(model)`` in the notebook gives an ``OptimizedModule``)."""
    from torch._dynamo.eval_frame import OptimizedModule  # (DDP's constructor imports dynamo anyway)
    while isinstance(module, OptimizedModule):
        module = module._orig_mod
    return module


def wrap_in_ddp(module, kwargs: dict, after_build=()):
    """``module`` in a :func:`cell_ddp_class` wrapper; ``after_build`` steps (``step(wrapper)``: a
    communication hook, compiling) run now and whenever a replaced layer makes DDP build again."""
    # The container methods are those of the user's module: an OptimizedModule has ``__len__`` for
    # every model (raising for those without one), and DDP's forward tests the module's truth.
    wrapper = cell_ddp_class(type(user_module(module)))(module, **kwargs)
    wrapper._gpumagic_finish(dict(kwargs), list(after_build))
    return wrapper


class UnaveragedParameters(RuntimeError):
    """An optimizer was about to step parameters whose gradients no rank averages."""


def refuse_unaveraged_steps(averaged_modules, ns: dict, trained: list[str], frozen: list[str] | None = None,
                            wrappers: dict | None = None, hint=None):
    """Check every optimizer step of the cell: a parameter that neither DDP nor FSDP averages (a
    module built in the cell, a head added beside the model) would train a different copy on each
    rank, each on its part of the data, and the notebook would get rank 0's. So the first such
    step raises instead, naming the parameters. Every rank runs the same code, so every rank
    raises at the same step, and none waits in a collective for another.

    ``averaged_modules()`` gives the modules whose gradients the ranks average, as they are at the
    step (a wrapper that rebuilt for a replaced layer averages the new layer too); ``trained``
    names them, ``frozen`` the notebook modules left unwrapped (no trainable parameters as the cell
    started). ``wrappers`` (name: the cell's DDP wrapper): a step of a wrapped module's parameters
    before any call of its wrapper with gradients on had gradients no rank averaged (the module
    called as ``self.models[0](x)`` from a notebook object, or as ``model.module(x)``): refused too;
    ``hint(name)`` adds to that refusal (what the cell did with the module instead, as scripting it).
    Returns the hook's handle (``.remove()`` it when the cell ends).
    """
    before = set(ns)   # the names the cell started with: a module among them is the notebook's
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    passed: set = set()   # (optimizer, its stepped parameters) found all averaged before
    wrappers = dict(wrappers or {})
    for wrapper in wrappers.values():
        wrapper.__dict__["_gpumagic_forwards"] = 0   # (a wrapper kept warm from an earlier cell: this cell's)

    def check(optimizer, args, kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        key = (id(optimizer), tuple(map(id, params)))
        if key in passed:
            return
        stepped = {id(p) for p in params}
        for name, wrapper in wrappers.items():
            if not wrapper.__dict__.get("_gpumagic_forwards") and \
                    any(id(p) in stepped for p in wrapper.module.parameters()):
                raise UnaveragedParameters(
                    f"{name}'s parameters have gradients, but {name} (the cell's DDP wrapper of the notebook's "
                    f"module) was never called with gradients on, so no rank averaged them: each rank would "
                    f"train its own copy on its share of the data. Call the model as {name}(...), or hold it "
                    f"in a notebook object (self.model, self.parts.model, self.nets['g'], self.models[0]: "
                    f"attributes, dicts and lists, three levels down at most), which the cell calls through "
                    f"the wrapper; not in a tuple, nor as {name}.module(...)."
                    + (hint(name) if hint is not None else ""))
        averaged = {id(p) for module in averaged_modules() for p in module.parameters()}
        stray = [p for p in params if id(p) not in averaged]
        if not stray:
            passed.add(key)
            return
        raise UnaveragedParameters(_unaveraged_message(stray, ns, before, trained, list(frozen or [])))

    return register_optimizer_step_pre_hook(check)


def _unaveraged_message(stray: list, ns: dict, before: set, trained: list[str], frozen: list[str]) -> str:
    import torch
    wanted = {id(p) for p in stray}
    names: list[str] = []
    owners: list[str] = []
    for var, obj in ns.items():
        module = getattr(obj, "module", obj) if isinstance(obj, torch.nn.Module) else None
        if module is None or var.startswith("_"):
            continue
        found = [f"{var}.{n}" for n, p in module.named_parameters() if id(p) in wanted]
        if found:
            owners.append(var)
            names += found
            wanted -= {id(p) for _, p in module.named_parameters()}
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    if wanted:
        shown += (", and " if shown else "") + f"{len(wanted)} parameter(s) of no module the cell names"
    unfrozen = [o for o in owners if o in frozen]
    notebook = [o for o in owners if o in before and o not in frozen]
    built = [o for o in owners if o not in before]
    fixes = []
    if unfrozen:
        fixes.append(f"unfreeze {', '.join(unfrozen)} in an earlier cell (it had no trainable parameters as this "
                     "cell started, so it was not wrapped)")
    if notebook:
        fixes.append(f"name {', '.join(notebook)} with the others: --model {','.join(trained + notebook)}")
    if built:
        fixes.append(f"build {', '.join(built)} in an earlier cell (gpumagic then wraps it in DDP as it does "
                     "the others)")
    if not owners:
        fixes.append("make them part of a notebook model")
    return (f"the optimizer would step parameters whose gradients no rank averages: {shown}. Each rank "
            "would train its own copy on its part of the data, and the notebook would get rank 0's. "
            f"%%dataparallel averages the gradients of the modules it wraps ({', '.join(trained) or 'none'}); "
            f"{'; or '.join(fixes)}; or wrap the model in DistributedDataParallel yourself (then the cell runs "
            "in launch mode).")
