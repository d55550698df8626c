"""--vars and numpy: arrays are cpu memory, views and torch.from_numpy share it, a memmap is a file's."""
from __future__ import annotations

import numpy as np
import torch

from gpumagic.memory import variables


def rows(ns, **kw):
    return {r.name: r.nbytes for r in variables.variable_memory(ns, **kw).rows}


def test_arrays_views_and_tensors_over_them_count_each_byte_once():
    arr = np.zeros(1000)                        # 8,000 bytes
    ns = {"arr": arr, "every_other": arr[::2], "as_tensor": torch.from_numpy(arr)}
    rep = variables.variable_memory(ns)
    assert rows(ns) == {"arr": 8000, "every_other": 8000, "as_tensor": 8000}
    assert rep["arr"].parts == {"arrays": 8000} and rep["arr"].shared_with == ["as_tensor", "every_other"]
    assert rep.totals == {"cpu": 8000}


def test_an_array_over_a_tensor_keeps_the_tensors_storage():
    t = torch.zeros(500)
    over = t.numpy()                            # its base is a tensor over t's storage
    del t
    assert rows({"over": over, "again": np.asarray(over)}) == {"over": 2000, "again": 2000}


def test_memmaps_objects_and_subclasses(tmp_path):
    mapped = np.memmap(tmp_path / "a.bin", dtype="float32", mode="w+", shape=(1000,))
    objects = np.empty(2, dtype=object)
    objects[0], objects[1] = torch.zeros(25), "label"
    ran = []

    class Tagged(np.ndarray):
        @property
        def nbytes(self):
            ran.append("nbytes")
            return 0

    tagged = np.zeros(10).view(Tagged)
    rep = variables.variable_memory({"mapped": mapped, "objects": objects, "tagged": tagged})
    assert {r.name: r.nbytes for r in rep.rows} == {"objects": 16 + 100, "tagged": 80}
    assert rep["objects"].parts == {"arrays": 16, "tensors": 100}
    assert ran == []


def test_a_frame_like_object_with_hostile_dunders_is_read_from_its_dict():
    ran = []

    class Frame:                                # a DataFrame-like: every attribute is a column
        def __init__(self):
            self._data = {"x": np.zeros(100), "emb": torch.zeros(50)}

        def __getattr__(self, name):
            ran.append(name)
            return self._data.get(name, np.zeros(1))

        def __eq__(self, other):
            raise ValueError("the truth value of a Frame is ambiguous")

        __hash__ = __len__ = __bool__ = __iter__ = __eq__

    frame = Frame()
    rep = variables.variable_memory({"frame": frame, "frames": [frame, frame], "by_id": {1: frame}})
    assert {r.name: r.nbytes for r in rep.rows} == {"frame": 1000, "frames": 1000, "by_id": 1000}
    assert rep["frame"].parts == {"arrays": 800, "tensors": 200} and rep.totals == {"cpu": 1000}
    assert ran == []
