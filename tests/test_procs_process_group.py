"""A worker's process group (gpumagic.procs.process_group): the pool's, kept when the cell asks for that
group and through destroy_process_group, given way to when it asks for another, formed again at the next
task. Two real CPU processes (gloo, a FileStore)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from gpumagic.procs.rendezvous import free_loopback_port
from tests.conftest import ROOT

RANK = """\
import json, sys
from types import SimpleNamespace
import torch
import torch.distributed as dist
from gpumagic.procs import process_group as pg
from gpumagic.dataparallel.strategies.launch_rank import launched

rank, world, path, port, env_port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
out = {"before": pg.is_pool_group(), "ensure_before": pg.ensure_pool_group()}   # no join yet: nothing to do

def total():
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()

config = SimpleNamespace(rendezvous=("file", path), world_size=world, rank=rank, device="cpu", backend="gloo",
                         timeout=60)
pg.join(config)
pool = dist.group.WORLD
out["joined"] = [pg.is_pool_group(), dist.get_world_size(), dist.get_rank(), dist.get_backend(), total()]

# The cell forms its own group, as code written for torchrun does: the pool's is given up first.
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
out["user"] = [pg.is_pool_group(), dist.group.WORLD is pool, dist.get_world_size(), dist.get_rank(), total()]

out["ensure"] = [pg.ensure_pool_group(), pg.is_pool_group(), total()]
out["ensure_again"] = [pg.ensure_pool_group(), pg.is_pool_group()]

# torchrun code destroys its group at its end: the pool's stays, for the next cell.
dist.destroy_process_group()
out["destroyed"] = [pg.is_pool_group(), dist.is_initialized(), dist.group.WORLD is pg._state["group"]]
out["ensure_after_destroy"] = [pg.ensure_pool_group(), pg.is_pool_group(), total()]
# A group the cell left (or none, torch's own destroy) is replaced at the next task.
pg._state["original_destroy"]()
out["really_destroyed"] = [pg.is_pool_group(), dist.is_initialized()]
out["ensure_after_really"] = [pg.ensure_pool_group(), pg.is_pool_group(), total()]

# Imported by name after join, through torchrun's environment (env://), as torchrun code calls it: the
# call asks for the group the pool has (env://, this world size and rank, gloo), so it is that group.
from torch.distributed import init_process_group
pool = dist.group.WORLD
with launched(rank, world, env_port, "pg-test", on_cpu=True):
    init_process_group("gloo")
    out["env_user"] = [pg.is_pool_group(), dist.group.WORLD is pool, dist.get_world_size(), dist.get_rank(), total()]
    init_process_group(backend="gloo", init_method="env://", world_size=world, rank=rank)
    out["env_user_explicit"] = [pg.is_pool_group(), dist.group.WORLD is pool]
out["ensure_after_env"] = [pg.ensure_pool_group(), pg.is_pool_group(), total()]
print(json.dumps(out), flush=True)
# As a worker leaves (procs/worker.py): interpreter teardown with gloo's threads about can abort.
import os
os._exit(0)
"""


def test_pool_group_gives_way_to_the_cell_and_forms_again(tmp_path):
    port, env_port = free_loopback_port(), free_loopback_port()
    env = {**os.environ, "PYTHONPATH": ROOT}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(name, None)
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), "2", store, str(port), str(env_port)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    for rank, (stdout, _) in enumerate(outs):
        got = json.loads(stdout.strip().splitlines()[-1])
        assert got == {
            "before": False, "ensure_before": False,
            "joined": [True, 2, rank, "gloo", 3.0],
            "user": [False, False, 2, rank, 3.0],
            "ensure": [True, True, 3.0],
            "ensure_again": [False, True],
            "destroyed": [True, True, True],
            "ensure_after_destroy": [False, True, 3.0],
            "really_destroyed": [False, False],
            "ensure_after_really": [True, True, 3.0],
            "env_user": [True, True, 2, rank, 3.0],
            "env_user_explicit": [True, True],
            "ensure_after_env": [False, True, 3.0],
        }
