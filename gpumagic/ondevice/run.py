"""Run a cell on a chosen device: the plain function behind ``%%ondevice``.

:func:`run_on_device` compiles the cell the way IPython does (so the value of
its last expression comes back, other AST transformers apply, and tracebacks
show ``Cell In[n], line k`` with the user's source), rewrites CUDA-specific
placement to follow the device (:mod:`gpumagic.cell.rewrite`), runs it
with the device current, and puts everything back afterwards: torch's
default device, the current CUDA device and the current stream are what they
were before, whether the cell succeeded or raised. Afterwards the device
values the cell bound hold the device (``'cuda'`` becomes ``'cpu'`` after a
cell on cpu: :mod:`gpumagic.cell.device_values`), and functions defined in it
keep following a device wherever they run (:mod:`gpumagic.cell.rewrite`).
``--move`` is :mod:`.moves`; ``--stream`` and ``--time`` are :mod:`.streams`
and :mod:`.timing`.

Examples
--------
::

    from gpumagic.ondevice.run import OnDeviceOptions, run_on_device
    result = run_on_device(get_ipython(), "x = torch.zeros(2).cuda()\\nx",
                           OnDeviceOptions(device="cpu"))
    result.value.device          # device(type='cpu')
"""
from __future__ import annotations

import logging
import os
import types
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from .. import devices
from ..cell.compile import compile_cell, is_empty, run_compiled
from ..cell.device_values import settle, settle_note
from ..cell.names import names_assigned
from ..cell.rewrite.helper import PlacementRewriter, follow, helper_name, made_for, modules_on
from ..errors import usage_error
from .moves import DryRunMoves, Moved, apply_moves, move_note, plan_moves
from .streams import SideStream, side_stream

logger = logging.getLogger(__name__)

__all__ = ["OnDeviceOptions", "OnDeviceResult", "Moved", "run_on_device", "resolve_device",
           "plan_moves", "apply_moves"]

# gpumagic/, whose frames are left out of the user's tracebacks
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@dataclass
class OnDeviceOptions:
    """What ``%%ondevice [DEVICE] [--stream] [--sync] [--time] [--move ...] [--no-rewrite]`` asks for."""
    device: str | None = None          # None: the session's current device
    stream: bool = False
    sync: bool = False
    time: bool = False
    move: tuple[str, ...] = ()
    rewrite: bool = True
    header: str = "%%ondevice"         # the magic's line, kept so line numbers match the notebook


@dataclass
class OnDeviceResult:
    """What a cell run produced."""
    device: str | None                 # canonical device; None for an empty cell
    value: object = None               # the value of the cell's last expression
    ran: bool = False
    moved: list[Moved] = field(default_factory=list)
    timing: object = None              # gpumagic.ondevice.timing.Timing with --time
    rewrites: int = 0                  # places the placement rewrite changed
    recorded: int = 0                  # tensors record_stream-ed with --stream

    def move_note(self) -> str | None:
        return move_note(self.moved, self.device)


# -- the device ----------------------------------------------------------------

def _gpus():
    """Visible GPUs (``devices.visible_gpus`` keeps them while the environment is unchanged)."""
    return devices.visible_gpus()


def resolve_device(spec) -> str:
    """``spec`` as a canonical device name; ``None`` is the session's current device.

    Raises ``UsageError`` naming the devices that exist.
    """
    gpus = _gpus()
    if spec is None or str(spec).strip() == "":
        return devices.default_device(gpus)
    return devices.parse_device(spec, gpus)


# -- device state ------------------------------------------------------------------

def _explicit_default_device(torch):
    """The device set with ``torch.set_default_device`` (None when unset)."""
    try:
        from torch.utils import _device
    except ImportError:  # pragma: no cover - torch without the default-device machinery
        return None
    return getattr(_device, "CURRENT_DEVICE", None)


class _DeviceState:
    """Torch's default device, the current CUDA device and current streams, to put back later.

    Never initialises CUDA for a cell that does not run on a GPU.
    """

    __slots__ = ("torch", "default", "cuda_device", "streams")

    def __init__(self, torch, target):
        self.torch = torch
        self.default = _explicit_default_device(torch)
        self.cuda_device = None
        self.streams = {}
        if target.type == "cuda" or devices.torch_cuda_initialized():
            cuda = torch.cuda
            self.cuda_device = cuda.current_device()
            self.streams[self.cuda_device] = cuda.current_stream(self.cuda_device)
            if target.type == "cuda" and target.index not in self.streams:
                self.streams[target.index] = cuda.current_stream(target.index)

    def restore(self) -> None:
        torch = self.torch
        if _explicit_default_device(torch) != self.default:
            torch.set_default_device(self.default)
        if not devices.torch_cuda_initialized():
            return
        cuda = torch.cuda
        if self.cuda_device is None:
            # CUDA started during the cell: "before" was device 0 and its default stream.
            index = cuda.current_device()
            if cuda.current_stream(index) != cuda.default_stream(index):
                cuda.set_stream(cuda.default_stream(index))
            if index != 0:
                cuda.set_device(0)
            return
        for index, stream in self.streams.items():
            if cuda.current_stream(index) != stream:
                cuda.set_stream(stream)
        if cuda.current_device() != self.cuda_device:
            cuda.set_device(self.cuda_device)


