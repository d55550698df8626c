"""What a rank rewrites in a cell: cuda spellings mean the rank's own GPU (gpumagic.dataparallel.rank.devices)."""
from __future__ import annotations

import ast

from gpumagic.dataparallel.rank.devices import RankDevice


def test_cuda_spellings_mean_the_rank_gpu():
    src = ("a = x.cuda(0)\nb = torch.device('cuda', 0)\nc = torch.zeros(2, device='cuda:0')\n"
           "torch.cuda.set_device(0)\ne = torch.ones(1, device=0)\nf = f'cuda:0 {x}'\ng = x.cuda()\n")
    assert ast.unparse(RankDevice(1).visit(ast.parse(src))) == (
        "a = x.cuda(1)\nb = torch.device('cuda', 1)\nc = torch.zeros(2, device='cuda:1')\n"
        "torch.cuda.set_device(1)\ne = torch.ones(1, device=1)\nf = f'cuda:0 {x}'\ng = x.cuda()")


# --- the DDP wrapper answers like the container it wraps ------------------------------------------

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from gpumagic.dataparallel.strategies.ddp_wrapper import cell_ddp_class, wrap_in_ddp  # noqa: E402


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.scale = 2.0

    def forward(self, x):
        return self.fc(x) * self.scale


@pytest.fixture
def one_rank_group(tmp_path):
    """A real one-process gloo group in this process, destroyed after the test."""
    import torch.distributed as dist
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def train_steps(wrapper, in_features=4, steps=2):
    """Two forward/backward passes: DDP left with parameters it no longer sees fails at the second."""
    for _ in range(steps):
        wrapper(torch.randn(3, in_features)).sum().backward()


def test_wrapper_class_has_the_container_methods_the_module_has():
    seq_cls, plain = cell_ddp_class(nn.Sequential), cell_ddp_class(Net)
    for method in ("__getitem__", "__setitem__", "__delitem__", "__len__", "__iter__"):
        assert hasattr(seq_cls, method), method
        assert not hasattr(plain, method), method
    assert plain is cell_ddp_class()                       # nothing to add: the base class itself
    assert cell_ddp_class(nn.Sequential) is seq_cls        # made once per module class
    assert issubclass(seq_cls, torch.nn.parallel.DistributedDataParallel)
    assert cell_ddp_class(nn.ModuleDict) is not seq_cls and hasattr(cell_ddp_class(nn.ModuleDict), "__contains__")


def test_wrapped_sequential_indexes_iterates_and_counts_like_it(one_rank_group):
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    w = wrap_in_ddp(seq, {})
    assert w[0] is seq[0] and w[-1] is seq[2]
    assert len(w) == len(seq) == 3
    assert list(w) == list(seq)
    assert isinstance(w[0:2], nn.Sequential) and list(w[0:2]) == [seq[0], seq[1]]
    assert bool(w) is True
    assert list(w.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]   # no "module." prefix


def test_wrapped_plain_module_has_no_len_as_the_module_has_none(one_rank_group):
    net = Net()
    w = wrap_in_ddp(net, {})
    with pytest.raises(TypeError, match="has no len"):
        len(net)
    with pytest.raises(TypeError, match="has no len"):
        len(w)
    with pytest.raises(TypeError, match="not subscriptable"):
        w[0]
    assert w.fc is net.fc and w.scale == 2.0


def test_item_assignment_replaces_the_layer_and_builds_ddp_again(one_rank_group):
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    built = []
    w = wrap_in_ddp(seq, {}, after_build=[built.append])
    assert built == [w]
    new = nn.Linear(8, 3)
    w[2] = new
    assert seq[2] is new and w[2] is new
    assert built == [w, w]                                            # after_build ran on the rebuild
    assert any(p is new.weight for p in w._module_parameters)          # DDP knows the new parameters
    assert not any(p.shape == (2, 8) for p in w._module_parameters)
    train_steps(w)
    assert new.weight.grad is not None and new.weight.grad.shape == (3, 8)
    assert w(torch.randn(5, 4)).shape == (5, 3)
    del w[1]
    assert len(seq) == 2 and len(built) == 3


def test_attribute_assignment_replaces_the_inner_layer_and_builds_ddp_again(one_rank_group):
    net = Net()
    built = []
    w = wrap_in_ddp(net, {}, after_build=[built.append])
    fc = nn.Linear(4, 2)
    w.fc = fc
    assert net.fc is fc and w.fc is fc and "fc" not in w._modules
    assert len(built) == 2
    assert any(p is fc.weight for p in w._module_parameters)
    train_steps(w)
    assert fc.weight.grad is not None
    w.scale = 3.0           # a plain attribute of the module: set there, no rebuild
    assert net.scale == 3.0 and len(built) == 2


def test_rebuild_keeps_the_ddp_options(one_rank_group):
    seq = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    w = wrap_in_ddp(seq, {"find_unused_parameters": True, "bucket_cap_mb": 1})
    w[1] = nn.Linear(8, 2)
    assert w.find_unused_parameters is True
    assert w.bucket_bytes_cap == 1024 * 1024
