"""What rank 0 reads to see notebook tensors and arrays changed in place (gpumagic.dataparallel.touched):
bounded work on the way to a cell's first step."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpumagic.dataparallel import touched
from gpumagic.procs.returning import RETURN_LIMIT


def test_a_large_tensor_is_judged_by_its_version_not_read(monkeypatch):
    big = torch.zeros(touched.READ_WHOLE_BYTES // 4 + 1)          # a dataset-sized tensor
    small = torch.zeros(8)
    read: list = []
    from gpumagic.procs import tensor_cache
    monkeypatch.setattr(tensor_cache, "fingerprint_keys", lambda ts: read.append(len(ts)) or
                        [(str(t.dtype), tuple(t.shape), int(t.sum())) for t in ts])
    ns = {"big": big, "small": small}
    before = touched.fingerprints(ns, ["big", "small"])
    assert read == [1]                                  # only the small one's bytes were read
    assert touched.changed(ns, before) == []
    big[5] = 1.0                                        # any in-place write advances the version
    small.add_(1)
    assert touched.changed(ns, before) == ["big", "small"]


def test_a_strided_numpy_array_over_the_limit_is_not_copied(monkeypatch):
    arr = np.zeros((RETURN_LIMIT // 8 // 1000 + 1, 1000)).T     # strided, just over what comes back
    monkeypatch.setattr(np, "ascontiguousarray", lambda *a, **k: pytest.fail("copied"))
    assert touched.fingerprint(arr) is None
    assert touched.fingerprint(np.array([object()])) is None    # object arrays: not compared


def test_a_large_plain_item_of_a_container_is_compared_by_identity_not_copied(monkeypatch):
    import copy

    from gpumagic.dataparallel import containers
    history = [0.5] * 20_000                           # over what is copied to compare
    held = {"model": torch.nn.Linear(2, 2), "history": history, "n": 1}
    copied: list = []
    real = copy.deepcopy
    monkeypatch.setattr(containers.copy, "deepcopy", lambda v, *a: copied.append(v) or real(v, *a))
    before = containers.snapshot({"held": held}, ["held"])
    assert copied == [1]                               # only the small plain item
    assert containers.changes({"held": held}, before) == ({}, [])
    held["n"] = 2                                      # a change beside it still comes back
    back, _ = containers.changes({"held": held}, before)
    assert back == {"held": [("model", ("old", "model")), ("history", ("old", "history")), ("n", ("value", 2))]}
