"""Hogwild's shared memory (gpumagic.sharedtrain.sharing): the open-file limit decides torch's sharing strategy."""
from __future__ import annotations

from gpumagic.sharedtrain.sharing import plan_sharing


def test_sharing_plan_follows_the_open_file_limit():
    assert plan_sharing(100, 20, 1024, 4096) == ("file_descriptor", None, None)
    strategy, soft, note = plan_sharing(2000, 20, 1024, 1 << 20)
    assert strategy == "file_descriptor" and soft == 2 * (2000 + 20 + 64) and "1024" in note
    strategy, soft, note = plan_sharing(2000, 20, 1024, 1500)
    assert strategy == "file_system" and soft is None and "ulimit -n" in note
    assert plan_sharing(10 ** 6, 20, 1024, 1500, strategy="file_system") == ("file_system", None, None)
