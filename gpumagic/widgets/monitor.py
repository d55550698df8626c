"""The one background thread that feeds every memory gauge of the kernel.

A :class:`Monitor` reads memory every ``interval`` seconds (default 0.25 s,
so at most 4 updates a second) through NVML and psutil only: it never
imports torch nor initialises CUDA, so watching memory creates no CUDA
context. Torch's allocator figures are added for devices where the user has
already initialised CUDA. Gauges send nothing when their displayed value has
not changed.

The same thread keeps each device's last minutes (:mod:`.history`: memory at
every tick, utilisation every 2.5 s) and redraws a gauge's history
line (:mod:`.sparkline`) only when it changes as drawn, so a tick sends each
widget at most one message. Every :data:`SPLIT_EVERY` seconds, far slower than
the ticks, it also names who holds each GPU (``%gpumem --who``'s naming) on the
gauge: that reading costs milliseconds, a tick microseconds.

Only one monitor runs per kernel: :func:`start` replaces the running one (its
thread is stopped and its gauges closed), :func:`stop` ends it, and
``%unload_ext gpumagic`` stops it through :func:`gpumagic.session.register_closer`.
Stopping waits at most :data:`STOP_TIMEOUT` seconds: a reading that never returns
(a wedged driver) leaves its daemon thread behind, with a logged warning, instead
of hanging the kernel. The first reading is the thread's too: :meth:`Monitor.start`
waits for it at most :data:`gpumagic.devices.nvml.READ_TIMEOUT` seconds, then
leaves the gauges it did not reach n/a and says why in ``stalled``.
"""
from __future__ import annotations

import logging
import threading
import time

from ipywidgets import VBox

from .. import session
from ..devices import memory, nvml, utilization
from ..display import fmt_bytes
from .closing import close_tree
from .gauge import MemoryGauge
from .history import History
from .sparkline import sparkline

logger = logging.getLogger(__name__)

__all__ = ["Monitor", "start", "stop", "restart", "current", "THREAD_NAME", "DEFAULT_INTERVAL", "STOP_TIMEOUT",
           "SPLIT_EVERY", "GaugeBox"]

THREAD_NAME = "gpumagic-memory-monitor"
DEFAULT_INTERVAL = 0.25
# A reading takes microseconds; one still running after this is hung (a wedged driver) and is
# left behind rather than hang %gpumem --stop or %unload_ext.
STOP_TIMEOUT = 2.0
SPLIT_EVERY = 10.0    # seconds between namings of who holds each GPU (milliseconds each: psutil, Jupyter servers)
SPLIT_TIMEOUT = 0.5   # seconds the Jupyter servers have to answer then (their answers are kept SPLIT_MAX_AGE s)
SPLIT_MAX_AGE = 30.0
_CLOSER = "gpumem-monitor"

_lock = threading.RLock()
_current: Monitor | None = None


def _detail(mem: memory.DeviceMemory) -> str:
    """The words after used/total on a gauge: this kernel's share, then torch's figures."""
    bits = []
    if mem.process is not None:
        bits.append(f"kernel {fmt_bytes(mem.process)}")
    elif mem.process_note and mem.process_note != "not read":
        bits.append(f"kernel n/a ({mem.process_note})")
    if mem.allocated is not None:
        bits.append(f"torch {fmt_bytes(mem.allocated)} alloc / {fmt_bytes(mem.reserved)} reserved")
    return " · ".join(bits)


class GaugeBox(VBox):
    """The displayed column of gauges; its text form is one text gauge per line."""

    def __repr__(self):
        return "\n".join(repr(child) for child in self.children)

    def close(self):
        """Close the box, its gauges and every layout and style they made."""
        close_tree(self)


