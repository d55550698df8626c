"""``%%sharedtrain``: Hogwild training of the notebook's model from several processes.

Thin: parse the line, call :func:`gpumagic.sharedtrain.launch.train_shared`,
show progress while it runs and a summary (table, loss per worker) after
(:mod:`gpumagic.sharedtrain.display`). The result is left in the
notebook as ``sharedtrain``.
"""
from __future__ import annotations

from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..errors import CellInterrupted, release_frames
from .args import oversubscribe, parse

__all__ = ["SharedTrainMagics"]


# --------------------------------------------------------------------------- the magic

@magics_class
class SharedTrainMagics(Magics):
    """The ``%%sharedtrain`` cell magic."""

    @magic_arguments()
    @argument("--nprocs", "-n", type=int, default=None, metavar="N",
              help="worker processes (default: one per physical core)")
    @argument("--model", "-m", default=None, metavar="NAME",
              help="the notebook module to train (default: the modules the cell uses)")
    @argument("--device", "-d", default=None, metavar="DEV",
              help="cpu or cuda:N: where the shared model lives (default: where it is); "
                   "in the cell, `device` is this device")
    @argument("--start-method", dest="start_method", default=None, choices=["spawn", "fork", "forkserver"],
              help="how workers start (default: fork where safe, else forkserver on Linux, spawn elsewhere)")
    @argument("--seed", type=int, default=None, metavar="S",
              help="worker `rank` seeds its generators with S + rank; loaders shuffle with S "
                   "(default: drawn from the notebook's torch generator)")
    @oversubscribe
    @cell_magic
    def sharedtrain(self, line, cell):
        """Train the notebook's model from N processes at once, without locks (Hogwild).

        The cell is the body of each worker's training function; ``rank``,
        ``world_size`` and ``report(**values)`` are defined in it. The model
        is moved to shared memory and every worker updates it; afterwards the
        notebook's ``model`` holds the result. DataLoaders from the notebook
        are split so each worker sees different samples. A notebook optimizer
        becomes a per-worker copy over the shared weights.

        In a notebook::

            %%sharedtrain --nprocs 4
            for data, target in train_loader:
                optimizer.zero_grad()
                loss = F.nll_loss(model(data), target)
                loss.backward()
                optimizer.step()
                report(loss=loss)

        Afterwards ``sharedtrain.history`` holds each worker's reports.
        """
        __tracebackhide__ = True
        args = parse(self.sharedtrain, line)
        from ..sharedtrain.display import RESULT_NAME, Progress
        from ..sharedtrain.launch import train_shared
        progress = Progress(self.shell)
        header = f"%%sharedtrain {line}".rstrip()
        try:
            result = train_shared(self.shell, cell, nprocs=args.nprocs, model=args.model, device=args.device,
                                  start_method=args.start_method, seed=args.seed, header=header,
                                  progress=progress.update, output=progress.output,
                                  oversubscribe=args.oversubscribe)
        except SyntaxError as exc:
            exc.__traceback__ = None  # IPython lists a SyntaxError's frames; ours say nothing
            raise exc
        except BaseException as exc:
            partial = getattr(exc, "result", None)
            if partial is not None:
                self.shell.user_ns[RESULT_NAME] = partial
            progress.stopped(partial, exc)
            release_frames(exc)   # (they hold the cell's shipped tensors until the garbage collector runs)
            if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, CellInterrupted):
                # as %%dataparallel: where the kernel happened to be waiting is not the user's concern
                raise CellInterrupted from None
            raise
        self.shell.user_ns[RESULT_NAME] = result
        progress.finish(result)
