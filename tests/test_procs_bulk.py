"""Bulk bytes through anonymous shared memory (gpumagic.procs.bulk)."""
from __future__ import annotations

import os

import torch


def test_bulk_bytes_go_through_anonymous_shared_memory():
    import multiprocessing

    from gpumagic.procs.bulk import Incoming, Outgoing
    a, b = multiprocessing.Pipe()
    out, inc = Outgoing(), Incoming()
    before = set(os.listdir("/dev/shm"))
    sent = []
    for size in (1000, 800, 5_000_000):          # the last one grows the buffer: a new descriptor
        data = out.get(size)
        data.copy_(torch.arange(size) % 251)
        ref, new = out.reference(data, peer="p", can_share=True)
        sent.append(new)
        a.send(ref)
        out.send(a, ref, new, data, "p", os.getpid())
        got = inc.receive(b, b.recv())
        assert torch.equal(got, (torch.arange(size) % 251).to(torch.uint8))
    assert sent == [True, False, True] and ref[0] == "shm"
    ref, _ = out.reference(out.get(10), peer="far", can_share=False)   # a remote peer: bytes
    a.send(ref)
    out.send(a, ref, False, out.get(10), "far", 0)
    assert ref == ("bytes", 10) and torch.equal(inc.receive(b, b.recv()), out.get(10))
    # memfd: nothing with a name (other programs may come and go in /dev/shm meanwhile)
    assert not [f for f in set(os.listdir("/dev/shm")) - before if "gpumagic" in f]
    assert any("memfd:gpumagic-bulk" in line for line in open("/proc/self/maps"))


def _read_handle(handle, queue):
    data = handle.open()
    queue.put((bytes(data.numpy()), data.is_shared()))


def test_bulk_bytes_reach_a_process_as_it_starts():
    import multiprocessing

    import torch

    from gpumagic.procs.bulk import Outgoing
    from gpumagic.procs.start import start_process
    out = Outgoing()
    data = out.get(6)
    data.copy_(torch.frombuffer(bytearray(b"weight"), dtype=torch.uint8))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    p = start_process(ctx, _read_handle, (out.handle(data), queue), "bulk-reader")
    out.close()                                  # the child has its own descriptor
    assert queue.get(timeout=60) == (b"weight", True)   # mapped shared memory, as torch's own
    p.join(10)
    assert p.exitcode == 0


def test_share_in_place_keeps_the_objects_and_their_values_in_one_memfd():
    from gpumagic.procs.bulk import share_in_place
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.BatchNorm1d(200))
    base = torch.arange(12.0)
    view = base[4:10].view(2, 3)              # a view of another tensor's storage
    tensors = [*model.parameters(), *model.buffers(), base, view]
    before = [t.detach().clone() for t in tensors]
    objects = [id(t) for t in tensors]
    share_in_place(tensors)
    assert [id(t) for t in tensors] == objects
    assert all(t.is_shared() for t in tensors)
    assert all(torch.equal(t, b) and t.dtype == b.dtype for t, b in zip(tensors, before))
    base[5] = -1.0                             # still a view of base
    assert view[0, 1] == -1.0
    # one mapping for all of them: an anonymous memfd, nothing named in /dev/shm
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    address = tensors[0].untyped_storage().data_ptr()
    mapping = next(line for line in open("/proc/self/maps").read().splitlines()
                   if int(line.split("-")[0], 16) <= address < int(line.split()[0].split("-")[1], 16))
    assert "memfd:gpumagic-bulk" in mapping and "/dev/shm" not in mapping, mapping
    out = model(torch.randn(4, 300))           # the module still works, and autograd sees the parameters
    out.sum().backward()
    assert model[0].weight.grad is not None
    share_in_place(tensors)                    # shared already: nothing moves
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1


def test_share_in_place_moves_a_tensor_listed_twice_once():
    # A tied weight is listed under both of its names (state_dict(keep_vars=True).values()): moving it
    # a second time would read its new offset as the old one and shift it by its own offset.
    from gpumagic.procs.bulk import share_in_place
    first, tied = torch.tensor([1.5]), torch.arange(32.0).view(2, 16)
    share_in_place([first, tied, tied])
    assert torch.equal(tied, torch.arange(32.0).view(2, 16)) and first.item() == 1.5