class Monitor:
    """Gauges for ``targets`` (``"cpu"``, ``"mps"`` or :class:`gpumagic.devices.Gpu`) and their thread.

    ``start()``, ``stop()`` and ``restart()`` may be called any number of
    times. ``box`` is the widget to display; ``gauges`` maps device names to
    :class:`~gpumagic.widgets.gauge.MemoryGauge`. ``ticks`` counts readings,
    ``errors`` keeps the last few reading errors (the thread never dies of one).
    ``stalled`` is the note when the first reading did not return in time.
    ``histories`` maps device names to their :class:`~gpumagic.widgets.history.History`;
    ``splits`` counts the namings of who holds the GPUs (every ``split_every`` seconds; 0: never).
    """

    def __init__(self, targets: list, interval: float = DEFAULT_INTERVAL, processes: bool = True,
                 split_every: float = SPLIT_EVERY):
        _check_interval(interval)
        self.targets = list(targets)
        self.interval = float(interval)
        self.processes = processes
        self.split_every = float(split_every)
        self.gauges: dict[str, MemoryGauge] = {}
        self.histories: dict[str, History] = {}
        self._busy: dict[str, tuple] = {}   # device -> (its utilisation reader, when it was last read)
        for target in self.targets:
            name = "CPU (machine)" if target == "cpu" else "Apple MPS" if target == "mps" else target.name
            device = target if isinstance(target, str) else target.device
            self.gauges[device] = MemoryGauge(device, name)
            self.histories[device] = History()
            self._busy[device] = (utilization.reader(target), float("-inf"))
        self.splits = 0
        self._next_split = 0.0
        self.clock = time.monotonic   # what the history lines are timed by
        self.box = GaugeBox(list(self.gauges.values()))
        self.ticks = 0
        self.errors: list[str] = []
        self.closed = False
        self.stalled: str | None = None
        self._first: threading.Event | None = None   # set once the thread's first reading returned
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._tick_lock = threading.Lock()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def tick(self) -> int:
        """Read every device once and update its gauge; returns how many gauges changed."""
        changed = 0
        with self._tick_lock:
            if self.closed:
                return 0
            for target, gauge in zip(self.targets, self.gauges.values()):
                try:
                    mem = memory.device_memory(target, processes=self.processes)
                except Exception as exc:  # a lost GPU must not kill the monitor
                    if self.closed:   # a hung reading that failed after stop(): its gauges are closed
                        return changed
                    error = f"{gauge.device}: {exc}"
                    if error not in self.errors:  # once, not at every tick while it keeps failing
                        logger.debug("reading %s failed; its gauge shows n/a", gauge.device, exc_info=True)
                    self.errors = (self.errors + [error])[-10:]
                    changed += gauge.show(None, None, "n/a: reading failed")
                    continue
                if self.closed:  # stopped while this reading hung: its gauges are no longer ours to update
                    return changed
                changed += gauge.show(mem.used, mem.total, _detail(mem))
                self._record(gauge, mem.fraction)
            self.ticks += 1
        return changed

    def _record(self, gauge: MemoryGauge, fraction: float | None) -> None:
        """Add this tick's memory (and, every :data:`.utilization.EVERY` s, utilisation) to the device's
        history; redraw its line only where it changed as drawn."""
        now = self.clock()
        history = self.histories[gauge.device]
        read, last = self._busy[gauge.device]
        busy = None
        if now - last >= utilization.EVERY:
            self._busy[gauge.device] = (read, now)
            try:
                busy = read()
            except Exception:  # the line goes on with memory alone
                logger.debug("reading %s's utilisation failed", gauge.device, exc_info=True)
        if history.add(now, fraction, busy):
            memory_line, busy_line = history.series(now)
            peak = history.peak()
            title = (f"{gauge.device}, last {history.window / 60:g} min: memory (blue)"
                     + (f", peak {100 * peak:.0f}%" if peak is not None else "") + "; utilisation (orange)")
            gauge.show_history(sparkline(memory_line, busy_line, title=title))

    def refresh_split(self) -> int:
        """Name who holds each GPU (``%gpumem --who``) on its gauge; returns how many gauges changed."""
        from ..devices.gpu_processes import who
        self._next_split = time.monotonic() + self.split_every
        gpus = [t for t in self.targets if not isinstance(t, str)]
        if not gpus:
            return 0
        try:
            # In this thread: it is the bounded reading already (a hung driver stalls it, not the kernel).
            report = who(gpus=gpus, timeout=SPLIT_TIMEOUT, max_age=SPLIT_MAX_AGE, in_thread=False)
        except Exception:  # the gauges go on without it
            logger.debug("naming the GPUs' processes failed; the gauges show no split", exc_info=True)
            return 0
        changed = 0
        with self._tick_lock:
            if self.closed:
                return 0
            for row in report.devices:
                changed += self.gauges[row.device].show_split(row.holders())
            self.splits += 1
        return changed

    def _run(self, first: threading.Event) -> None:
        try:
            self.tick()   # the gauges show figures before the first interval passes
        finally:
            first.set()
        self._split_due()
        # Waiting on the event, not sleeping, makes stop() take effect at once.
        while not self._stop.wait(self.interval):
            self.tick()
            self._split_due()

    def _split_due(self) -> None:
        if self.split_every > 0 and time.monotonic() >= self._next_split and not self._stop.is_set():
            self.refresh_split()

    def start(self) -> Monitor:
        """Start the thread; returns once its first reading is shown, or after
        :data:`~gpumagic.devices.nvml.READ_TIMEOUT` seconds where it hangs (``stalled`` says so)."""
        if self.closed:
            raise RuntimeError("this monitor was closed; start a new one with gpumagic.widgets.monitor.start")
        if self.running:
            return self
        self._stop.clear()
        first = self._first = threading.Event()
        since = time.monotonic()
        # The first reading runs in the thread too: a wedged driver must not hang the kernel's thread.
        self._thread = threading.Thread(target=self._run, args=(first,), name=THREAD_NAME, daemon=True)
        self._thread.start()
        timeout = nvml.READ_TIMEOUT
        if first.wait(timeout):
            self.stalled = None
            return self
        self.stalled = nvml.timeout_note(timeout)
        # No new NVML reading starts until this one returns: later gauges or %gpuinfo would hang on it too.
        nvml.left_stuck(first, since, "the memory gauges' first reading")
        for gauge in self.gauges.values():
            if not gauge.sends:   # not reached yet; the thread updates it if the reading returns at last
                gauge.show(None, None, f"the driver did not answer in {timeout:g} s")
        return self

    def stop(self, close: bool = True, timeout: float | None = None) -> bool:
        """Stop the thread, waiting at most ``timeout`` s (default :data:`STOP_TIMEOUT`); ``close`` also
        closes the widgets.

        Returns False when the thread is still inside a reading after that (a hung
        NVML call): it is a daemon thread, so it is left behind with a logged
        warning, and the widgets are closed without waiting for it.
        """
        self._stop.set()
        thread = self._thread
        timeout = STOP_TIMEOUT if timeout is None else timeout
        if self._first is not None and not self._first.is_set():
            timeout = 0   # its first reading is known to hang: waiting again would only stall the kernel
        stopped = True
        if thread is not None and thread is not threading.current_thread():
            # The stop event wakes the thread at once: waiting on a tick, not on the interval
            # (4 * a long interval overflows join's timeout).
            thread.join(timeout=timeout)
            stopped = not thread.is_alive()
        self._thread = None
        if not stopped:
            logger.warning("gpumagic's memory monitor did not stop within %.1f s: a reading of %s has not "
                           "returned (NVML hangs: a wedged GPU driver?). Its daemon thread is left behind and "
                           "updates nothing more%s.", timeout, ", ".join(self.gauges) or "no device",
                           "; the gauges are closed" if close else "")
        if close and not self.closed:
            # A hung tick holds the lock for good: close without it (the tick checks `closed`).
            locked = self._tick_lock.acquire(timeout=timeout if stopped else 0)
            try:
                self.closed = True
                self.box.close()  # the gauges too, with their layouts and styles
            finally:
                if locked:
                    self._tick_lock.release()
        return stopped

    def restart(self, interval: float | None = None) -> Monitor:
        """Restart the thread, optionally with a new interval; the gauges stay.

        Where the old thread is stuck in a reading, the gauges are closed and
        ``RuntimeError`` says so: a new thread would wait on the same reading.
        """
        if interval is not None:
            _check_interval(interval)
            self.interval = float(interval)
        if not self.stop(close=False):
            self.stop(close=True, timeout=0)
            raise RuntimeError("the memory monitor's thread is stuck in a reading (NVML hangs: a wedged GPU "
                               "driver?); its gauges were closed")
        return self.start()

    def text(self) -> str:
        return "\n".join(g.text_line() for g in self.gauges.values())

    def _repr_pretty_(self, p, cycle):
        p.text(self.text())


