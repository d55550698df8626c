"""What %%sharedtrain shows (gpumagic.sharedtrain.display) and what it keeps (gpumagic.sharedtrain.results)."""
from __future__ import annotations

import base64
import re
import xml.etree.ElementTree as ET

import torch

from gpumagic.sharedtrain.results import History, SharedTrainResult, WorkerStats


def test_history_and_summary_rendering():
    from gpumagic.sharedtrain.display import render_summary, sparkline
    history = History(2)
    history.extend(0, [{"step": 1, "time": 0.1, "loss": 2.0}, {"step": 2, "time": 0.3, "loss": 1.0}])
    history.extend(1, [{"step": 1, "time": 0.2, "loss": 3.0, "acc": 0.5}])
    assert history.keys() == ["loss", "acc"]
    assert history.series("loss") == [[(1, 2.0), (2, 1.0)], [(1, 3.0)]]
    assert history.last("acc") == [None, 0.5]
    assert [r["rank"] for r in history.rows()] == [0, 1, 0]
    assert repr(history) == "History(2 workers; reports per rank: 2, 1; keys: loss, acc)"
    assert sparkline([3.0, 2.0, 1.0]) == "█▅▁"
    assert sparkline([1.0] * 100, width=10) == "▁" * 10
    stats = [WorkerStats(rank=r, pid=100 + r, steps=2, samples=64, first_step=0.1, last_time=0.5,
                                 last={"loss": 1.0}, state="done") for r in range(2)]
    result = SharedTrainResult(modules={"net": torch.nn.Linear(1, 1)}, nprocs=2, start_method="fork",
                                       start_reason="safe", device="cpu", seed=0,
                                       sharing_strategy="file_descriptor", history=history, workers=stats,
                                       seconds=0.6, status="done", notes=["a note"])
    view = render_summary(result)
    assert "2 workers (fork) on cpu trained 'net': 4 steps, 128 samples in 0.6 s; 320 samples/s" in view.text
    assert "loss rank 0: ▅▁  2 -> 1" in view.text and "loss rank 1: █  3 -> 3" in view.text and "  a note" in view.text
    svg = plot_svg(view.html_text)
    assert svg.startswith("<svg xmlns='http://www.w3.org/2000/svg'") and svg.count("<polyline") == 2
    assert "<svg" not in view.html_text  # an image, which a stored (untrusted) notebook still shows
    tree = ET.fromstring(svg)  # an image must be well-formed XML, or the browser shows nothing
    assert len(tree.findall("{http://www.w3.org/2000/svg}polyline")) == 2


def plot_svg(html_text: str) -> str:
    """The loss plot's SVG, from the data: URL of its <img>."""
    found = re.search(r"<img src='data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)'", html_text)
    assert found, html_text[-500:]
    return base64.b64decode(found.group(1)).decode()


def test_a_stopped_run_says_which_side_failed(capsys):
    from types import SimpleNamespace

    from gpumagic.errors import WorkerError
    from gpumagic.sharedtrain.display import Progress
    result = SharedTrainResult(modules={}, nprocs=2, start_method="fork", start_reason="", device="cpu", seed=0,
                               sharing_strategy="file_descriptor", history=History(2),
                               workers=[WorkerStats(rank=0), WorkerStats(rank=1)])
    progress = Progress(SimpleNamespace())
    for exc, says in ((WorkerError(1, 42, "ValueError", "bad"), "(rank 1 failed)"),
                      (KeyboardInterrupt(), "(interrupted)"),
                      (RuntimeError("loading failed"), "(RuntimeError in the kernel)")):
        progress.stopped(result, exc)
        assert says in capsys.readouterr().err


def _result_of(modules: dict) -> SharedTrainResult:
    stats = [WorkerStats(rank=r, steps=2, samples=64, state="done") for r in range(2)]
    return SharedTrainResult(modules=modules, nprocs=2, start_method="fork", start_reason="safe", device="cpu",
                             seed=0, sharing_strategy="file_descriptor", history=History(2), workers=stats,
                             seconds=0.5, status="done")


def test_the_headline_names_every_trained_module():
    # With nets = {"a": ..., "b": ...} the headline said only: trained "nets['a']".
    from gpumagic.sharedtrain.display import render_summary
    two = _result_of({"nets['a']": torch.nn.Linear(1, 1), "loss_fn": torch.nn.CrossEntropyLoss(),
                      "nets['b']": torch.nn.Linear(1, 1)})
    assert two.trained_names == ["nets['a']", "nets['b']"]   # a loss function trains nothing
    assert "2 workers (fork) on cpu trained \"nets['a']\" and \"nets['b']\": 4 steps, 128 samples in 0.5 s" \
        in render_summary(two).text
    many = _result_of({f"layers[{i}]": torch.nn.Linear(1, 1) for i in range(7)})
    assert "on cpu trained 'layers[0]', 'layers[1]', 'layers[2]' and 4 more: 4 steps" in render_summary(many).text
    three = _result_of({name: torch.nn.Linear(1, 1) for name in ("g", "d", "e")})
    assert "trained 'g', 'd' and 'e': 4 steps" in render_summary(three).text
    assert "trained 'loss_fn': 4 steps" in render_summary(_result_of({"loss_fn": torch.nn.MSELoss()})).text
