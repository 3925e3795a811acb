"""Run by tests/test_fsdp.py under torchrun with 2 processes (gloo, on the CPU): ShardedMuon on matrices that FSDP2
splits over the ranks (some with a row count that 2 does not divide, so the slices are uneven, one of them empty)
against torch.optim.Muon on the whole matrices in each process, for 3 steps of the same gradients. Rank 0 prints the
largest difference of the weights, and how far they moved, as JSON on its last line."""
import json
import os
import sys

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import train_gpt2  # noqa: E402
from variations import modern  # noqa: E402

SHAPES = [(7, 5), (6, 10), (16, 8), (3, 12), (1, 9)]  # (out, in): 7, 3 and 1 rows split 4 + 3, 2 + 1 and 1 + 0


def matrices():
    torch.manual_seed(0)
    return nn.ModuleList(nn.Linear(n_in, n_out, bias=False) for n_out, n_in in SHAPES)


env = train_gpt2.set_up_distributed("cpu")  # gloo
whole, sharded = matrices(), matrices()
start = [p.detach().clone() for p in whole.parameters()]
for layer in sharded:
    fully_shard(layer)
settings = dict(lr=0.05, momentum=0.95, weight_decay=0.1)
reference = torch.optim.Muon(whole.parameters(), **settings)
mine = modern.ShardedMuon(sharded.parameters(), **settings)
generator = torch.Generator().manual_seed(1)
for _ in range(3):
    for p, q in zip(whole.parameters(), sharded.parameters()):
        grad = torch.randn(p.shape, generator=generator)  # the same on every rank
        p.grad = grad.clone()
        q.grad = DTensor.from_local(grad, q.device_mesh, [Replicate()]).redistribute(
            placements=q.placements)  # this rank's rows of it, as FSDP's reduce-scatter leaves them
    reference.step()
    mine.step()
gathered = [q.full_tensor() for q in sharded.parameters()]
if env.rank == 0:
    print(json.dumps({
        "max_diff": max((p - q).abs().max().item() for p, q in zip(whole.parameters(), gathered)),
        "min_moved": min((p - p0).abs().max().item() for p, p0 in zip(whole.parameters(), start)),
        "local_rows": [q.to_local().shape[0] for q in sharded.parameters()],
    }))
train_gpt2.tear_down_distributed()
