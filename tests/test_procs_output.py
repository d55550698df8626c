"""Workers' output in the cell (gpumagic.procs.output): as it came, or line by line with [rank N]."""
from __future__ import annotations

from IPython.utils.capture import capture_output

from gpumagic.procs.output import RankOutput


def test_prefixed_output_completes_lines_per_rank_and_stream():
    calls = []
    output = RankOutput(prefix=True, before_write=lambda: calls.append(1))
    with capture_output() as cap:
        output.write(0, "stdout", "epoch 1 lo")
        output.write(1, "stdout", "epoch 1 loss 0.5\nepoch 2")
        output.write(0, "stdout", "ss 0.7\n")
        output.write(1, "stderr", "warning\n")
        output.flush()
    assert cap.stdout == "[rank 1] epoch 1 loss 0.5\n[rank 0] epoch 1 loss 0.7\n[rank 1] epoch 2\n"
    assert cap.stderr == "[rank 1] warning\n"
    assert len(calls) == 4


def test_unprefixed_output_streams_as_it_comes():
    output = RankOutput(prefix=False)
    with capture_output() as cap:
        output.write(0, "stdout", "\r10%")
        output.write(0, "stdout", "\r20%")
        output.flush()
    assert cap.stdout == "\r10%\r20%"


def test_prefixed_progress_bars_redraw_as_they_come():
    # tqdm writes "\r" then the bar at each update and "\n" when it closes: each update shows at
    # once, prefixed, so the frontend's "\r" handling replaces the previous one.
    output = RankOutput(prefix=True)
    with capture_output() as cap:
        output.write(0, "stderr", "\r  0%|          | 0/4")
        first = cap.stderr
        output.write(1, "stderr", "\r 50%|#####")
        output.write(1, "stderr", "     | 2/4")
        output.write(0, "stderr", "\r100%|##########| 4/4")
        output.write(0, "stderr", "\n")
        output.write(1, "stdout", "done\r")
        output.write(1, "stdout", "\n")
        output.flush()
    assert first == "[rank 0]   0%|          | 0/4\r"
    assert cap.stderr == (
        "[rank 0]   0%|          | 0/4\r"
        "[rank 1]  50%|#####\r"
        "[rank 1]  50%|#####     | 2/4\r"
        "[rank 0] 100%|##########| 4/4\r"
        "[rank 0] 100%|##########| 4/4\n"
        "[rank 1]  50%|#####     | 2/4\n"     # rank 1's bar, never closed, ends its line at the flush
    )
    # "\r\n" split over two writes is one line end, not a redraw followed by an empty line.
    assert cap.stdout == "[rank 1] done\n"
