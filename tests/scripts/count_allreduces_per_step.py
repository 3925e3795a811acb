"""Under torchrun (gloo, on the CPU): how many gradient all-reduces DDP runs in one train_step of 1 and of 4
accumulation steps, on each rank; rank 0 prints them as one line of JSON, [{accumulation steps: all-reduces}] by rank:

    torchrun --nproc_per_node=2 tests/scripts/count_allreduces_per_step.py"""
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

import train_gpt2  # noqa: E402 (after the path that finds it)

train_gpt2.set_up_distributed("cpu")  # gloo, as torchrun launched it
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(
    train_gpt2.GPT(train_gpt2.GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32)))
calls = []


def counting_allreduce(state, bucket):
    calls.append(1)
    return allreduce_hook(state, bucket)


model.register_comm_hook(dist.group.WORLD, counting_allreduce)
optimizers = [torch.optim.SGD(model.parameters(), lr=0.1)]
x = torch.randint(0, 64, (2, 16))
counts = {}
for accum_steps in (1, 4):
    calls.clear()
    train_gpt2.train_step(model, optimizers, torch.amp.GradScaler("cpu", enabled=False), [(x, x)] * accum_steps,
                          contextlib.nullcontext(), 1.0)
    counts[accum_steps] = len(calls)
every_rank = [None] * dist.get_world_size()
dist.all_gather_object(every_rank, counts)
if dist.get_rank() == 0:  # one line from one process: the ranks' prints could interleave in the pipe
    print(json.dumps(every_rank))
del model, optimizers  # the DDP reducer before its process group, as in train(): the other order aborts ~1 exit in 10
train_gpt2.tear_down_distributed()
