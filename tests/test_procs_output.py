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