def _user_traceback(tb):
    """``tb`` without gpumagic's frames, so the user sees their own lines only."""
    kept = []
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
            kept.append(tb)
        tb = tb.tb_next
    new = None
    for entry in reversed(kept):
        new = types.TracebackType(new, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return new


# What torch says when code asks for CUDA where it cannot start (a CPU build, no driver, no GPU).
_NO_CUDA = ("Torch not compiled with CUDA enabled", "Found no NVIDIA driver", "No CUDA GPUs are available")


def _explain_cuda_error(exc: BaseException, target, rewrite: bool) -> None:
    """On a device that is not a GPU, say why code of the cell could still reach CUDA (a note on ``exc``)."""
    if target.type == "cuda" or not isinstance(exc, (AssertionError, RuntimeError)) \
            or not any(text in str(exc) for text in _NO_CUDA) \
            or any(note.startswith("%%ondevice") for note in getattr(exc, "__notes__", ())):
        return   # a nested %%ondevice cell said it already
    if rewrite:
        note = (f"%%ondevice {target}: the cell's own CUDA spellings (.cuda(), 'cuda', torch.cuda.FloatTensor, "
                f"...) run on {target}, but this call reached CUDA through code the rewrite does not see (a "
                f"function or class from a plain cell or a library, a name built at run time). Define that code "
                f"in an %%ondevice cell, or pass it the device ({str(target)!r}).")
    else:
        note = (f"%%ondevice {target} --no-rewrite: CUDA spellings (.cuda(), 'cuda', torch.cuda.FloatTensor, "
                f"...) stay as written, so they reach CUDA; leave out --no-rewrite to run them on {target}.")
    # ``exc.add_note(note)`` from Python 3.11; IPython shows ``__notes__`` on 3.10 too.
    setattr(exc, "__notes__", [*getattr(exc, "__notes__", ()), note])  # noqa: B010 - typed without it on 3.10


def _check_torch_cuda(torch, target) -> None:
    """NVML may see a GPU that this torch cannot use (a CPU build, a driver too old)."""
    if torch.cuda.is_available() and target.index < torch.cuda.device_count():
        return
    usable = [d for d in devices.available_devices(_gpus()) if not d.startswith("cuda")]
    usable[1:1] = [f"cuda:{i}" for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0)]
    raise usage_error(f"device {str(target)!r} is not usable by this torch "
                      f"({torch.__version__}, CUDA {torch.version.cuda or 'not built'})", usable)


# -- the run -------------------------------------------------------------------------

class _CellScope:
    """What a cell changes around it while it runs, and putting it back.

    ``enter()`` makes the device current, binds the cell's helper name (for
    good: functions made in the cell use it later, see
    :mod:`gpumagic.cell.rewrite`), makes every function made in a
    ``%%ondevice`` cell follow the device, and places modules built during the
    cell (or, without the rewrite, makes the device torch's default);
    ``exit()`` undoes the rest and restores :class:`_DeviceState`, whether the
    cell succeeded or raised.
    """

    def __init__(self, torch, target, shell, rewriter: PlacementRewriter | None):
        self.torch, self.target, self.shell, self.rewriter = torch, target, shell, rewriter
        self.state = _DeviceState(torch, target)
        self.contexts: list[AbstractContextManager[None]] = []

    def _enter(self, context: AbstractContextManager[None]) -> None:
        context.__enter__()
        self.contexts.append(context)

    def enter(self) -> None:
        __tracebackhide__ = True
        torch, target = self.torch, self.target
        if target.type == "cuda":
            torch.cuda.set_device(target)
        if self.rewriter is not None:
            _bind_helper(self.shell, str(target))
            self._enter(follow(target))
            if target.type != "cpu":
                self._enter(modules_on(target))
        elif target.type != "cpu" or self.state.default is not None:
            torch.set_default_device(target)

    def exit(self) -> None:
        __tracebackhide__ = True
        while self.contexts:
            self.contexts.pop().__exit__(None, None, None)
        self.state.restore()


def _bind_helper(shell, device: str) -> None:
    """Bind the helper name of ``device`` in the notebook (hidden from ``%who``) and in builtins.

    Builtins keep functions made in the cell working after ``%reset``; the
    notebook's binding is what travels with them to worker processes.
    """
    import builtins
    name, placement = helper_name(device), made_for(device)
    shell.user_ns[name] = placement
    hidden = getattr(shell, "user_ns_hidden", None)
    if isinstance(hidden, dict):
        hidden[name] = placement
    if getattr(builtins, name, None) is not placement:
        setattr(builtins, name, placement)


def _enter_side_stream(target, compiled, namespace: dict) -> tuple[Any, SideStream]:
    """``--stream``: make a side stream current (:mod:`.streams`); returns the context to exit, and its info."""
    from ..cell.names import names_read
    used = [namespace[n] for n in names_read(compiled.tree) if n in namespace]
    context = side_stream(target, namespace, also=used)
    return context, context.__enter__()


