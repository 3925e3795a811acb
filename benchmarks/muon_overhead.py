"""
What sharding costs Muon: a step of torch.optim.Muon on whole matrices against a step of modern.py's ShardedMuon on
the same matrices split over the ranks by FSDP2 (--fsdp --recipe modern), both on the same gradients. ShardedMuon
gathers each matrix's update, orthogonalizes it on every rank and keeps the rank's own rows; the difference between
the two rows is that gather and the bookkeeping around it, per optimizer step.

    python benchmarks/muon_overhead.py                                            # GPT-2 124M's 48 matrices, alone
    torchrun --standalone --nproc_per_node=8 benchmarks/muon_overhead.py          # the same over 8 GPUs
    python benchmarks/muon_overhead.py --shape 32 32 --device cpu                 # tiny matrices: the overhead alone

Prints the median step time of each, after warm-up steps, in milliseconds (rank 0).
"""

import argparse
import os
import sys
import time

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
import train_gpt2  # noqa: E402
from variations import modern  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--matrices", type=int, default=48, help="how many (default: 48, GPT-2 124M's blocks' count)")
    parser.add_argument("--shape", type=int, nargs=2, default=[768, 3072], metavar=("OUT", "IN"),
                        help="each matrix's shape (default: 768 3072, GPT-2 124M's MLP)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--timed-steps", type=int, default=20)
    args = parser.parse_args(argv)
    if not hasattr(torch.optim, "Muon") or modern.orthogonalize is None:
        parser.exit(2, f"error: Muon's steps are not in this torch ({torch.__version__}); it needs PyTorch 2.9 or "
                       f"later\n")
    if min(args.matrices, *args.shape, args.timed_steps) <= 0 or args.warmup_steps < 0:
        parser.exit(2, "error: --matrices, --shape and --timed-steps must be positive, --warmup-steps not negative\n")
    return args


def median_step_ms(optimizer, device, warmup_steps, timed_steps):
    times = []
    for step in range(warmup_steps + timed_steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= warmup_steps:
            times.append((time.perf_counter() - t0) * 1000)
    return sorted(times)[(len(times) - 1) // 2]


def main(argv=None):
    args = parse_args(argv)
    env = train_gpt2.set_up_distributed(args.device, fsdp=True)  # a process group, of one process when run alone
    device = torch.device(env.device)
    rows = {}
    for name in ("torch.optim.Muon, whole matrices", "ShardedMuon, FSDP's slices"):
        torch.manual_seed(0)  # the same weights and gradients for both, on every rank
        out_features, in_features = args.shape
        layers = nn.ModuleList(nn.Linear(in_features, out_features, bias=False, device=device)
                               for _ in range(args.matrices))
        sharded = name.startswith("Sharded")
        if sharded:
            for layer in layers:
                fully_shard(layer)
        for layer in layers:  # one backward gives every rank its rows of the gradient, as in training
            layer(torch.randn(4, in_features, device=device)).square().sum().backward()
        optimizer = (modern.ShardedMuon if sharded else torch.optim.Muon)(layers.parameters(), lr=0.02,
                                                                              momentum=0.95)
        rows[name] = median_step_ms(optimizer, device, args.warmup_steps, args.timed_steps)
    if env.rank == 0:
        print(f"{args.matrices} matrices of {args.shape[0]} x {args.shape[1]} on {env.world_size} {env.device_type} "
              f"process(es), torch {torch.__version__}; median of {args.timed_steps} steps after {args.warmup_steps}")
        for name, ms in rows.items():
            print(f"{name:<36} {ms:9.2f} ms per step")
        whole, shards = rows.values()
        print(f"{'sharding costs':<36} {shards - whole:9.2f} ms per step")
    train_gpt2.tear_down_distributed()


if __name__ == "__main__":
    main()
