"""Steps and samples per rank while a %%dataparallel cell runs (gpumagic.dataparallel.progress)."""
from __future__ import annotations


def test_progress_prints_per_rank_lines_in_a_terminal():
    import io

    from gpumagic.dataparallel.progress import Progress
    out = io.StringIO()
    progress = Progress(["cpu", "cpu"], shell=None, after=0.0, every=10.0, stream=out)
    progress.update(0, {"steps": 10, "samples": 160, "seconds": 2.0})
    progress.update(1, {"steps": 10, "samples": 160, "seconds": 2.0})
    progress.tick()
    progress.tick()                                 # not again before `every` seconds
    assert out.getvalue().count("\n") == 1
    assert "rank 0: 10 steps, 80 samples/s" in out.getvalue() and "rank 1: 10 steps" in out.getvalue()
    assert "80" in progress.render().text and "<table>" in progress.render().html_text
