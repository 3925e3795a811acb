"""
The GPT-2 recipe against the modern one (--recipe modern), trained on the same batches of real text with the same
model size, on any machine: the text is the Python standard library's own sources, which ship with every Python,
tokenized with GPT-2's BPE (no download). It prints both recipes' validation losses every --eval-every steps, then
the fraction of the GPT-2 recipe's tokens the modern one needs to reach the GPT-2 recipe's final validation loss.

    python benchmarks/recipes.py                                  # 6 layers, width 128: under 10 minutes on 2 cores
    python benchmarks/recipes.py --seeds 1 2 --n-embd 192         # another width, two seeds
    python benchmarks/recipes.py --recipes gpt2 --max-lr 4e-3     # one recipe at one setting: a search's point
    python benchmarks/recipes.py --device cuda --n-layer 12 --n-embd 768 --seq-len 1024 --batch-size 16 --steps 2000

The vocabulary is the GPT-2 tokens that occur in the text, renumbered: a 50257-wide output layer would cost most of
a CPU's step, and ids that never occur teach nothing about the recipes. The files are split 9:1 into training and
validation files. Each step's sequences start at random places of the training text (the same for both recipes):
read in order, a small step would see one or two files, and learn by fits and starts. The validation tokens are the
held-out files in a fixed random order. The training script's own model, optimizers, schedule, training step and
evaluation are what run here.
"""

import argparse
import dataclasses
import functools
import glob
import json
import math
import os
import sys
import sysconfig
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
sys.path.insert(0, REPO)
import train_gpt2  # noqa: E402
from machinery import memory, tokenizer  # noqa: E402
from train_gpt2 import TrainConfig, evaluate_val, make_model, make_optimizers  # noqa: E402
from variations import modern  # noqa: E402


@functools.lru_cache(maxsize=1)  # seconds of tokenizing, once a process
def standard_library_tokens():
    """(train, val, vocabulary size): the standard library's .py files (but the top-level test package, idlelib and
    site-packages) tokenized with GPT-2's BPE, every tenth file (in sorted order) held out for validation, in a fixed
    random order, the ids renumbered to those that occur."""
    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(p for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                   if not os.path.relpath(p, root).startswith(("test", "site-packages", "idlelib")))
    texts = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    files = tokenizer.gpt2_tokenizer().encode_ordinary_batch(texts)
    split = [np.array(tokens, dtype=np.int64) for tokens in files]
    held_out = split[::10]
    val = np.concatenate([held_out[i] for i in np.random.default_rng(0).permutation(len(held_out))])
    train = np.concatenate([tokens for i, tokens in enumerate(split) if i % 10])
    ids, renumbered = np.unique(np.concatenate([train, val]), return_inverse=True)
    return renumbered[: len(train)].astype(np.uint16), renumbered[len(train):].astype(np.uint16), len(ids)


def random_batch(tokens, B, T, rng):
    """B sequences (x, y) from random places of tokens, y one token after x."""
    windows = np.stack([tokens[start: start + T + 1] for start in rng.integers(0, len(tokens) - T, B)])
    windows = torch.from_numpy(windows.astype(np.int64))  # (B, T + 1)
    return windows[:, :-1], windows[:, 1:]


def train_recipe(cfg, train, val, device, eval_every, threads):
    """Trains one recipe; returns [(step, val loss)] and the median seconds per step."""
    torch.set_num_threads(threads)
    model = make_model(cfg, device)  # seeded by cfg.seed
    optimizers = make_optimizers(model, cfg, device.split(":")[0])
    scaler = torch.amp.GradScaler(enabled=False)
    autocast_ctx = train_gpt2.autocast_context(device.split(":")[0], cfg.dtype)
    starts = np.random.default_rng(cfg.seed)  # the same seed: both recipes see the same batches
    losses, times = [], []
    for step in range(cfg.max_steps + 1):
        if step % eval_every == 0 or step == cfg.max_steps:
            model.eval()
            losses.append((step, evaluate_val(model, val, cfg.batch_size, cfg.seq_len, device, autocast_ctx, 0, 1)))
            model.train()
        if step == cfg.max_steps:
            break
        t0 = time.perf_counter()
        batches = [random_batch(train, cfg.batch_size, cfg.seq_len, starts)]
        train_gpt2.set_lr(optimizers, step, cfg)
        result = train_gpt2.train_step(model, optimizers, scaler, batches, autocast_ctx, cfg.grad_clip)
        times.append(time.perf_counter() - t0)
        if not result.finite:
            losses.append((step + 1, float("nan")))
            break
    return losses, float(np.median(times))


def first_reached(points, target):
    """The x at which a curve of points [(x, loss)] first reached target, interpolated linearly between points (None
    if it never did)."""
    if points and points[0][1] <= target:
        return points[0][0]
    for (x0, loss0), (x1, loss1) in zip(points, points[1:]):
        if loss1 <= target:
            return x0 + (loss0 - target) / (loss0 - loss1) * (x1 - x0)
    return None


