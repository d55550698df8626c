"""Steps and samples per rank while a %%dataparallel cell runs (gpumagic.dataparallel.kernel.progress)."""
from __future__ import annotations

import pytest

from gpumagic.dataparallel.protocol import RankStats


def test_progress_prints_per_rank_lines_in_a_terminal():
    import io

    from gpumagic.dataparallel.kernel.progress import Progress
    out = io.StringIO()
    progress = Progress(["cpu", "cpu"], shell=None, after=0.0, every=10.0, stream=out)
    progress.update(0, RankStats(steps=10, samples=160, seconds=2.0))
    progress.update(1, RankStats(steps=10, samples=160, seconds=2.0))
    progress.tick()
    progress.tick()                                 # not again before `every` seconds
    assert out.getvalue().count("\n") == 1
    assert "rank 0: 10 steps, 80 samples/s" in out.getvalue() and "rank 1: 10 steps" in out.getvalue()
    assert "80" in progress.render().text and "<table>" in progress.render().html_text


@pytest.fixture
def fake_gpus(monkeypatch):
    from tests.fake_nvml import busy_four_gpu_machine, installed
    yield from installed(busy_four_gpu_machine(), monkeypatch)


def test_ranks_on_gpus_show_their_gpus_load_from_nvml_without_cuda(fake_gpus, no_cuda_init):
    import io

    from gpumagic.dataparallel.kernel.progress import Progress
    from tests.fake_nvml import GiB
    fake_gpus.gpus[2]["used"] = 40 * GiB
    out = io.StringIO()
    progress = Progress(["cuda:2", "cuda:3"], shell=None, after=0.0, stream=out)
    progress.update(0, RankStats(steps=10, samples=160, seconds=2.0))
    progress.update(1, RankStats(steps=10, samples=160, seconds=2.0))
    rendered = progress.render()
    assert progress.header[-2:] == ["GPU util", "GPU memory"]
    assert "37%" in rendered.text and "40.0 GiB / 141.0 GiB" in rendered.text and "GPU memory" in rendered.html_text
    rows = progress.rows()
    # cuda:3 does not report utilisation: a dash, not a made-up number.
    assert [r[-2] for r in rows] == ["37%", "-"] and rows[1][-1] == "1.0 GiB / 141.0 GiB"
    progress.tick()
    assert "rank 0: 10 steps, 80 samples/s, GPU 37%" in out.getvalue()


def test_ranks_on_the_cpu_show_no_gpu_columns():
    from gpumagic.dataparallel.kernel.progress import Progress
    progress = Progress(["cpu", "cpu"], shell=None)
    progress.update(0, RankStats(steps=1, samples=2, seconds=1.0))
    assert progress.header == Progress.HEADER and len(progress.rows()[0]) == len(Progress.HEADER)


def test_samples_not_counted_in_launch_mode_show_as_a_dash_not_zero():
    import io

    from gpumagic.dataparallel.kernel.progress import Progress
    out = io.StringIO()
    progress = Progress(["cpu", "cpu"], shell=None, after=0.0, every=10.0, stream=out)
    for rank in (0, 1):   # launch mode: the framework reads the data, gpumagic counts steps only
        progress.update(rank, RankStats(steps=12, samples=None, seconds=3.0))
    progress.tick()
    assert progress.rows()[0][2:6] == ["12", "4.0", "-", "-"]
    assert "rank 0: 12 steps, 4.0 steps/s" in out.getvalue() and "samples/s" not in out.getvalue()
