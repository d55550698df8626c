"""How long ``%gpumem --who`` and ``%gpumem --reclaim`` take, in the scene of their floors.

The scene (``tests/sharing_helpers.floors``): two kernels under a real Jupyter
server whose notebooks hold 10 and 20 GiB, an orphaned gpumagic worker holding
5 GiB, a process of another user (``nobody``) holding 1 GiB. With a GPU they
hold that memory for real (needs root and jupyter_server); without one, the
same processes run and a fake NVML lists them with those figures (what is
timed is then the naming: psutil, worker marks, the Jupyter server's answers).

Measures: ``who()`` the first time (the server asked), its median over
``--repeat`` calls (asked each time), with the server's answers reused (as the
gauges do), and one ``reclaim()``: seconds until NVML no longer lists the
orphan, and the memory freed. Prints a table and appends it to
``benchmarks/RESULTS.md``. Run from the repository root::

    python benchmarks/who.py
    python benchmarks/who.py --repeat 50 --no-record
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from _common import append_results, command, machine  # also puts the checkout on sys.path

from gpumagic import devices
from gpumagic.devices import jupyter_servers, nvml
from gpumagic.devices.gpu_processes import who
from gpumagic.display import fmt_bytes, text_table
from gpumagic.memory.reclaim import reclaim
from gpumagic.procs import marks

GiB = 2**30


def seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fake_machine(scene):
    """Without a GPU: the fake NVML, listing the scene's real processes with the floors' figures."""
    from tests.fake_nvml import LiveNvml, gpu
    processes = [(pid, gib * GiB) for _, pid, gib in scene.kernels.values()]
    processes += [(scene.orphan, 5 * GiB), (scene.other, GiB)]
    fake = LiveNvml([gpu("GPU-fake0000", "00000000:18:00.0", name="fake H100", total=80 * GiB, used=GiB,
                         processes=processes)])
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    nvml.use(fake)


def measure(scene, repeat: int, real: bool) -> list[list[str]]:
    jupyter_servers.forget()
    t0 = time.perf_counter()
    report = who()
    first = time.perf_counter() - t0
    named = sum(len(row.processes) for row in report.devices)
    kinds = ", ".join(f"{k} {fmt_bytes(b)}" for k, b in sorted(report.by_kind().items()))
    rows = [["who(): first call (Jupyter server asked)", f"{first:.3f} s", f"{named} processes: {kinds}"],
            ["who(): median, server asked each time", f"{seconds(who, repeat):.3f} s", f"{repeat} calls"],
            ["who(): median, server's answers reused (the gauges)",
             f"{seconds(lambda: who(max_age=60), repeat):.3f} s", f"{repeat} calls"]]
    for row in report.devices if real else ():   # (a fake NVML's used memory is whatever it was told)
        if row.processes and row.used:
            rows.append([f"{row.device}: listed / NVML used", f"{100 * row.listed / row.used:.2f} %",
                         f"{fmt_bytes(row.listed)} of {fmt_bytes(row.used)}"])
    t0 = time.perf_counter()
    ended = reclaim()
    took = time.perf_counter() - t0
    outcome = "; ".join(f"pid {e.pid}: {e.outcome}" for e in ended.ended)
    rows.append(["reclaim(): orphans ended, NVML settled", f"{took:.3f} s",
                 f"freed {fmt_bytes(ended.freed)}; {outcome}"])
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20, help="timed who() calls per row (median reported)")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args(argv)
    from tests.sharing_helpers import Started, floors
    gpus = devices.visible_gpus()
    started = Started()
    scene_note = "real GPU memory" if gpus else "fake NVML listing real processes"
    with tempfile.TemporaryDirectory(prefix="gpumagic-who-") as home:
        os.environ[marks.DIR_ENV] = os.path.join(home, "marks")
        try:
            scene = floors(started, Path(home), on_gpu=bool(gpus))
            if not gpus:
                fake_machine(scene)
            rows = measure(scene, args.repeat, real=bool(gpus))
        finally:
            started.end_all()
    header = ["measurement", "value", "detail"]
    print(text_table(rows, header))
    if not args.no_record:
        append_results("who.py", [f"- machine: {machine(gpus)}", f"- command: `{command('who.py', argv)}`; "
                                                               f"{scene_note}"], [(header, rows)])


if __name__ == "__main__":
    main()
