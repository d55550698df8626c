"""``%%dataparallel``: train the cell's model on every device; the trained weights come back.

Thin: parse the line, make a :class:`gpumagic.dataparallel.plan.Plan`, call
:func:`gpumagic.dataparallel.kernel.train.run_cell`, bind its result in the notebook as ``dataparallel`` (as
``%%sharedtrain`` binds ``sharedtrain``) and show its note. ``%%dataparallel?`` shows the options by group:
those every strategy takes, each strategy's own, launch mode's and the cluster's. The line form manages the
worker pool and clusters: ``%dataparallel status``, ``%dataparallel stop``, ``%dataparallel cluster start|stop``.
"""
from __future__ import annotations

from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, argument_group, magic_arguments

from .. import display
from ..errors import CellInterrupted, release_frames, usage_error
from .args import oversubscribe, parse

__all__ = ["DataParallelMagics", "pool_status", "cluster_status"]

_ACTIONS = ("status", "stop", "cluster")
_CLUSTER_ACTIONS = ("start", "stop", "status")
# the options each strategy owns, by their names on the command line's namespace
_STRATEGY_OPTIONS = ("static_graph", "find_unused", "bucket_mb", "grad_dtype", "compile", "wrap", "keep_optimizer")


def cluster_status(ranks) -> display.Rendered:
    """A cluster's ranks: host, engine, device, pid, and whether each engine is alive."""
    st = ranks.status()
    head = (f"%%dataparallel cluster: {st['source']}; {st['state']}, {st['world_size']} rank(s), backend "
            f"{st['backend'] or '-'}, {st['tasks_run']} cell(s) run")
    header = ["rank", "host", "engine", "device", "LOCAL_RANK", "pid", "alive"]
    rows = [[str(r["rank"]), r["host"], str(r["engine"]), r["device"], str(r["local_rank"]), str(r["pid"]),
             "yes" if r["alive"] else "no"] for r in st["ranks"]]
    return display.Rendered(head + "\n" + display.text_table(rows, header),
                            f"<b>{head}</b>" + display.html_table(rows, header))


def pool_status(ns: dict | None = None) -> display.Rendered:
    """The ``%%dataparallel`` worker pool: state, backend, rendezvous, each rank's device and pid, and
    what only its workers hold (``ns``: the notebook's names); the cluster's ranks too, while
    ``--cluster`` cells use one."""
    from ..dataparallel.kernel import held
    from ..dataparallel.ranks import local
    from ..dataparallel.ranks.cluster_setup import current_cluster
    ranks = current_cluster()
    cluster = cluster_status(ranks) if ranks is not None else None
    here = local.current()
    if here is None:
        return cluster or display.Rendered(
            "%%dataparallel pool: not started (the first %%dataparallel cell starts it)",
            "<b>%%dataparallel pool</b>: not started (the first %%dataparallel cell starts it)")
    st = here.pool.status()
    head = (f"%%dataparallel pool: {st['state']}, {st['world_size']} rank(s), backend {st['backend']}, "
            f"rendezvous {st['rendezvous'] or '-'}, started in {st['start_seconds'] or 0:.1f} s, "
            f"{st['tasks_run']} cell(s) run")
    if here.kept.tensors:
        head += f", {len(here.kept.tensors)} large tensor(s) kept in the workers"
    only_here = held.held_names(ns) if ns is not None else []
    if only_here:
        head += f"; only these workers hold {', '.join(only_here)} (--strategy fsdp): stopping them loses it"
    header = ["rank", "device", "name", "pid", "alive", "memory (RSS)"]
    rows = [[str(r["rank"]), r["device"], r.get("device_name") or "", str(r["pid"]), "yes" if r["alive"] else "no",
             display.fmt_bytes(r["rss"])] for r in st["ranks"]]
    local_rendered = display.Rendered(head + "\n" + display.text_table(rows, header),
                                      f"<b>{head}</b>" + display.html_table(rows, header))
    if cluster is None:
        return local_rendered
    return display.Rendered(cluster.text + "\n\n" + local_rendered.text,
                            f"{cluster.html_text}<br>{local_rendered.html_text}")


