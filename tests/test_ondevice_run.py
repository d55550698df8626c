"""run_on_device, the plain function behind %%ondevice, called without the magic."""
from __future__ import annotations

import torch

from gpumagic.ondevice.run import OnDeviceOptions, run_on_device


def test_run_on_device_plain_function(shell):
    shell.user_ns["torch"] = torch
    result = run_on_device(shell, "a = torch.cuda.HalfTensor(2, 2)\na.shape", OnDeviceOptions(device="meta"))
    assert result.device == "meta" and result.ran and tuple(result.value) == (2, 2)
    assert result.rewrites == 1 and shell.user_ns["a"].dtype == torch.float16
    assert run_on_device(shell, "   \n", OnDeviceOptions(device="meta")).ran is False
