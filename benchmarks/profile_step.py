"""
Profiles a few training steps of train_gpt2.py's model with torch.profiler and prints the operations that take
the most time: self CUDA time on a GPU, self CPU time elsewhere. The place to start when a speed-up is to be found.

    python benchmarks/profile_step.py                                   # GPT-2 124M, B=64, T=1024, on the GPU
    python benchmarks/profile_step.py --batch-size 16 --trace step.json  # also a trace for https://ui.perfetto.dev
    python benchmarks/profile_step.py --recipes gpt2 modern --top 10  # each recipe's step, and a line of each
    python benchmarks/profile_step.py --device cpu --n-layer 2 --n-head 2 --n-embd 64 --batch-size 4 --seq-len 32

The model, batch and speed settings are train_gpt2.py's own flags, with its defaults (--recipe, --model, --n-layer,
--n-head, --n-embd, --vocab-size, --attn, --loss, --batch-size, --seq-len, --dtype, --compile, --compile-mode,
--fused-adamw, --device), and the model is built and compiled as train_gpt2.py does it. Each step is one micro-batch
of random tokens: forward, backward, gradient clipping and the recipe's optimizer update. The last line sums the
table up: the time a step, and the five operations that take the most of it.
"""

import argparse
import dataclasses
import os
import sys

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
import train_gpt2  # noqa: E402
from machinery import memory  # noqa: E402
from machinery.errors import UsageError  # noqa: E402
from machinery.tokenizer import GPT2_VOCAB  # noqa: E402
from train_gpt2 import autocast_context, make_optimizers  # noqa: E402


def parse_args(argv=None):
    """(profile_step's own flags, [(config, given)] of each recipe to profile)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=int, default=3,
                        help="unprofiled steps first: compilation, autotuning, allocator (default: 3)")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps (default: 3)")
    parser.add_argument("--top", type=int, default=25, help="rows of the table (default: 25)")
    parser.add_argument("--trace", default="", help="also write a Chrome/Perfetto trace to this .json file")
    parser.add_argument("--recipes", nargs="+", choices=list(train_gpt2.RECIPES), default=[],
                        help="profile each in turn, in this process, and sum them up side by side (default: "
                             "--recipe's alone)")
    parser.add_argument("--dry-run", action="store_true", help="print what would be profiled, and stop")
    args, trainer_flags = parser.parse_known_args(argv)
    if args.warmup < 0 or args.steps <= 0 or args.top <= 0:
        parser.exit(2, "error: --warmup must be zero or more, --steps and --top positive\n")
    runs = [train_gpt2.parse_args(trainer_flags + ["--recipe", recipe]) for recipe in args.recipes]
    return args, runs or [train_gpt2.parse_args(trainer_flags)]


def main(argv=None):
    args, runs = parse_args(argv)
    summaries = []
    for cfg, given in runs:
        try:
            env = train_gpt2.set_up_distributed(cfg.device)
            cfg = dataclasses.replace(cfg, total_batch_size=cfg.batch_size * cfg.seq_len)  # one micro-batch a step
            # no data is read, but marking --data as given keeps the trainer from switching to its Shakespeare preset
            cfg = train_gpt2.final_config(train_gpt2.draft_config(cfg, given | {"data"}, env), env)
        except UsageError as e:
            sys.exit(f"error: {e}")
        if args.dry_run:
            print(f"dry run: {shapes(cfg)} | {args.warmup} steps, then {args.steps} profiled, on {env.device_type}")
            continue
        trace = args.trace
        if trace and len(runs) > 1:  # a trace of each: step.json -> step.gpt2.json, step.modern.json
            trace = f"{os.path.splitext(trace)[0]}.{cfg.recipe}{os.path.splitext(trace)[1]}"
        summaries.append(profile_steps(args, cfg, env, trace))
        torch._dynamo.reset()  # the next recipe compiles afresh, as its own run would
    if len(summaries) > 1:
        print("\n".join(summaries))


def profile_steps(args, cfg, env, trace):
    """Profiles --steps training steps of cfg's model after --warmup ones; prints the table, and returns the line that
    sums it up (largest_shares)."""
    device, device_type = env.device, env.device_type
    train_gpt2.set_tf32(cfg.dtype != "fp32")
    if device_type == "cpu":
        memory.keep_freed_memory(True)  # as train_gpt2.py does on a CPU whose micro-batch fits
    model = train_gpt2.make_model(cfg, device)  # as train() builds it
    compiled = train_gpt2.compile_model(model, cfg)
    optimizers = make_optimizers(model, cfg, device_type)
    train_gpt2.set_lr(optimizers, cfg.warmup_steps, cfg)  # the peak learning rate, where warmup ends
    scaler = torch.amp.GradScaler(device_type, enabled=cfg.dtype == "fp16")
    autocast_ctx = autocast_context(device_type, cfg.dtype)
    tokens = torch.randint(0, GPT2_VOCAB, (cfg.batch_size, cfg.seq_len + 1))  # on the CPU, as the data loader's are
    x, y = tokens[:, :-1], tokens[:, 1:]

    def train_step():
        train_gpt2.train_step(compiled, optimizers, scaler, [(x, y)], autocast_ctx, cfg.grad_clip)

    def wait_for_device():
        if device_type == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        train_step()
    wait_for_device()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            with record_function("train_step"):
                train_step()
        wait_for_device()

    # on a GPU the CPU only launches kernels, so the time that counts is the device's
    sort_by = "self_device_time_total" if device_type == "cuda" else "self_cpu_time_total"
    where = torch.cuda.get_device_name() if device_type == "cuda" else device_type
    print(f"{shapes(cfg)} | {args.steps} profiled steps on {where}, sorted by {sort_by}")
    averages = prof.key_averages()
    print(averages.table(sort_by=sort_by, row_limit=args.top))
    if trace:
        prof.export_chrome_trace(trace)
        print(f"trace written to {trace}")
    summary = f"{cfg.recipe}: {largest_shares(averages, sort_by, args.steps)}"
    print(summary, flush=True)
    return summary


def shapes(cfg):
    return (f"recipe {cfg.recipe}, {cfg.n_layer} layers, {cfg.n_head} heads, width {cfg.n_embd}, vocab "
            f"{cfg.vocab_size}, attn {cfg.attn}, loss {cfg.loss} | B={cfg.batch_size}, T={cfg.seq_len}, {cfg.dtype}, "
            f"compile {cfg.compile_mode if cfg.compile else 'off'}")


def largest_shares(averages, sort_by, steps, count=5):
    """One line: the count operations that took the most of sort_by's time, each with its share of the total, and
    the total a step (the table's columns, for a summary a glance reads). On a GPU, of its kernels alone: an
    operation of the CPU carries its kernels' time too, which would count it twice (the table's total leaves it out)."""
    if sort_by == "self_device_time_total":
        averages = [event for event in averages
                    if event.device_type != DeviceType.CPU and not getattr(event, "is_user_annotation", False)]
    times = sorted(((getattr(event, sort_by), event.key) for event in averages), reverse=True)
    total = sum(time for time, _ in times) or 1
    top = ", ".join(f"{name[:48]} {100 * time / total:.1f}%" for time, name in times[:count])
    return f"{total / 1000 / steps:.1f} ms a step; the most: {top}"


if __name__ == "__main__":
    main()
