"""The magics' arguments (gpumagic.magics.args): devices copied from Python with their quotes."""
from __future__ import annotations

import re

import pytest
import torch

from gpumagic.devices import visible_gpus
from gpumagic.errors import UsageError
from gpumagic.magics.args import parse, split
from tests.conftest import run_cell

HAS_GPU = bool(visible_gpus())   # through NVML: asking never initialises CUDA
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def outcome(shell, src):
    result, out, _ = run_cell(shell, src)
    return result.error_in_exec or result.error_before_exec, ANSI.sub("", out)


@pytest.mark.parametrize("line, device", [('"cpu"', "cpu"), ("'cpu'", "cpu"), ("'meta' --time", "meta"),
                                          ('"meta" --move "x"', "meta")])
def test_ondevice_takes_a_quoted_device(shell, line, device):
    shell.user_ns.update(torch=torch, x=torch.arange(3.))
    err, out = outcome(shell, f"%%ondevice {line}\ny = torch.ones(2).cuda()\nz = x.cuda()\n")
    assert err is None, out
    assert shell.user_ns["y"].device.type == device and shell.user_ns["z"].device.type == device
    if device == "cpu":
        assert shell.user_ns["y"].tolist() == [1.0, 1.0]


def test_ondevice_quoted_device_from_a_python_value(shell):
    # {dev!r} is how a device held in Python reaches the line: IPython expands it before the magic sees it.
    shell.user_ns.update(torch=torch, dev="cpu")
    err, out = outcome(shell, "%%ondevice {dev!r}\ny = torch.zeros(1).cuda()\n")
    assert err is None, out
    assert shell.user_ns["y"].device.type == "cpu"


@pytest.mark.skipif(HAS_GPU, reason="on a GPU machine cuda:1 may exist")
def test_ondevice_quoted_cuda_device_is_judged_unquoted(shell):
    err, _ = outcome(shell, "%%ondevice \"cuda:1\"\ny = 1\n")
    assert type(err) is UsageError
    assert str(err).startswith("device 'cuda:1' needs a GPU") and "valid choices: cpu, meta" in str(err)
    assert "y" not in shell.user_ns


@pytest.mark.parametrize("line", ['"tpu"', "'tpu'"])
def test_ondevice_bad_quoted_device_names_the_valid_ones(shell, line):
    err, _ = outcome(shell, f"%%ondevice {line}\ny = 1\n")
    assert type(err) is UsageError
    assert str(err) == "unknown device 'tpu'; valid choices: cpu, meta" or (HAS_GPU and "cuda:0" in str(err))
    assert "y" not in shell.user_ns


def test_an_open_quote_is_a_usage_error(shell):
    err, _ = outcome(shell, "%%ondevice \"cpu\ny = 1\n")
    assert type(err) is UsageError
    assert str(err).startswith("No closing quotation in '\"cpu'; usage: %%ondevice [--stream]")
    assert "y" not in shell.user_ns


def test_gpuinfo_and_gpumem_take_a_quoted_device(shell):
    info = shell.run_line_magic("gpuinfo", '"cpu" --json')
    assert [d["device"] for d in info["devices"]] == ["cpu"]
    held = shell.run_line_magic("gpumem", "'cpu' --json")
    assert list(held["devices"]) == ["cpu"] and held["devices"]["cpu"]["device"] == "cpu"
    with pytest.raises(UsageError, match=r"^unknown device 'tpu'; valid choices: cpu"):
        shell.run_line_magic("gpuinfo", "'tpu'")
    with pytest.raises(UsageError, match=r"^unknown device 'tpu'; valid choices: cpu"):
        shell.run_line_magic("gpumem", '"tpu"')


def test_training_magics_get_their_values_unquoted(shell):
    registry = shell.magics_manager.registry
    dataparallel = registry["DataParallelMagics"].dataparallel
    args = parse(dataparallel, "--devices \"cpu,cpu\" --strategy 'dp' --model='net' -n 2")
    assert (args.devices, args.strategy, args.model, args.nprocs) == ("cpu,cpu", "dp", "net", 2)
    assert parse(dataparallel, "--devices 'cuda:0','cuda:1'").devices == "cuda:0,cuda:1"
    choices = r"argument --strategy: invalid choice: 'tp' \(choose from 'ddp', 'fsdp', 'dp'\); usage: %dataparallel"
    with pytest.raises(UsageError, match=choices):
        parse(dataparallel, "--strategy 'tp'")
    sharedtrain = registry["SharedTrainMagics"].sharedtrain
    assert parse(sharedtrain, "--device 'cpu' --model \"net\"").device == "cpu"


@pytest.mark.parametrize("line, expected", [
    ("'cuda:1' --time", ["cuda:1", "--time"]), ('"cpu"', ["cpu"]), ("cpu", ["cpu"]),
    ("--devices='0,1'", ["--devices=0,1"]), ("--devices '0','1'", ["--devices", "0,1"]), ("''", [""]),
    ('--cluster "C:\\my dir\\f.json"', ["--cluster", "C:\\my dir\\f.json"]), ("a#b", ["a#b"]), ("", []),
    ("cpu  # the cell's device", ["cpu"]), ("--watch # live gauges", ["--watch"]), ("# only a comment", []),
    ("'a # b' c", ["a # b", "c"]), ('--model "m#1" #', ["--model", "m#1"]),
])
def test_split(line, expected):
    assert split(line) == expected


def test_a_comment_after_a_magic_is_a_comment(shell):
    # As README's quickstart writes them: a comment on the magic's line, with an apostrophe in it.
    shell.run_line_magic("gpuinfo", "--json  # every device; the picker's choice is where cells run")
    result = shell.run_cell("%%ondevice cpu   # the cell's device\nimport torch\nx = torch.ones(2).cuda()\n")
    result.raise_error()
    assert shell.user_ns["x"].device.type == "cpu"
