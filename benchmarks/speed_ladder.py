"""
The speed ladder of the GPT-2 lecture, measured on the real trainer. Each rung adds one speed-up to the settings
of the rungs before it, runs train_gpt2.py for a few steps on random tokens, and reads the step times back from
its log.jsonl, so it times exactly what a training run does, with no copy of the training step.

    python benchmarks/speed_ladder.py                       # GPT-2 124M, B=64, T=1024, on the GPU
    python benchmarks/speed_ladder.py --batch-size 16       # a GPU with less memory (and the lecture's batch)
    python benchmarks/speed_ladder.py --tiny --device cpu   # a 2-layer model on the CPU: a smoke test, not a speed claim

It prints one row per rung (the median of the timed steps, after the warm-up steps) and can save them as JSON.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import NamedTuple

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from train_gpt2 import GPT2_VOCAB, MODEL_SIZES, GPTConfig, flops_per_token, peak_flops  # noqa: E402

TRAINER = os.path.join(REPO, "train_gpt2.py")


class Rung(NamedTuple):
    name: str
    settings: dict  # train_gpt2.py settings this rung changes; they stay on for every rung after it
    skip_on_cpu: str = ""  # why the rung cannot run, or is not worth running, on a CPU


RUNGS = [  # the lecture's A100 ms/step at B=16, T=1024: 1000, 333, 300, 130, 96, 93, 90
    Rung("fp32", dict(dtype="fp32", compile=False, attn="naive", vocab_size=GPT2_VOCAB, fused_adamw=False)),
    Rung("TF32", dict(dtype="tf32"), skip_on_cpu="needs CUDA: TF32 is a mode of NVIDIA tensor cores"),
    Rung("bf16 autocast", dict(dtype="bf16")),
    Rung("torch.compile", dict(compile=True), skip_on_cpu="compiling takes minutes on a CPU"),
    Rung("flash attention", dict(attn="sdpa")),
    Rung("vocab 50304", dict(vocab_size=50304)),
    Rung("fused AdamW", dict(fused_adamw=True), skip_on_cpu="needs CUDA: the fused AdamW kernel is CUDA-only"),
]

TINY = dict(n_layer=2, n_head=2, n_embd=64, batch_size=4, seq_len=32, warmup_steps=1, timed_steps=2)
DEFAULTS = dict(batch_size=64, seq_len=1024, warmup_steps=10, timed_steps=20)


def as_flags(settings):
    """{"dtype": "bf16", "compile": False} -> ["--dtype", "bf16", "--no-compile"]"""
    flags = []
    for name, value in settings.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            flags += [f"--{flag}", str(value)]
    return flags


def write_random_shards(data_dir, n_train, n_val, seed=1337):
    """Uniformly random GPT-2 token ids: every step costs the same whatever the tokens are."""
    rng = np.random.default_rng(seed)
    np.save(os.path.join(data_dir, "synthetic_train_000001.npy"), rng.integers(0, GPT2_VOCAB, n_train, dtype=np.uint16))
    np.save(os.path.join(data_dir, "synthetic_val_000000.npy"), rng.integers(0, GPT2_VOCAB, n_val, dtype=np.uint16))


def last_line(text):
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def run_rung(settings, args, data_dir, log_dir):
    """Trains for warm-up + timed steps with these settings; the median timed step as a dict, or an error string."""
    B, T = args.batch_size, args.seq_len
    command = [
        sys.executable, TRAINER, "--data", data_dir, "--log-dir", log_dir, "--no-resume", "--device", args.device,
        "--n-layer", str(args.n_layer), "--n-head", str(args.n_head), "--n-embd", str(args.n_embd),
        "--batch-size", str(B), "--seq-len", str(T), "--block-size", str(T), "--total-batch-size", str(B * T),
        "--max-steps", str(args.warmup_steps + args.timed_steps),
        # the trainer still evaluates (and checkpoints) after its last step: outside the timed steps, and one small batch
        "--eval-every", "0", "--val-tokens", str(T), "--hellaswag-every", "0", "--num-samples", "0", "--checkpoint-every", "0",
        *as_flags(settings),
    ]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:  # out of memory, or anything else: the row says why, and the ladder goes on
        return last_line(result.stderr or result.stdout)
    with open(os.path.join(log_dir, "log.jsonl")) as f:
        records = [json.loads(line) for line in f]
    timed = [r for r in records if "dt_ms" in r and r["step"] >= args.warmup_steps]
    if len(timed) < args.timed_steps:
        return f"only {len(timed)} of {args.timed_steps} timed steps in the log"
    # the (lower) median step: a step that really happened, so its time, tok/s and MFU agree with each other
    median = sorted(timed, key=lambda r: r["dt_ms"])[(len(timed) - 1) // 2]
    return {"ms_per_step": median["dt_ms"], "tok_per_sec": median["tok_per_sec"], "mfu": median.get("mfu"),
            "peak_mem_gb": max((r["peak_mem_gb"] for r in timed if "peak_mem_gb" in r), default=None),
            "timed_ms": [r["dt_ms"] for r in timed]}


NAME = "{:<20}"
NUMBERS = "{:>10} {:>12} {:>7} {:>9} {:>9}"


def format_numbers(result, speedup):
    mfu = f"{100 * result['mfu']:.1f}%" if result["mfu"] is not None else "-"
    mem = f"{result['peak_mem_gb']:.1f} GB" if result["peak_mem_gb"] is not None else "-"
    return NUMBERS.format(f"{result['ms_per_step']:.1f}", f"{result['tok_per_sec']:,.0f}", mfu, mem, f"{speedup:.2f}x" if speedup else "-")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if there is a GPU (default: auto)")
    parser.add_argument("--tiny", action="store_true", help=f"a 2-layer model and a tiny batch, for a CPU smoke test: {TINY}")
    parser.add_argument("--model", default="gpt2", choices=list(MODEL_SIZES), help="model size (default: gpt2, 124M)")
    parser.add_argument("--batch-size", type=int, help=f"B, sequences per step (default: {DEFAULTS['batch_size']}; lower it for a smaller GPU)")
    parser.add_argument("--seq-len", type=int, help=f"T, tokens per sequence (default: {DEFAULTS['seq_len']})")
    parser.add_argument("--warmup-steps", type=int, help=f"untimed steps first, for compilation and warm caches (default: {DEFAULTS['warmup_steps']})")
    parser.add_argument("--timed-steps", type=int, help=f"steps whose median is reported (default: {DEFAULTS['timed_steps']})")
    parser.add_argument("--json", default="", help="also write the table to this JSON file")
    args = parser.parse_args(argv)
    preset = {**MODEL_SIZES[args.model], **DEFAULTS} if not args.tiny else TINY
    for name, value in preset.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    for name in ("batch_size", "seq_len", "timed_steps"):
        if getattr(args, name) <= 0:
            parser.exit(2, f"error: --{name.replace('_', '-')} must be positive, not {getattr(args, name)}\n")
    if args.warmup_steps < 0:
        parser.exit(2, f"error: --warmup-steps must be zero or more, not {args.warmup_steps}\n")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "error: --device cuda, but PyTorch sees no CUDA GPU; use --device cpu (with --tiny)\n")
    return args


def main(argv=None):
    args = parse_args(argv)
    B, T = args.batch_size, args.seq_len
    print(f"speed ladder: {args.n_layer} layers, {args.n_head} heads, width {args.n_embd}, B={B}, T={T} on {args.device}; "
          f"median of {args.timed_steps} steps after {args.warmup_steps} warm-up steps")
    print(NAME.format("rung"), NUMBERS.format("ms/step", "tok/s", "MFU", "peak mem", "speed-up"))
    rows, settings, previous_ms = [], {}, None
    with tempfile.TemporaryDirectory(prefix="speed_ladder_") as tmp:
        write_random_shards(tmp, (args.warmup_steps + args.timed_steps) * B * T + 1, T + 1)
        for number, rung in enumerate(RUNGS, 1):
            print(NAME.format(f"{number}. {rung.name}"), end=" ", flush=True)  # the rung's name shows while it runs
            row = {"rung": rung.name, "settings": rung.settings}
            if args.device == "cpu" and rung.skip_on_cpu:  # its settings are not applied either, so later rungs run without them
                print(f"skipped: {rung.skip_on_cpu}", flush=True)
                rows.append({**row, "status": "skipped", "reason": rung.skip_on_cpu})
                continue
            settings.update(rung.settings)
            result = run_rung(settings, args, tmp, os.path.join(tmp, f"log_{number}"))
            if isinstance(result, str):
                print(f"failed: {result[:120]}", flush=True)
                rows.append({**row, "status": "failed", "reason": result, "flags": as_flags(settings)})
                continue
            speedup = previous_ms / result["ms_per_step"] if previous_ms else None
            print(format_numbers(result, speedup), flush=True)
            rows.append({**row, "status": "ok", "flags": as_flags(settings), **result, "speedup": speedup})
            previous_ms = result["ms_per_step"]

    config = GPTConfig(T, GPT2_VOCAB, args.n_layer, args.n_head, args.n_embd)
    peak = peak_flops("cuda") if args.device == "cuda" else None
    print("speed-up: over the previous rung that ran")
    print(f"MFU = (6N + 12*L*H*Q*T) flops per token x tokens per step / step time / the GPU's dense bf16 peak"
          f"{f' ({peak / 1e12:.0f} TFLOPS)' if peak else ' (no GPU with a known peak here: no MFU)'}; "
          f"N = parameters but the position embedding: {flops_per_token(config, T) / 1e9:.3g} GFLOP per token here")
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    summary = f"{device} | torch {torch.__version__} | batch {B} x {T} = {B * T:,} tokens per step"
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "batch_size": B, "seq_len": T,
                       "n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd,
                       "warmup_steps": args.warmup_steps, "timed_steps": args.timed_steps, "rungs": rows}, f, indent=2)
    print(summary)


if __name__ == "__main__":
    main()