def _synchronize(torch, target) -> None:
    """``--sync``: wait for the device to finish the cell's work."""
    if target.type == "cuda":
        torch.cuda.synchronize(target)
    elif target.type == "mps":
        torch.mps.synchronize()


def run_on_device(shell, cell: str, options: OnDeviceOptions | None = None,
                  note: Callable[[str], None] | None = None) -> OnDeviceResult:
    """Run ``cell`` in ``shell.user_ns`` on ``options.device``; returns an :class:`OnDeviceResult`.

    Bad input (device, ``--move`` names) raises ``UsageError`` before anything
    changes; a syntax error points at the user's line; the cell's own
    exceptions (``KeyboardInterrupt`` included) propagate unchanged, with
    gpumagic's frames left out of their traceback. ``note`` receives short
    messages for the user (what ``--move`` moved).
    """
    __tracebackhide__ = True
    options = options or OnDeviceOptions()
    if is_empty(cell):
        return OnDeviceResult(device=None)
    import torch  # before the rewrite, which resolves torch names through the live module
    device = resolve_device(options.device)
    namespace = shell.user_ns
    to_move = plan_moves(namespace, options.move) if options.move else []
    rewriter = PlacementRewriter(namespace, helper_name(device)) if options.rewrite else None
    compiled = _compile(shell, cell, options, rewriter)
    target = torch.device(device)
    if target.type == "cuda":
        _check_torch_cuda(torch, target)
    result = OnDeviceResult(device=device, rewrites=rewriter.rewrites if rewriter else 0)
    dry_run = _move_for_the_cell(namespace, to_move, device, target, result, note)
    if options.stream and target.type != "cuda" and note is not None:
        note(f"--stream: {device} runs the cell's work in program order, so there is no stream to order")
    scope = _CellScope(torch, target, shell, rewriter)
    timer = None
    try:
        scope.enter()
        timer = _started_timer(target) if options.time else None
        stream: Any = None
        streamed: SideStream | None = None
        if options.stream and target.type == "cuda":
            stream, streamed = _enter_side_stream(target, compiled, namespace)
        try:
            # Run here, not in a helper: each frame of ours would add to IPython's "skipping hidden" count.
            try:
                result.value = run_compiled(compiled, namespace)
            except BaseException as exc:
                exc.__traceback__ = _user_traceback(exc.__traceback__)
                _explain_cuda_error(exc, target, rewriter is not None)
                raise exc
            if streamed is not None:
                streamed.extra.append(result.value)
        finally:
            if streamed is not None:
                stream.__exit__(None, None, None)
                result.recorded = streamed.recorded
        result.ran = True
        _after_the_cell(torch, target, options, timer, result)
    finally:
        if timer is not None:
            timer.close()
        scope.exit()
        if dry_run is not None:
            dry_run.put_back()
        if rewriter is not None:
            _settle(namespace, compiled.tree, target, device, note)
    return result


def _compile(shell, cell: str, options: OnDeviceOptions, rewriter):
    """The cell compiled as IPython compiles it, through the placement rewrite where there is one."""
    try:
        return compile_cell(shell, cell, header=options.header,
                            transformers=[rewriter] if rewriter is not None else [])
    except SyntaxError as exc:
        # The error carries the user's file and line; the compiler's frames say nothing more.
        exc.__traceback__ = None
        raise exc


def _move_for_the_cell(namespace: dict, to_move: list, device: str, target, result: OnDeviceResult,
                       note) -> DryRunMoves | None:
    """``--move``: the named values moved to the device before the cell; on ``meta``, a dry run whose
    originals come back after it (a meta tensor holds no values)."""
    if not to_move:
        return None
    dry_run = DryRunMoves(namespace, to_move) if target.type == "meta" else None
    result.moved = apply_moves(namespace, to_move, device)
    said = move_note(result.moved, device)
    if dry_run is not None:
        dry_run.moved()
        said = f"{said} (for this cell: a dry run; they are put back after it)" if said else said
    if note is not None and said:
        note(said)
    return dry_run


def _started_timer(target):
    from .timing import CellTimer
    timer = CellTimer(target)
    timer.start()
    return timer


def _after_the_cell(torch, target, options: OnDeviceOptions, timer, result: OnDeviceResult) -> None:
    """``--time``'s figures, and ``--sync``'s wait for the device."""
    if timer is not None:
        result.timing = timer.stop()
    if options.sync:
        _synchronize(torch, target)


def _settle(namespace: dict, tree, target, device: str, note) -> None:
    """What the device values the cell bound meant in it, they hold after it (:func:`settle`)."""
    try:
        said = settle_note(settle(namespace, names_assigned(tree), target), device)
    except Exception:  # the cell's own outcome matters more than this tidying: logged
        logger.warning("could not settle the cell's device values", exc_info=True)
        return
    if note is not None and said:
        note(said)
