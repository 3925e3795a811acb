"""
The speed ladder of the GPT-2 lecture, measured on the real trainer, then the steps past it. Each rung adds one
speed-up to the settings of the rungs before it, runs train_gpt2.py on random tokens, and reads the step times back
from its log.jsonl, so it times exactly what a training run does, with no copy of the training step.

    python benchmarks/speed_ladder.py                                       # GPT-2 124M, T=1024, on the GPU
    python benchmarks/speed_ladder.py --batch-size 32 --lecture-batch-size 8  # a GPU with less memory
    python benchmarks/speed_ladder.py --tiny --device cpu                   # 2 layers on the CPU: a smoke test only

The lecture's 7 rungs run at its micro-batch of 16 sequences (--lecture-batch-size), the table to compare with its
numbers; the rungs past it at the trainer's 64 (--batch-size), and the last one is the trainer's own defaults.
It prints one row per rung (the median of the timed steps after the warm-up steps, and the first step's time, which
is mostly compilation) and can save them as JSON. Once a rung's steps are logged, its run is stopped: the final
evaluation and checkpoint of the trainer are no part of the measurement, and would only take time.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple, Optional

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from plumbing import GPT2_VOCAB  # noqa: E402
from reporting import flops_per_token, peak_flops  # noqa: E402
from train_gpt2 import GPT, MODEL_SIZES, GPTConfig  # noqa: E402

TRAINER = os.path.join(REPO, "train_gpt2.py")


class Rung(NamedTuple):
    name: str
    settings: Optional[dict]  # train_gpt2.py settings this rung changes, kept by the rungs after it; None: its defaults
    skip_on_cpu: str = ""  # why the rung cannot run, or is not worth running, on a CPU
    lecture: bool = True  # at --lecture-batch-size, else at --batch-size


COMPILING_ON_CPU = "compiling takes minutes on a CPU"
RUNGS = [  # the lecture's A100 ms/step at B=16, T=1024: 1000, 333, 300, 130, 96, 93, 90
    Rung("fp32", dict(dtype="fp32", compile=False, attn="naive", vocab_size=GPT2_VOCAB, fused_adamw=False)),
    Rung("TF32", dict(dtype="tf32"), skip_on_cpu="needs CUDA: TF32 is a mode of NVIDIA tensor cores"),
    Rung("bf16 autocast", dict(dtype="bf16")),
    Rung("torch.compile", dict(compile=True), skip_on_cpu=COMPILING_ON_CPU),
    Rung("flash attention", dict(attn="sdpa")),
    Rung("vocab 50304", dict(vocab_size=50304)),  # the 47 padding ids masked out of the softmax
    Rung("fused AdamW", dict(fused_adamw=True), skip_on_cpu="needs CUDA: the fused AdamW kernel is CUDA-only"),
    # past the lecture
    Rung("micro-batch {B}", {}, lecture=False),  # the memory the fused, masked loss frees, spent on a larger batch
    Rung("chunked loss", dict(loss="chunked"), lecture=False),
    Rung("trainer defaults", None, lecture=False),
]
COMPILE_MODE_RUNGS = [  # --compile-modes: minutes of autotuning each, so not in the 10-minute ladder
    Rung("max-autotune", dict(compile_mode="max-autotune-no-cudagraphs"), skip_on_cpu=COMPILING_ON_CPU, lecture=False),
    Rung("CUDA graphs", dict(compile_mode="max-autotune"), skip_on_cpu=COMPILING_ON_CPU, lecture=False),
]
# last, on top of all the rest: the modern recipe's model and optimizers, what a step of it costs
MODERN_RUNG = Rung("modern recipe", dict(recipe="modern"), lecture=False)

TINY = dict(n_layer=2, n_head=2, n_embd=32, batch_size=8, lecture_batch_size=4, seq_len=32, warmup_steps=1,
            timed_steps=2)
DEFAULTS = dict(batch_size=64, lecture_batch_size=16, seq_len=1024, warmup_steps=3, timed_steps=10)


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
    for name, n in (("synthetic_train_000001.npy", n_train), ("synthetic_val_000000.npy", n_val)):
        np.save(os.path.join(data_dir, name), rng.integers(0, GPT2_VOCAB, n, dtype=np.uint16))


def last_line(text):
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def read_steps(log_path):
    if not os.path.exists(log_path):
        return []
    with open(log_path) as f:
        lines = f.read().split("\n")[:-1]  # whole lines only: the last one may be half-written
    return [r for r in map(json.loads, lines) if "dt_ms" in r]


def train_until_logged(command, log_path, n_steps, output, timeout):
    """Runs the trainer until n_steps steps are in its log, then stops it. Returns the step records, or an error
    string."""
    with open(output, "w") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while process.poll() is None and len(read_steps(log_path)) < n_steps and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        if process.poll() is None:  # its own session: the kill reaches the compile workers it started too
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    steps = read_steps(log_path)
    if len(steps) >= n_steps:
        return steps
    if time.monotonic() >= deadline:
        return f"timed out after {timeout} s, at {len(steps)} of {n_steps} steps"
    with open(output) as f:
        return last_line(f.read())  # out of memory, or anything else: the row says why, and the ladder goes on


def run_rung(settings, B, args, data_dir, log_dir):
    """Trains for warm-up + timed steps at micro-batch B; the median timed step and the first step as a dict, or an
    error string."""
    T = args.seq_len
    n_steps = args.warmup_steps + args.timed_steps
    command = [
        sys.executable, TRAINER, "--data", data_dir, "--log-dir", log_dir, "--no-resume", "--device", args.device,
        "--n-layer", str(args.n_layer), "--n-head", str(args.n_head), "--n-embd", str(args.n_embd),
        "--batch-size", str(B), "--no-fit-batch-size",  # B itself, or the row says it does not fit
        "--seq-len", str(T), "--block-size", str(T), "--total-batch-size", str(B * T),
        # one step more than is read: the run is stopped before its final evaluation and checkpoint
        "--max-steps", str(n_steps + 1),
        "--eval-every", "0", "--val-tokens", str(T), "--hellaswag-every", "0", "--core-every", "0",
        "--num-samples", "0", "--checkpoint-every", "0",
        *as_flags(settings),
    ]
    steps = train_until_logged(command, os.path.join(log_dir, "log.jsonl"), n_steps, log_dir + ".out",
                               args.rung_timeout)
    if isinstance(steps, str):
        return steps
    timed = [r for r in steps if r["step"] >= args.warmup_steps][: args.timed_steps]
    # the (lower) median step: a step that really happened, so its time, tok/s and MFU agree with each other
    median = sorted(timed, key=lambda r: r["dt_ms"])[(len(timed) - 1) // 2]
    return {"ms_per_step": median["dt_ms"], "tok_per_sec": median["tok_per_sec"], "mfu": median.get("mfu"),
            "peak_mem_gb": max((r["peak_mem_gb"] for r in steps if "peak_mem_gb" in r), default=None),
            "first_step_s": steps[0]["dt_ms"] / 1000, "timed_ms": [r["dt_ms"] for r in timed]}


NAME = "{:<22}"
NUMBERS = "{:>4} {:>10} {:>10} {:>12} {:>7} {:>9} {:>9}"


def format_numbers(B, result, speedup):
    mfu = f"{100 * result['mfu']:.1f}%" if result["mfu"] is not None else "-"
    mem = f"{result['peak_mem_gb']:.1f} GB" if result["peak_mem_gb"] is not None else "-"
    return NUMBERS.format(B, f"{result['first_step_s']:.1f} s", f"{result['ms_per_step']:.1f}",
                          f"{result['tok_per_sec']:,.0f}", mfu, mem, f"{speedup:.2f}x" if speedup else "-")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: cuda if there is a GPU (default: auto)")
    parser.add_argument("--tiny", action="store_true",
                        help=f"a 2-layer model and tiny batches, for a CPU smoke test: {TINY}")
    parser.add_argument("--model", default="gpt2", choices=list(MODEL_SIZES), help="model size (default: gpt2, 124M)")
    parser.add_argument("--lecture-batch-size", type=int,
                        help=f"B of the lecture's rungs (default: {DEFAULTS['lecture_batch_size']}, the lecture's)")
    parser.add_argument("--batch-size", type=int, help=f"B of the rungs past the lecture (default: "
                        f"{DEFAULTS['batch_size']}, the trainer's; lower it for a smaller GPU)")
    parser.add_argument("--seq-len", type=int, help=f"T, tokens per sequence (default: {DEFAULTS['seq_len']})")
    parser.add_argument("--warmup-steps", type=int, help=f"untimed steps first, the first of them compiling (default: "
                        f"{DEFAULTS['warmup_steps']})")
    parser.add_argument("--timed-steps", type=int,
                        help=f"steps whose median is reported (default: {DEFAULTS['timed_steps']})")
    parser.add_argument("--compile-modes", action="store_true",
                        help="also torch.compile's max-autotune modes, after the defaults (minutes each)")
    parser.add_argument("--rung-timeout", type=int, default=300,
                        help="seconds a rung may take before its row says so (default: 300)")
    parser.add_argument("--json", default="", help="also write the table to this JSON file")
    args = parser.parse_args(argv)
    preset = {**MODEL_SIZES[args.model], **DEFAULTS} if not args.tiny else TINY
    for name, value in preset.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    for name in ("batch_size", "lecture_batch_size", "seq_len", "timed_steps", "rung_timeout"):
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
    T, start = args.seq_len, time.perf_counter()
    rungs = RUNGS + (COMPILE_MODE_RUNGS if args.compile_modes else []) + [MODERN_RUNG]
    print(f"speed ladder: {args.n_layer} layers, {args.n_head} heads, width {args.n_embd}, T={T} on {args.device}; "
          f"median of {args.timed_steps} steps after {args.warmup_steps} warm-up steps")
    print(NAME.format("rung"), NUMBERS.format("B", "1st step", "ms/step", "tok/s", "MFU", "peak mem", "speed-up"))
    rows, settings, previous = [], {}, None
    with tempfile.TemporaryDirectory(prefix="speed_ladder_") as tmp:
        data_dir = os.path.join(tmp, "data")
        os.makedirs(data_dir)
        steps_of_tokens = (args.warmup_steps + args.timed_steps + 1) * max(args.batch_size, args.lecture_batch_size)
        write_random_shards(data_dir, steps_of_tokens * T + 1, T + 1)
        for number, rung in enumerate(rungs, 1):
            B = args.lecture_batch_size if rung.lecture else args.batch_size
            name = rung.name.format(B=B)
            print(NAME.format(f"{number}. {name}"), end=" ", flush=True)  # the rung's name shows while it runs
            row = {"rung": name, "batch_size": B, "settings": rung.settings}
            # its settings are not applied either, so later rungs run without them
            if args.device == "cpu" and rung.skip_on_cpu:
                print(f"skipped: {rung.skip_on_cpu}", flush=True)
                rows.append({**row, "status": "skipped", "reason": rung.skip_on_cpu})
                continue
            settings = {} if rung.settings is None else {**settings, **rung.settings}
            result = run_rung(settings, B, args, data_dir, os.path.join(tmp, f"log_{number}"))
            if isinstance(result, str):
                print(f"failed: {result[:120]}", flush=True)
                rows.append({**row, "status": "failed", "reason": result, "flags": as_flags(settings)})
                continue
            speedup = result["tok_per_sec"] / previous if previous else None  # tokens/s: the batch may change
            print(format_numbers(B, result, speedup), flush=True)
            rows.append({**row, "status": "ok", "flags": as_flags(settings), **result, "speedup": speedup})
            previous = result["tok_per_sec"]

    with torch.device("meta"):  # the shapes alone
        model = GPT(GPTConfig(T, GPT2_VOCAB, args.n_layer, args.n_head, args.n_embd))
    peak = peak_flops("cuda") if args.device == "cuda" else None
    print("speed-up: tokens/s over the previous rung that ran; 1st step: its time, mostly compilation where compile "
          "is on")
    print(f"MFU = (6N + 12*L*H*Q*T) flops per token x tokens per step / step time / the GPU's dense bf16 peak"
          f"{f' ({peak / 1e12:.0f} TFLOPS)' if peak else ' (no GPU with a known peak here: no MFU)'}; "
          f"N = parameters but the position embedding: {flops_per_token(model, T) / 1e9:.3g} GFLOP per token here")
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    wall = time.perf_counter() - start
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "batch_size": args.batch_size,
                       "lecture_batch_size": args.lecture_batch_size, "seq_len": T, "n_layer": args.n_layer,
                       "n_head": args.n_head, "n_embd": args.n_embd, "warmup_steps": args.warmup_steps,
                       "timed_steps": args.timed_steps,
                       "wall_s": wall, "rungs": rows}, f, indent=2)
    print(f"{device} | torch {torch.__version__} | T={T}, B as in each row | the ladder took {wall:.0f} s")


if __name__ == "__main__":
    main()
