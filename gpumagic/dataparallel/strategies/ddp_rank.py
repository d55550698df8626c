"""``--strategy ddp`` on a rank (:class:`DdpRank`): each trained module in DistributedDataParallel under the
cell's name, so that ``model(x)`` averages gradients.

Before the cell each module moves to the rank's device and is wrapped (:func:`~.ddp_wrapper.wrap_in_ddp`:
``model.fc``, ``len(model)``, ``model.state_dict()`` look as in the notebook), or, with ``--compile``, a model
the rank compiled in an earlier cell is trained again where it is the same (:mod:`.ddp_warm`); each rank
starts from the notebook's gradients (:mod:`.ddp_grads`), and the loaders are split. While the cell runs, an
optimizer step of parameters no rank averages is refused, a framework that would distribute a second time is
refused, files are written once, and the notebook's objects hold the wrappers. After it, rank 0 collects the
trained state (:mod:`.collect`), and every rank keeps the weights and DDP's averaged gradients.

Runs in the workers: no IPython.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ..protocol import Note
from ..rank.cell import RankCell
from ..rank.exports import exporting_once
from ..rank.files import writing_once
from ..rank.loaders import split_loaders
from ..rank.mode_guard import refusing_frameworks
from ..rank.send import packed_done
from ..rank.swaps import held_objects_swapped
from .base import RankStrategy
from .collect import collect, keep, name_trained, plain_grads, reload_optimizers, remember_shapes
from .ddp_grads import start_from
from .ddp_scripting import scripted_hint, scripted_results, scripting_users_modules
from .ddp_warm import (
    Adopted,
    compile_counts,
    compile_forward,
    compile_note,
    follow_kept,
    forwards_set_aside,
    warm_models,
)
from .ddp_wrapper import compressed_allreduce, refuse_unaveraged_steps, wrap_in_ddp

__all__ = ["DdpRank"]


@dataclass(frozen=True)
class DdpRank(RankStrategy):
    """DDP's options, as each rank applies them."""
    static_graph: bool = False
    find_unused: bool = False
    bucket_mb: float | None = None
    grad_dtype: str = "fp32"
    compile: str | None = None          # torch.compile mode; None: eager

    def _kwargs(self, device) -> dict:
        kwargs: dict = {"gradient_as_bucket_view": True, "static_graph": self.static_graph,
                        "find_unused_parameters": self.find_unused}
        if self.bucket_mb:
            kwargs["bucket_cap_mb"] = self.bucket_mb
        if device.type == "cuda":
            kwargs["device_ids"] = [device.index]
        return kwargs

    def _after_build(self) -> list:
        steps = []
        if self.grad_dtype != "fp32":
            hook = compressed_allreduce(self.grad_dtype)
            steps.append(lambda wrapper: wrapper.register_comm_hook(None, hook))
        if self.compile:
            # The wrapped module's forward, in place (see compile_forward); traced while DDP's forward is
            # active, dynamo splits the graph at DDP's gradient buckets, so communication still overlaps the
            # backward pass.
            mode = self.compile
            steps.append(lambda wrapper: compile_forward(wrapper.module, mode))
        return steps

    def start(self, cell: RankCell) -> None:
        warm = warm_models(cell.ctx, self.compile, cell.order.roles.modules)
        before = compile_counts() if warm is not None else None
        anew = self._wrap(cell, warm)
        cell.scratch["compile"] = (before, anew) if warm is not None else None
        cell.tensors = start_from(cell.inner, cell.grads, cell.tensors, cell.store)
        reload_optimizers(cell)
        remember_shapes(cell)
        # what the cell's names now stand for: a module inside its wrapper
        cell.swaps.update({id(m): (m, cell.ns[n]) for n, m in cell.inner.items() if cell.ns[n] is not m})
        split_loaders(cell)
        name_trained(cell)

    def _wrap(self, cell: RankCell, warm) -> dict:
        """Modules on the rank's device, wrapped in DDP, the cell's name bound to the wrapper; returns why each
        ``--compile`` model was compiled anew (name: reason)."""
        ns, device = cell.ns, cell.device
        kwargs, after_build = self._kwargs(device), self._after_build()
        options = (tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(kwargs.items())),
                   self.grad_dtype, self.compile, str(device))
        anew: dict = {}
        replaced: dict = {}   # by id: the shipped objects stay alive (in `shipped`) until it is used
        copied: set = set()
        shipped = []
        for name in cell.order.roles.modules:
            module = ns[name]
            found = warm.adopt(name, module, options) if warm is not None else None
            if isinstance(found, Adopted):
                ns[name], cell.inner[name] = found.wrapper, found.module
                replaced.update(found.replaced)
                copied |= found.copied
                shipped.append(module)
                continue
            if warm is not None:
                anew[name] = found
            module.to(device)
            cell.inner[name] = module
            if any(p.requires_grad for p in module.parameters()):
                ns[name] = wrap_in_ddp(module, kwargs, after_build)
            elif self.compile:
                compile_forward(module, self.compile)
            if warm is not None:
                warm.keep(name, ns[name], module, options)
        if replaced:
            follow_kept(ns, replaced)
            cell.tensors = [t for t in cell.tensors if (t.device, t.data_ptr()) not in copied]
        del shipped
        return anew

    def running(self, cell: RankCell) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        ns = cell.ns
        # DDP averages the modules it wraps (a module without trainable parameters is not wrapped).
        wrapped = [n for n, m in cell.inner.items() if ns[n] is not m]
        wrappers = {n: ns[n] for n in wrapped}
        scripted = cell.scratch["scripted"] = {}   # torch.jit.script(model): the user's module, as in a plain cell
        if cell.world_size > 1:
            guard = refuse_unaveraged_steps(lambda: [cell.inner[n] for n in wrapped], ns, wrapped,
                                            [n for n in cell.inner if n not in wrapped], wrappers,
                                            hint=lambda name: scripted_hint(name, scripted))
            stack.callback(guard.remove)
        for guarded in (refusing_frameworks(), writing_once(cell.rank), exporting_once(cell.rank),
                        held_objects_swapped(ns, cell.swaps), scripting_users_modules(wrappers, scripted)):
            stack.enter_context(guarded)
        return stack

    def finish(self, cell: RankCell) -> None:
        if cell.scratch["compile"] is not None and cell.rank0:
            before, anew = cell.scratch["compile"]
            cell.send(Note(compile_note(before, compile_counts(), cell.stats.first_step, anew)))
        # Rank 0's gradients go back with the weights (a plain cell leaves them on the model). DDP's average is
        # the same on every rank: each keeps it with the weights, as one process holds its gradients between
        # cells, and the next cell, which starts from the notebook's (ddp_grads), sends only their keys.
        grads = plain_grads(cell.inner)
        if cell.rank0:
            collect(cell, grads)
            # torch.jit.script(model) in the cell: the kernel scripts the notebook's model again
            cell.trained.scripted, traced = scripted_results(cell.ns, cell.order.watch.assigned,
                                                             cell.scratch["scripted"])
            cell.answered |= set(cell.trained.scripted) | set(traced)
            cell.not_returned += list(traced.values())
        keep(cell, grads, kept_grads=True, gathered={})

    def send(self, cell: RankCell, returned):
        with forwards_set_aside(cell.inner.values()):   # (a compiled forward does not pickle: models travel plain)
            return packed_done(cell, returned)
