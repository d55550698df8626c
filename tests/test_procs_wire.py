"""The wire format (gpumagic.procs.wire): values and tensors packed for workers and rebuilt there."""
from __future__ import annotations

import pytest
import torch

from gpumagic.procs import tensor_cache, wire


def test_ship_round_trip_keeps_identity_devices_and_attributes():
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(5, 4)).sum().backward()
    opt.step()
    m[0].weight.tag = "kept"
    obj = {"m": m, "opt": opt, "dev": torch.device("cuda:1"), "t": torch.arange(6).view(2, 3).t()}
    packed = wire.pack(obj)
    back, tensors = wire.unpack(packed.header, packed.buffer, device="cpu")
    assert back["dev"] == torch.device("cpu")          # a CUDA device means the rank's device
    assert torch.equal(back["t"], obj["t"]) and back["m"][0].weight.tag == "kept"
    assert back["opt"].param_groups[0]["params"][0] is back["m"][0].weight   # shared objects stay shared
    assert torch.equal(back["opt"].state[back["m"][0].weight]["momentum_buffer"],
                       opt.state[m[0].weight]["momentum_buffer"])
    assert back["m"][0].weight.requires_grad and isinstance(back["m"][0].weight, torch.nn.Parameter)


def test_ship_cache_is_keyed_by_content():
    big = torch.randn(300_000)                      # 1.2 MB: fingerprinted
    store = tensor_cache.TensorStore()
    first = wire.pack({"a": big, "b": big.clone()})
    _, tensors = wire.unpack(first.header, first.buffer, store=store)
    held = store.rebuild(tensors)
    assert len(held) == 1                           # equal contents, one key
    again = wire.pack({"a": big, "b": big.clone()}, held=held)
    assert again.shipped_bytes == 0 and again.cached_bytes == 2 * big.numel() * 4
    back, _ = wire.unpack(again.header, again.buffer, store=store)
    assert torch.equal(back["a"], big) and back["a"].data_ptr() != back["b"].data_ptr()  # no aliasing
    big[17] += 1.0                                  # any change: shipped again
    assert wire.pack({"a": big}, held=held).cached_bytes == 0
    swapped = big.clone().view(-1, 1000).flip(0).reshape(-1)  # same values, other places
    assert tensor_cache.fingerprint_keys([swapped]) != tensor_cache.fingerprint_keys([big])


@pytest.mark.parametrize("change", ["neg float64", "abs float64", "neg odd float32", "swap two words",
                                    "top bit of two words", "last byte"])
def test_any_change_to_a_large_tensor_changes_its_fingerprint(change):
    """Changes a linear sum of the words misses: sign flips differ by 2**63 and cancel in pairs."""
    torch.manual_seed(0)
    t = torch.randn(512, 512, dtype=torch.float64) if "64" in change else torch.randn(600_000)
    changed = t.clone()
    if change == "neg float64":
        changed.neg_()
    elif change == "abs float64":            # exactly two values negative
        t = t.abs()
        t[0, :2] *= -1
        changed = t.abs()
    elif change == "neg odd float32":
        changed[1::2].neg_()
    else:
        words = changed.view(torch.int64)
        if change == "swap two words":
            words[[10, 20_000]] = words[[20_000, 10]].clone()
        elif change == "top bit of two words":
            words[[3, 7]] ^= -(1 << 63)
        else:
            changed.view(torch.uint8)[-1] ^= 1
    assert not torch.equal(changed, t)
    assert tensor_cache.fingerprint_keys([changed]) != tensor_cache.fingerprint_keys([t])


@pytest.mark.gpu
def test_fingerprints_agree_on_the_cpu_and_a_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
    torch.manual_seed(0)
    tensors = [torch.randn(300_000), torch.randn(512, 512, dtype=torch.float64), torch.randn(3, 1_000_003).half(),
               torch.randint(0, 255, (5_000_001,), dtype=torch.uint8), torch.randn(20_000_000)]
    on_gpu = [t.cuda() for t in tensors]
    assert tensor_cache.fingerprint_keys(on_gpu) == tensor_cache.fingerprint_keys(tensors)


def test_shared_tensors_travel_by_reference_and_the_rest_by_value():
    shared = torch.zeros(4).share_memory_()
    private = torch.ones(4)
    packed = wire.pack({"s": shared, "p": private}, share=lambda t: t.is_shared(), fingerprint=False)
    assert len(packed.shared) == 1 and packed.shared[0] is shared
    assert packed.shipped_bytes == private.numel() * 4              # only the private tensor's bytes
    back, _ = wire.unpack(packed.header, packed.data(), shared=packed.shared)
    assert back["s"] is shared and back["p"] is not private and torch.equal(back["p"], private)


def test_large_cpu_tensors_can_stay_views_of_the_buffer():
    big, small = torch.arange(300_000, dtype=torch.float32), torch.arange(10, dtype=torch.float32)
    needs_grad = torch.randn(300_000, requires_grad=True)
    packed = wire.pack({"big": big, "small": small, "grad": needs_grad}, fingerprint=False)
    buffer = packed.data()
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    back, _ = wire.unpack(packed.header, buffer, views_from=1 << 20)
    assert start <= back["big"].data_ptr() < end                      # mapped, not copied
    assert not start <= back["small"].data_ptr() < end                # small: the receiver's own copy
    assert not start <= back["grad"].data_ptr() < end and back["grad"].requires_grad
    copied, _ = wire.unpack(packed.header, buffer)                     # the default copies everything
    assert not start <= copied["big"].data_ptr() < end and torch.equal(copied["big"], big)


def test_functions_from_cells_bring_their_source():
    import linecache
    name = "<ipython-input-41-feedbeef>"
    source = "def double(x):\n    return 2 * x\n"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    ns = {"__name__": "__main__"}
    exec(compile(source, name, "exec"), ns)
    packed = wire.pack({"f": ns["double"]}, fingerprint=False)
    del linecache.cache[name]                                          # a fresh worker knows nothing of it
    back, _ = wire.unpack(packed.header, packed.data())
    assert back["f"](3) == 6 and linecache.getline(name, 2) == "    return 2 * x\n"


def test_notebook_functions_read_the_shipped_namespace():
    ns = {"__name__": "__main__", "scale": 3}
    exec("def scaled(x):\n    return scale * x\n", ns)
    packed, dropped = wire.pack_namespace({"scaled": ns["scaled"], "scale": 3}, ns, fingerprint=False)
    worker_ns, _ = wire.unpack_namespace(packed.header, packed.data())
    assert dropped == [] and worker_ns["scaled"].__globals__ is worker_ns
    worker_ns["scale"] = 10          # what a worker does to a global (a loader split, say) ...
    assert worker_ns["scaled"](2) == 20   # ... the notebook's functions see


def test_unpicklable_values_are_named_or_left_to_the_cell():
    import threading
    lock = threading.Lock()
    ns = {"__name__": "__main__"}
    packed, dropped = wire.pack_namespace({"lock": lock, "x": 1}, ns, droppable={"lock"}, fingerprint=False)
    worker_ns, _ = wire.unpack_namespace(packed.header, packed.data())
    assert dropped == ["lock"] and worker_ns["x"] == 1 and "lock" not in worker_ns
    with pytest.raises(wire.Unshippable) as err:
        wire.pack_namespace({"lock": lock, "x": 1}, ns, fingerprint=False)
    assert [name for name, _, _ in err.value.problems] == ["lock"] and "lock (lock:" in str(err.value)
