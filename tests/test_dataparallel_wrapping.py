"""What a rank rewrites in a cell: cuda spellings mean the rank's own GPU (gpumagic.dataparallel.wrapping)."""
from __future__ import annotations

import ast

from gpumagic.dataparallel.wrapping import RankDevice


def test_cuda_spellings_mean_the_rank_gpu():
    src = ("a = x.cuda(0)\nb = torch.device('cuda', 0)\nc = torch.zeros(2, device='cuda:0')\n"
           "torch.cuda.set_device(0)\ne = torch.ones(1, device=0)\nf = f'cuda:0 {x}'\ng = x.cuda()\n")
    assert ast.unparse(RankDevice(1).visit(ast.parse(src))) == (
        "a = x.cuda(1)\nb = torch.device('cuda', 1)\nc = torch.zeros(2, device='cuda:1')\n"
        "torch.cuda.set_device(1)\ne = torch.ones(1, device=1)\nf = f'cuda:0 {x}'\ng = x.cuda()")
