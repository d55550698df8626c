"""--time's bookkeeping of the streams a cell queues work on, checked without a GPU (fakes stand in for
torch.cuda streams; tests/test_magics_ondevice_gpu.py times real ones)."""
from __future__ import annotations

import torch

from gpumagic.cell.rewrite import cuda_calls as placement_cuda
from gpumagic.cell.rewrite.cuda_calls import HostStream, unwatch_streams, watch_streams
from gpumagic.cell.rewrite.helper import Placement
from gpumagic.ondevice.timing import CellTimer


class FakeStream:
    """A CUDA stream's ``device`` and ``wait_stream``, recording what it waited for."""

    def __init__(self, device="cuda:0", fails=False):
        self.device = torch.device(device)
        self.waited: list = []
        self.fails = fails

    def wait_stream(self, other):
        if self.fails:
            raise RuntimeError("cannot wait")
        self.waited.append(other)


def test_streams_the_cells_code_makes_or_makes_current_are_collected(no_cuda_init):
    placement = Placement("cuda:0")          # a torch.device only: CUDA does not start
    made, used, current = FakeStream(), FakeStream(), FakeStream()
    seen = watch_streams()
    try:
        assert placement.stream_new(lambda *a, **k: made) is made
        assert placement.stream_use(lambda s: ("context of", s), used) == ("context of", used)
        placement.stream_set(lambda s: None, current)
        placement.stream_use(lambda s: s, used)              # once each
        placement.stream_use(lambda s: s, None)              # torch.cuda.stream(None): no stream
        Placement(None).stream_use(lambda s: s, FakeStream())   # no target: not a cell's
    finally:
        unwatch_streams(seen)
    assert seen == [made, used, current]
    assert placement_cuda._watchers == []
    # Off a GPU there is no CUDA stream to collect.
    seen = watch_streams()
    try:
        stand_in = Placement("cpu").stream_new(lambda *a, **k: None)
    finally:
        unwatch_streams(seen)
    assert isinstance(stand_in, HostStream) and seen == []


def test_the_end_event_waits_for_the_cells_streams(no_cuda_init, caplog):
    timer = CellTimer("cuda:0")
    side, other_gpu, broken = FakeStream(), FakeStream("cuda:1"), FakeStream()
    cell_stream = FakeStream()
    cell_stream.wait_stream = lambda s: FakeStream(fails=s is broken).wait_stream(s) or cell_stream.waited.append(s)
    timer._streams = watch_streams()
    timer._streams += [side, cell_stream, other_gpu, broken]
    assert timer._join(cell_stream) == 1       # the side stream; itself, cuda:1's and the broken one left out
    assert cell_stream.waited == [side]
    assert "could not order" in caplog.text    # the failure is said, not swallowed
    assert placement_cuda._watchers == [] and timer._streams is None


def test_a_failed_cell_stops_collecting(shell):
    timer = CellTimer("cuda:0")
    timer._streams = watch_streams()
    timer.close()
    timer.close()
    assert placement_cuda._watchers == []


def test_a_cell_that_made_no_stream_leaves_no_collector(no_cuda_init):
    # Most --time cells make no stream of their own: their empty list must go too, or every later
    # stream is collected into it for the rest of the session.
    timer = CellTimer("cuda:0")
    timer._streams = watch_streams()
    assert timer._join(FakeStream()) == 0
    assert placement_cuda._watchers == [] and timer._streams is None
    assert timer._join(FakeStream()) == 0       # joined once already: nothing to do