def tokens_to_reach(losses, target, tokens_per_step):
    """The tokens after which the validation losses [(step, loss)] first reached target (None if they never did)."""
    step = first_reached(losses, target)
    return None if step is None else step * tokens_per_step


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=["gpt2", "modern"], choices=["gpt2", "modern"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1337])
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--val-tokens", type=int, default=65536)
    parser.add_argument("--loss", default="chunked", choices=["full", "chunked"],
                        help="train_gpt2.py's --loss: the same numbers, and on a CPU chunked is the faster")
    parser.add_argument("--max-lr", type=float, default=2e-3, help="the GPT-2 recipe's peak learning rate (the best of "
                        "1e-3, 2e-3 and 4e-3 at the default size: docs/LOG.md has the search)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="default: a tenth of the run for GPT-2's "
                        "recipe, none for the modern one (as train_gpt2.py's presets)")
    for name in ("muon_lr", "embed_lr", "head_lr", "cooldown_frac", "logit_softcap"):
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=None,
                            help="the modern recipe's; default: train_gpt2.py's Shakespeare preset's, or its own")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    for name in ("n_layer", "n_head", "n_embd", "seq_len", "batch_size", "steps", "eval_every", "val_tokens"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return args


def recipe_config(args, recipe, seed, vocab_size):
    """train_gpt2.py's settings for one run: its defaults, the Shakespeare preset's learning rates for the modern
    recipe, then the flags."""
    cfg = TrainConfig(recipe=recipe, seed=seed, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                      block_size=args.seq_len, vocab_size=vocab_size, batch_size=args.batch_size, seq_len=args.seq_len,
                      total_batch_size=args.batch_size * args.seq_len, max_steps=args.steps, max_lr=args.max_lr,
                      warmup_steps=args.steps // 10, dtype=args.dtype, compile=False, device=args.device,
                      loss=args.loss)
    if recipe == "modern":
        cfg = dataclasses.replace(cfg, **modern.PRESETS["shakespeare"])
        cfg = dataclasses.replace(cfg, **{k: getattr(args, k) for k in modern.SETTINGS if getattr(args, k) is not None})
    if args.warmup_steps is not None:
        cfg = dataclasses.replace(cfg, warmup_steps=args.warmup_steps)
    return cfg


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cpu":
        memory.keep_freed_memory(True)  # as train_gpt2.py does on a CPU
    train, val, vocab_size = standard_library_tokens()
    n_val = min(args.val_tokens, len(val) - 1) // args.seq_len * args.seq_len
    val = val[: n_val + 1]
    tokens_per_step = args.batch_size * args.seq_len
    print(f"Python {sys.version.split()[0]} standard library: {len(train):,} training tokens, {n_val:,} validation "
          f"tokens, {vocab_size:,} distinct GPT-2 tokens | {args.n_layer} layers, width {args.n_embd}, "
          f"{tokens_per_step:,} tokens a step, {args.steps} steps, {args.device}")
    results = []
    for seed in args.seeds:
        for recipe in args.recipes:
            cfg = recipe_config(args, recipe, seed, vocab_size)
            losses, step_time = train_recipe(cfg, train, val, args.device, args.eval_every, args.threads)
            settings = {k: getattr(cfg, k) for k in ("max_lr", "warmup_steps")} if recipe == "gpt2" else {
                k: getattr(cfg, k) for k in (*modern.SETTINGS, "warmup_steps")}
            results.append(dict(recipe=recipe, seed=seed, losses=losses, step_ms=1000 * step_time, settings=settings))
            print(f"{recipe:6s} seed {seed}: final val loss {losses[-1][1]:.4f}, {1000 * step_time:.0f} ms/step, "
                  f"{settings}", flush=True)
    print_table(results, tokens_per_step)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=1)


def print_table(results, tokens_per_step):
    """Validation losses by step, a column per run; then, per seed, the modern recipe's share of the GPT-2
    recipe's tokens."""
    names = [f"{r['recipe']} s{r['seed']}" for r in results]
    print("\nstep   tokens   " + "".join(f"{name:>14s}" for name in names))
    by_step = [dict(r["losses"]) for r in results]
    for step in sorted({step for losses in by_step for step in losses}):
        print(f"{step:4d} {step * tokens_per_step:9,d}  " + "".join(
            f"{losses[step]:14.4f}" if step in losses else " " * 14 for losses in by_step))
    for seed in dict.fromkeys(r["seed"] for r in results):
        runs = {r["recipe"]: r for r in results if r["seed"] == seed}
        if set(runs) != {"gpt2", "modern"}:
            continue
        (gpt2_steps, target), modern_final = runs["gpt2"]["losses"][-1], runs["modern"]["losses"][-1][1]
        if not math.isfinite(target):
            print(f"seed {seed}: the GPT-2 recipe diverged at step {gpt2_steps}: lower --max-lr")
            continue
        needed = tokens_to_reach(runs["modern"]["losses"], target, tokens_per_step)
        share = "never" if needed is None else f"{needed / (gpt2_steps * tokens_per_step):.0%} of its tokens"
        print(f"seed {seed}: the modern recipe reaches the GPT-2 recipe's final {target:.4f} in {share}; its own "
              f"final loss is {modern_final:.4f}, {target - modern_final:.3f} lower")


if __name__ == "__main__":
    main()