def _check_interval(interval: float) -> None:
    # Event.wait raises OverflowError past threading.TIMEOUT_MAX: the thread would die at its first wait.
    if not 0 < interval <= threading.TIMEOUT_MAX:
        raise ValueError(f"interval must be positive seconds up to {threading.TIMEOUT_MAX:.0f}, not {interval!r}")


def current() -> Monitor | None:
    """The kernel's running monitor, if any."""
    return _current


def start(targets: list, interval: float = DEFAULT_INTERVAL, processes: bool = True,
          split_every: float = SPLIT_EVERY) -> Monitor:
    """Replace any running monitor with one for ``targets``; returns it, started.

    In a notebook (what ``%gpumem --watch`` does)::

        from gpumagic.widgets import monitor
        m = monitor.start(["cpu"], interval=0.5)
        m.box                  # display the gauges
        monitor.stop()         # stops the thread and closes the gauges
    """
    global _current
    with _lock:
        stop()
        mon = Monitor(targets, interval, processes, split_every)
        mon.start()
        _current = mon
        session.register_closer(_CLOSER, stop)
        return mon


def stop() -> bool:
    """Stop the running monitor and close its gauges; False when none was running."""
    global _current
    with _lock:
        mon, _current = _current, None
        session.unregister_closer(_CLOSER)
    if mon is None:
        return False
    mon.stop(close=True)
    return True


def restart(interval: float | None = None) -> Monitor | None:
    """Restart the running monitor's thread (new ``interval`` if given); None when none runs."""
    with _lock:
        mon = _current
        if mon is None:
            return None
        try:
            return mon.restart(interval)
        except RuntimeError:
            stop()   # its gauges are closed: no monitor runs now
            raise
