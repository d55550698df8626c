"""``%gpumem``: memory per device, live gauges, which variables hold it, freeing it."""
from __future__ import annotations

import argparse
import math

from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from .. import display
from ..errors import UsageError, usage_error
from .args import parse

__all__ = ["MemoryMagics", "memory_devices", "check_args", "watch", "gpu_processes"]

_ACTIONS: tuple[str, ...] = ("--watch", "--stop", "--vars", "--free", "--rescue", "--cells", "--park", "--unpark",
                             "--who", "--reclaim")
MIN_INTERVAL = 0.05   # seconds: faster than 20 readings a second only burns the kernel's CPU
MAX_INTERVAL = 3600.0  # an hour: gauges that slow show nothing live (and past TIMEOUT_MAX the thread died)
_INTERVAL_RANGE = f"must be a number of seconds from {MIN_INTERVAL} to {MAX_INTERVAL:.0f}"
_INTERVAL_CHOICES = [f"{MIN_INTERVAL}", "0.25 (default)", "0.5", "1", "...", f"{MAX_INTERVAL:.0f}"]


def _seconds(text: str) -> float:
    """``--interval``'s value; a word that is no number names the valid range (argparse's would not)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{_INTERVAL_RANGE}, not {text!r}") from None


def memory_devices(gpus) -> list[str]:
    """The devices ``%gpumem`` can show: the CPU, each GPU, and MPS where present."""
    from ..devices.discovery import mps_available
    names = ["cpu"] + [g.device for g in gpus]
    if mps_available():
        names.append("mps")
    return names


def check_args(args, gpus, hung: str | None = None) -> str | None:
    """Validate parsed arguments; returns the canonical device (None: all devices).

    ``hung``: the note where the GPUs could not be listed; a GPU named then is taken unchecked.
    """
    from ..devices import parse_device
    from ..devices.discovery import unchecked_gpu
    chosen = [flag for flag in _ACTIONS if getattr(args, flag[2:])]
    if len(chosen) > 1:
        raise usage_error(f"{' and '.join(chosen)} cannot be combined; pick one", _ACTIONS)
    if args.json and (args.watch or args.stop or args.cells):
        raise usage_error(f"--json returns a report's data; {chosen[0]} has none",
                          ["%gpumem --json", "%gpumem --vars --json", "%gpumem --free --json"])
    if args.history and not args.free:
        raise usage_error("--history only applies to --free", ["--free --history"])
    if args.drop and not args.rescue:
        raise usage_error("--drop only applies to --rescue", ["--rescue --drop"])
    if args.interval is not None:
        if not args.watch:
            raise usage_error("--interval only applies to --watch", ["--watch --interval S"])
        if not (math.isfinite(args.interval) and MIN_INTERVAL <= args.interval <= MAX_INTERVAL):
            raise usage_error(f"--interval {_INTERVAL_RANGE}, not {args.interval}", _INTERVAL_CHOICES)
    if args.device is None:
        return None
    if hung is not None and unchecked_gpu(args.device) is not None:
        return unchecked_gpu(args.device)
    choices = memory_devices(gpus)
    try:
        device = parse_device(args.device, gpus)
    except UsageError as exc:  # name the devices %gpumem can show, not every device
        raise usage_error(str(exc).split("; valid choices")[0], choices) from None
    if device not in choices:
        raise usage_error(f"device {device!r} holds no memory to show", choices)
    return device


def _report(shell, result, as_json: bool) -> dict | None:
    """``--json``: the report's plain data, shown nowhere; else show it and return None.

    As ``%gpuinfo`` does: returning the report and showing it too would show it
    twice when the magic ends a cell, and showing it only as the cell's value
    would show nothing when the magic is not the cell's last line.
    """
    if as_json:
        return result.as_dict()
    _show(shell, result)
    return None


def _show(shell, result) -> None:
    """HTML in a notebook, text in a terminal."""
    display.show(shell, result)


def watch(shell, device: str | None, gpus, interval: float, hung: str | None = None):
    """Start the gauges (notebook) or print one snapshot (terminal); returns the monitor or None.

    ``hung``: the note where the GPUs could not be listed (the driver did not answer): the
    gauges are those that need no NVML. The first reading is bounded too (:class:`.Monitor`).
    """
    from ..devices import memory
    if not display.widgets_supported(shell):
        print("Live gauges need a notebook (Jupyter with ipywidgets); here is one snapshot:")
        print(memory.snapshot(device, gpus, hung).text())
        return None
    from IPython.display import display as show

    from ..widgets import monitor
    targets = memory.targets(device, gpus)
    mon = monitor.start(targets, interval=interval) if targets else None
    if mon is not None:
        show(mon.box)
    for note in (hung, mon and mon.stalled):
        if note:
            print(f"note: {note}")
    return mon


def gpu_processes(device: str | None, gpus, reclaim: bool, hung: str | None = None):
    """``--who`` (every process on the GPUs, named) or ``--reclaim`` (end this user's orphans): the report."""
    if device is not None and not device.startswith("cuda:"):
        raise usage_error(f"{'--reclaim' if reclaim else '--who'} is about GPU processes; {device} has none",
                          ["every GPU (no device)", *[g.device for g in gpus]])
    from ..devices.gpu_processes import who
    from ..memory.reclaim import reclaim as end_orphans
    report = end_orphans(device, gpus) if reclaim else who(device, gpus)
    if hung:
        report.notes.append(hung)
    return report


@magics_class
class MemoryMagics(Magics):

    @magic_arguments()
    @argument("device", nargs="?", default=None,
              help="one device: cpu, cuda (or gpu), cuda:N, N, mps (default: every device)")
    @argument("--watch", action="store_true",
              help="live gauges, one per device, fed by one background thread (notebook only)")
    @argument("--interval", type=_seconds, default=None, metavar="S",
              help=f"seconds between gauge updates with --watch, {MIN_INTERVAL} to {MAX_INTERVAL:.0f} "
                   "(default 0.25: at most 4 a second)")
    @argument("--stop", action="store_true", help="stop the gauges and close them")
    @argument("--who", action="store_true",
              help="every process on the GPUs, with its memory: this kernel, other kernels and their notebooks, "
                   "workers, orphans, other users' processes")
    @argument("--reclaim", action="store_true",
              help="end this user's orphans (workers, DataLoader children whose kernel is gone); report what it freed")
    @argument("--vars", action="store_true",
              help="which notebook variables hold memory on which device, largest first")
    @argument("--free", action="store_true",
              help="let go of what only IPython holds (the last error's frames), collect garbage, release "
                   "torch's caches; report what was freed and what still holds memory")
    @argument("--history", action="store_true",
              help="with --free: also the output history's entries (Out[N], _N, _) that hold tensors")
    @argument("--rescue", action="store_true",
              help="after an error (out of memory): move the GPU tensors only the last error holds to the CPU, "
                   "where %%debug still shows them, and release torch's caches")
    @argument("--drop", action="store_true",
              help="with --rescue: let go of what the last error holds instead of moving it")
    @argument("--park", action="store_true",
              help="move every tensor the notebook holds on DEVICE (default: every GPU) to pinned host memory, "
                   "in place, and release the GPU: for another job to use it; the same objects stay")
    @argument("--unpark", action="store_true", help="bring what --park moved back to the GPUs it came from")
    @argument("--cells", action="store_true",
              help="a ledger after each cell: per device, before -> after and the cell's peak, the variables that "
                   "grew, and re-runs that keep growing (a leak); again to turn it off")
    @argument("--json", action="store_true",
              help="return the report as a plain dict instead of showing it (the table, --vars, --free)")
    @line_magic
    def gpumem(self, line=""):
        """Memory per device: used/total, this kernel's share, torch's allocator figures.

        GPU figures come from NVML and never initialise CUDA or create a CUDA
        context; torch's allocated/reserved/peak appear for GPUs once the
        kernel itself has used CUDA. For the CPU: the kernel's resident
        memory and the machine's.

        Examples
        --------
        ::

            %gpumem                    # every device
            %gpumem cuda:0 --watch     # a live gauge for cuda:0
            %gpumem --watch --interval 1
            %gpumem --stop
            %gpumem --who              # who holds each GPU: kernels and their notebooks, workers, orphans
            %gpumem --reclaim          # end this user's orphans; NVML's memory before and after
            %gpumem --vars             # tensors, models, optimizer state by variable
            %gpumem --free             # let go of the last error, gc, empty_cache: what it gave back
            %gpumem --free --history   # also Out[...] entries that hold tensors
            %gpumem --rescue           # after an out-of-memory error: its GPU tensors to the CPU
            %gpumem --cells            # a memory ledger after each cell (again: off)
            %gpumem --park             # the notebook's GPU tensors to pinned host memory, the GPU free
            %gpumem --unpark           # and back: the same objects
            held = %gpumem --vars --json   # the same as plain data; shows nothing
        """
        from ..devices import memory
        from ..devices.discovery import bounded_gpus
        from ..memory import free, variables
        args = parse(self.gpumem, line)
        # --stop asks NVML nothing (unless a device is named): with a wedged driver it must still stop the gauges.
        # Elsewhere the GPUs are listed in a bounded reading: a wedged driver leaves them out, with a note.
        gpus, hung = ([], None) if args.stop and args.device is None else bounded_gpus()
        device = check_args(args, gpus, hung)

        if args.stop:
            stopped = _stop_monitor()
            print("Stopped the memory gauges." if stopped else "No memory gauges were running.")
            return None
        if args.watch:
            from ..widgets.monitor import DEFAULT_INTERVAL
            watch(self.shell, device, gpus, args.interval or DEFAULT_INTERVAL, hung)
            return None
        if args.who or args.reclaim:
            return _report(self.shell, gpu_processes(device, gpus, args.reclaim, hung), args.json)
        if args.vars:
            # The shell holds every variable (user_ns, Out, `_`): through it, `ip = get_ipython()` would list them all.
            report = variables.variable_memory(self.shell.user_ns, hidden=self.shell.user_ns_hidden,
                                               device=device, history=self.shell.user_ns.get("Out"),
                                               holders=(self.shell,), last_error=_last_error())
            return _report(self.shell, report, args.json)
        if args.free:
            freed = free.free_memory(device, history=self.shell.user_ns.get("Out"), user_ns=self.shell.user_ns,
                                     hidden=self.shell.user_ns_hidden, holders=(self.shell,), shell=self.shell,
                                     drop_history=args.history)
            return _report(self.shell, freed, args.json)
        if args.cells:
            from .cell_events import toggle_ledger
            on = toggle_ledger(self.shell)
            print("The memory ledger is on: a line per device after each cell (`%gpumem --cells` again turns it off)."
                  if on else "The memory ledger is off.")
            return None
        if args.rescue:
            return _report(self.shell, _rescue(self.shell, device, args.drop), args.json)
        if args.park or args.unpark:
            return _report(self.shell, _park(self.shell, device, args.unpark), args.json)
        return _report(self.shell, memory.snapshot(device, gpus, hung), args.json)


def _park(shell, device: str | None, back: bool):
    """``--park`` (a GPU, or every GPU) and ``--unpark`` (everything parked)."""
    from ..memory import park
    if back:
        if device is not None:
            raise usage_error("--unpark brings everything parked back where it came from; it takes no device",
                              ["%gpumem --unpark"])
        return park.unpark(shell, shell.user_ns, hidden=shell.user_ns_hidden, holders=(shell,))
    if device is not None and not device.startswith("cuda:"):
        raise usage_error(f"--park moves tensors off a GPU, and {device} is none",
                          ["%gpumem --park", "%gpumem cuda:N --park"])
    return park.park(shell, shell.user_ns, hidden=shell.user_ns_hidden, holders=(shell,), device=device)


def _rescue(shell, device: str | None, drop: bool):
    """``--rescue``: a host too small for the copies is a UsageError that names ``--drop``."""
    from ..memory import rescue
    if device == "cpu":
        raise usage_error("--rescue moves tensors off a GPU; cpu is where they go",
                          ["%gpumem --rescue", "%gpumem cuda:N --rescue", "%gpumem --rescue --drop"])
    try:
        return rescue.rescue(shell, shell.user_ns, hidden=shell.user_ns_hidden, holders=(shell,), device=device,
                             drop=drop)
    except rescue.NotEnoughHostMemory as exc:
        raise UsageError(str(exc)) from None


def _last_error() -> BaseException | None:
    """The error IPython last showed: its traceback's frames keep their locals alive until the next."""
    import sys
    error = getattr(sys, "last_exc", None)
    if error is None:   # before Python 3.12; `or` would ask the error's own __bool__
        error = getattr(sys, "last_value", None)
    return error if issubclass(type(error), BaseException) else None


def _stop_monitor() -> bool:
    """Stop the gauges without importing ipywidgets when none ever ran."""
    import sys
    mod = sys.modules.get("gpumagic.widgets.monitor")
    return mod.stop() if mod is not None else False
