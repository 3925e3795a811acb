"""Run by tests/test_loss.py under torchrun with 2 processes (gloo, on the CPU): one train_step of the chunked loss in
DDP, 2 accumulation steps of one sequence on each rank, against the whole batch's full loss in one process. Rank 0
prints the largest difference of the gradients, as JSON, on its last line."""
import contextlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import train_gpt2  # noqa: E402


def model(loss):
    torch.manual_seed(0)
    return train_gpt2.GPT(train_gpt2.GPTConfig(block_size=16, vocab_size=50304, n_layer=1, n_head=2, n_embd=32,
                                               loss=loss))


env = train_gpt2.set_up_distributed("cpu")  # gloo
x = torch.randint(0, 50257, (4, 16), generator=torch.Generator().manual_seed(1))
y = torch.randint(0, 50257, (4, 16), generator=torch.Generator().manual_seed(2))
ddp = torch.nn.parallel.DistributedDataParallel(model("chunked"))
mine = slice(2 * env.rank, 2 * env.rank + 2)  # each rank's half of the batch, 2 micro-batches of one sequence
batches = [(x[mine][i:i + 1], y[mine][i:i + 1]) for i in range(2)]
train_gpt2.train_step(ddp, [torch.optim.SGD(ddp.parameters(), lr=0.0)], torch.amp.GradScaler("cpu", enabled=False),
                      batches, contextlib.nullcontext(), grad_clip=1e9)
whole = model("full")  # the whole batch in one process, the full loss
whole(x, y)[1].backward()
diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(ddp.module.parameters(), whole.parameters()))
if env.rank == 0:
    print(json.dumps(diff))
del ddp
train_gpt2.tear_down_distributed()
