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


class _Counting:
    """Stands for output's line-end pattern, counting the characters it is asked to scan."""

    def __init__(self, pattern):
        self.pattern, self.scanned = pattern, 0

    def __getattr__(self, name):
        method = getattr(self.pattern, name)

        def counted(text, *args, **kwargs):
            self.scanned += len(text)
            return method(text, *args, **kwargs)
        return counted


def test_prefixed_output_costs_what_is_written_not_its_square(monkeypatch):
    # 20,000 progress dots on one unfinished line, then a 2 MB line in 64 KiB pieces: each character
    # is looked at a bounded number of times, not once for every later write
    from gpumagic.procs import output as outmod
    counting = _Counting(outmod._LINE_ENDS)
    monkeypatch.setattr(outmod, "_LINE_ENDS", counting)
    output = RankOutput(prefix=True)
    piece = "x" * 65536
    with capture_output() as cap:
        for _ in range(20000):
            output.write(0, "stdout", ".")
        output.write(0, "stdout", "\n")
        for _ in range(32):
            output.write(1, "stderr", piece)
        output.write(1, "stderr", "\n")
        output.flush()
    written = 20001 + 32 * len(piece) + 1
    assert cap.stdout == "[rank 0] " + "." * 20000 + "\n"
    assert cap.stderr == "[rank 1] " + piece * 32 + "\n"
    assert counting.scanned <= 3 * written, counting.scanned


def test_a_long_redrawn_line_is_not_shown_again_on_every_write():
    # a bar that redraws after "\r" and then grows without end: what reaches the cell stays linear in
    # what the worker wrote (a short redraw still shows at once)
    output = RankOutput(prefix=True)
    with capture_output() as cap:
        output.write(0, "stdout", "\rstep 1")
        shown_at_once = cap.stdout
        for _ in range(20000):
            output.write(0, "stdout", ".")
        output.write(0, "stdout", "\n")
        output.flush()
    assert shown_at_once == "[rank 0] step 1\r"
    assert cap.stdout.endswith("[rank 0] step 1" + "." * 20000 + "\n")
    assert len(cap.stdout) <= 4 * (20000 + 20000 // 4), len(cap.stdout)