@magics_class
class DataParallelMagics(Magics):
    """``%%dataparallel`` and ``%dataparallel status|stop|cluster start|cluster stop``."""

    @magic_arguments()
    @argument("action", nargs="?", default=None,
              help="line form only: 'status' (the worker pool, or the cluster's ranks), 'stop' (end the worker "
                   "processes), 'cluster start' / 'cluster stop' / 'cluster status' (an ipyparallel cluster whose "
                   "engines are the ranks of --cluster cells)")
    @argument("verb", nargs="?", default=None, help="after 'cluster': start, stop or status")
    @argument("--devices", default=None,
              help="comma-separated devices, one rank each: '0,1', 'cuda:0,cuda:1', or 'cpu' with --nprocs")
    @argument("--nprocs", "-n", type=int, default=None,
              help="number of ranks: the first N GPUs, or N CPU processes where there is no GPU (default: one per "
                   "GPU, else 2); with --cluster, the first N engines; with 'cluster start', the engines to start")
    @argument("--strategy", default="ddp", choices=["ddp", "fsdp", "dp"],
              help="ddp (default): one worker process per device with DistributedDataParallel; "
                   "fsdp: one worker process per device, parameters, gradients and optimizer state sharded "
                   "over them (FSDP2), for models whose training does not fit one GPU; "
                   "dp: in the kernel, each call of the model split over the devices")
    @argument("--model", default=None,
              help="NAME[,NAME]: the module(s) to train (default: the modules the cell uses)")
    @argument("--backend", default=None, choices=["nccl", "gloo"],
              help="torch.distributed backend (default: nccl on GPUs, gloo on CPU)")
    @argument("--timeout", type=float, default=None,
              help="seconds a collective may wait before the ranks give up (default 1800)")
    @argument("--all-output", action="store_true",
              help="show every rank's output, each line prefixed [rank N] (default: rank 0's)")
    @argument("--seed", type=int, default=None, help="seed every rank with this (default: drawn from torch's RNG)")
    @oversubscribe
    @argument_group("--strategy ddp (the default): gpumagic's DDP wrapper")
    @argument("--static-graph", action="store_true",
              help="DDP static_graph=True: the same parameters are used in every step (a little faster)")
    @argument("--find-unused", action="store_true",
              help="DDP find_unused_parameters=True: for models whose forward skips some parameters")
    @argument("--bucket-mb", type=float, default=None, help="DDP gradient bucket size in MB (default 25)")
    @argument("--grad-dtype", default=None, metavar="{fp32,bf16,fp16}",
              help="all-reduce gradients in this dtype: bf16 or fp16 halve the bytes, rounding the "
                   "averaged gradient (default fp32)")
    @argument("--compile", nargs="?", const="default", default=None, metavar="MODE",
              help="torch.compile the cell's models in each rank; MODE as torch.compile's: default, "
                   "reduce-overhead (CUDA graphs), max-autotune, max-autotune-no-cudagraphs. Compiled code "
                   "stays warm in the pool for later cells")
    @argument_group("--strategy fsdp: the model's parameters, gradients and optimizer state sharded over the ranks")
    @argument("--wrap", default=None, metavar="CLASS[,CLASS]",
              help="the block classes sharded as units (default: the model's repeated blocks, such as a "
                   "transformer's layers)")
    @argument("--keep-optimizer", action="store_true",
              help="the optimizer's state stays sharded in the workers (for when it is too big for the "
                   "kernel); later cells continue from it")
    @argument_group("launch mode: the cell's framework distributes")
    @argument("--launch", action="store_true",
              help="every rank runs the cell as a process torchrun started (RANK, LOCAL_RANK, WORLD_SIZE, "
                   "MASTER_ADDR, ... set, the process group formed); the cell's framework wraps the model and "
                   "splits the data. Chosen without the flag when the cell builds a Hugging Face Trainer, an "
                   "Accelerator, a Lightning Trainer or Fabric, its own DDP or FSDP, or calls init_process_group")
    @argument_group("--cluster: the ranks are the engines of an ipyparallel cluster")
    @argument("--cluster", nargs="?", const="started", default=None, metavar="PROFILE_OR_FILE",
              help="run the ranks on the engines of an ipyparallel cluster: the one 'cluster start' started "
                   "(no value), a profile's, or the cluster or client connection file given")
    @argument("--engines", default="local",
              help="with 'cluster start': ipyparallel's engine launcher: local, mpi, slurm, pbs, lsf, ssh, ...")
    @argument("--profile", default=None, help="with 'cluster start': the ipyparallel profile (its config)")
    @line_cell_magic
    def dataparallel(self, line, cell=None):
        """Train the cell's model on every GPU; the notebook's model gets the trained weights.

        In a notebook::

            %%dataparallel
            for epoch in range(3):
                for x, y in train_loader:
                    x, y = x.cuda(), y.cuda()
                    opt.zero_grad()
                    loss = loss_fn(model(x), y)
                    loss.backward()
                    opt.step()
                losses.append(loss.item())

        One worker process per GPU runs the cell with ``model`` wrapped in
        DistributedDataParallel and ``train_loader`` split so that the ranks
        share every batch. Afterwards ``model`` and ``opt`` (the same
        objects) hold rank 0's trained state and ``losses`` its values;
        ``dataparallel`` holds what the cell did (steps per rank, timings).
        Without GPUs, ``--nprocs N`` runs N CPU processes (gloo).

        ``%dataparallel status`` shows the worker pool (or the cluster's ranks);
        ``%dataparallel stop`` ends it (``%unload_ext gpumagic`` does too).
        Beyond one machine: ``%dataparallel cluster start --engines slurm -n 8``
        starts an ipyparallel cluster, and ``%%dataparallel --cluster`` cells
        train on its engines (``--cluster PROFILE`` for one started elsewhere).
        """
        args = parse(self.dataparallel, line)
        if cell is None:
            return self._line(args)
        self._refuse_line_form(args)
        from ..cell.compile import is_empty
        from ..dataparallel.plan import make_plan
        plan = make_plan(devices=args.devices, nprocs=args.nprocs, strategy=args.strategy, models=args.model,
                         backend=args.backend, timeout=args.timeout, all_output=args.all_output, seed=args.seed,
                         cluster=args.cluster, oversubscribe=args.oversubscribe, launch=args.launch,
                         **{o: getattr(args, o) for o in _STRATEGY_OPTIONS})
        if is_empty(cell):
            return None
        return self._run(cell, plan, f"%%dataparallel {line}".rstrip())

    def _refuse_line_form(self, args) -> None:
        """``UsageError`` for what the cell form does not take: an action, ``cluster start``'s options."""
        if args.action is not None or args.verb is not None:
            raise usage_error(f"{args.action!r} belongs to the line form (%dataparallel {args.action}); "
                              "the cell form takes only options", ["--devices", "--nprocs", "--strategy"])
        cluster_start = [(flag, value) for flag, value, given in (
            ("--engines", args.engines, args.engines != "local"),
            ("--profile", args.profile, args.profile is not None)) if given]
        if cluster_start:
            raise usage_error(f"{' '.join(flag for flag, _ in cluster_start)} belong(s) to %dataparallel cluster "
                              "start; the cell form finds a cluster with --cluster [PROFILE_OR_FILE]",
                              ["--cluster", "%dataparallel cluster start "
                               + " ".join(f"{flag} {value}" for flag, value in cluster_start)])

    def _run(self, cell: str, plan, header: str):
        """Run the cell; its result bound in the notebook as ``dataparallel``; its note shown; its value returned."""
        from ..dataparallel.kernel.result import RESULT_NAME
        from ..dataparallel.kernel.train import run_cell
        shell = self.shell
        assert shell is not None
        for text in plan.notes:
            display.note(text)
        try:
            result = run_cell(shell, cell, plan, header=header)
        except SyntaxError as exc:
            exc.__traceback__ = None  # IPython lists a SyntaxError's frames; ours say nothing
            raise exc
        except KeyboardInterrupt as exc:
            release_frames(exc)
            raise CellInterrupted from None
        except BaseException as exc:
            release_frames(exc)   # (they hold the cell's shipped tensors until the garbage collector runs)
            raise
        shell.user_ns[RESULT_NAME] = result
        for text in result.notes():
            display.note(text)
        return result.value

    def _only(self, args, action: str, allowed: set) -> None:
        """``UsageError`` for options the line form ``action`` does not take."""
        defaults = vars(parse(self.dataparallel, ""))
        allowed = allowed | {"action", "verb"}
        given = [f"--{k.replace('_', '-')}" for k, v in vars(args).items() if k not in allowed and v != defaults[k]]
        if given:
            takes = ", ".join(f"--{k}" for k in sorted(allowed - {"action", "verb"})) or "no options"
            raise usage_error(f"{' '.join(given)} belong(s) to the cell form (%%dataparallel {' '.join(given)} on "
                              f"top of a cell); %dataparallel {action} takes {takes}", _ACTIONS)

    def _cluster(self, args):
        """``%dataparallel cluster start [--engines E] [-n N] [--profile P]``, ``cluster stop``, and
        ``cluster status`` (what ``%dataparallel status`` shows, where a user looks for it)."""
        from ..dataparallel.ranks import cluster_setup as cluster
        verb = args.verb
        if verb not in _CLUSTER_ACTIONS:
            raise usage_error(f"%dataparallel cluster{' ' + verb if verb else ''}: start, stop or status",
                              ["%dataparallel cluster start --engines local -n 2", "%dataparallel cluster stop",
                               "%dataparallel status"])
        if verb == "status":
            args.action, args.verb = "status", None
            return self._line(args)
        if verb == "stop":
            self._only(args, "cluster stop", set())
            stopped = cluster.stop_cluster()
            display.note(f"%%dataparallel: {stopped or 'no cluster in use'}")
            return None
        self._only(args, "cluster start", {"engines", "nprocs", "profile", "oversubscribe"})
        ranks = cluster.start_cluster(args.engines, args.nprocs, args.profile, oversubscribe=args.oversubscribe)
        display.note(f"%%dataparallel: {ranks.source}; run cells with %%dataparallel --cluster")
        return None

    def _line(self, args):
        action = args.action or "status"
        if action not in _ACTIONS:
            raise usage_error(f"%dataparallel {action!r}: the line form takes an action", _ACTIONS)
        if action == "cluster":
            return self._cluster(args)
        if args.verb is not None:
            raise usage_error(f"%dataparallel {action} takes no {args.verb!r}", _ACTIONS)
        self._only(args, action, set())
        if action == "stop":
            from ..dataparallel.kernel import held
            from ..dataparallel.ranks import local
            stopped = local.stop()
            display.note("%%dataparallel pool stopped" if stopped else "%%dataparallel pool was not running")
            held.lost("%dataparallel stop ended them", self.shell.user_ns)
            return None
        shown = pool_status(self.shell.user_ns)
        if display.widgets_supported(self.shell):
            from IPython.display import display as show
            show(shown)
        else:
            print(shown.text)
        return None

