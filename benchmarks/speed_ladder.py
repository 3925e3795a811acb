"""
The speed ladder of the GPT-2 lecture, measured on the real trainer, then the speed-ups past it. Each rung runs
train_gpt2.py on random tokens and reads the step times back from its log.jsonl, so it times exactly what a training
run does, with no copy of the training step.

    python benchmarks/speed_ladder.py                                       # GPT-2 124M, T=1024, on the GPU
    python benchmarks/speed_ladder.py --batch-size 32 --lecture-batch-size 8  # a GPU with less memory
    python benchmarks/speed_ladder.py --rungs defaults,full-loss,fp8-head  # the rungs named, in the ladder's order
    python benchmarks/speed_ladder.py --tiny --device cpu --compile-modes   # 2 layers on the CPU: a smoke test only
    python benchmarks/speed_ladder.py --dry-run --device cuda                # any machine: each rung's command, read

The lecture's 7 rungs run at its micro-batch of 16 sequences (--lecture-batch-size), one micro-batch a step, each
adding a speed-up to the rungs before it: the table to compare with its numbers. Past it, at the trainer's 64
(--batch-size), two micro-batches a step: the lecture's settings, the trainer's own defaults (its micro-batch search
included), then on top of the defaults alone, ranked against them with its loss beside theirs, each of what CUDA's
defaults replaced (the full loss, the micro-batch as given), the speed-ups of speedups.py and the compile modes: the
same steps of the same tokens, so a change that keeps the arithmetic keeps the losses.
Last, the modern recipe's step. The compile modes' rungs take minutes each: they run when named in --rungs, or with
--compile-modes.

It prints one row per rung: the micro-batch that trained, the seconds from the trainer's launch to its first step
logged (its start-up, the micro-batch search, compiling), the first step's time (mostly compilation where compile is
on), the median of the timed steps after the warm-up steps (ms, tokens/s, MFU), the peak CUDA memory, the speed-up,
and the loss of the last timed step; and can save them as JSON. Once a rung's steps are logged, its run is stopped:
the final evaluation and checkpoint of the trainer are no part of the measurement, and would only take time.
Rungs whose graphs are the same share inductor's cache on disk (a later one compiles faster).
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

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
sys.path.insert(0, REPO)
from machinery.run_log import flops_per_token, peak_flops  # noqa: E402
from machinery.tokenizer import GPT2_VOCAB  # noqa: E402
from train_gpt2 import GPT, MODEL_SIZES, GPTConfig  # noqa: E402
from train_gpt2 import parse_args as parse_trainer_args  # noqa: E402

TRAINER = os.path.join(REPO, "train_gpt2.py")


class Rung(NamedTuple):
    key: str  # its name in --rungs
    name: str
    settings: Optional[dict]  # train_gpt2.py settings this rung changes; None: the trainer's defaults
    skip_on_cpu: str = ""  # why the rung cannot run, or is not worth running, on a CPU
    kind: str = "lecture"  # lecture: at --lecture-batch-size, its settings kept by the lecture's rungs after it;
    # past: at --batch-size; speed-up: on top of the trainer's defaults alone, ranked against them, losses beside
    # theirs; modern: on top of the defaults, ranked against them
    long: bool = False  # minutes of compiling: only when named in --rungs, or with --compile-modes


COMPILING_ON_CPU = "compiling takes minutes on a CPU"
RUNGS = [  # the lecture's A100 ms/step at B=16, T=1024: 1000, 333, 300, 130, 96, 93, 90
    Rung("fp32", "fp32", dict(dtype="fp32", compile=False, attn="naive", vocab_size=GPT2_VOCAB, fused_adamw=False,
                              loss="full")),
    Rung("tf32", "TF32", dict(dtype="tf32"), skip_on_cpu="needs CUDA: TF32 is a mode of NVIDIA tensor cores"),
    Rung("bf16", "bf16 autocast", dict(dtype="bf16")),
    Rung("compile", "torch.compile", dict(compile=True), skip_on_cpu=COMPILING_ON_CPU),
    Rung("sdpa", "flash attention", dict(attn="sdpa")),
    Rung("vocab", "vocab 50304", dict(vocab_size=50304)),  # the 47 padding ids masked out of the softmax
    Rung("fused-adamw", "fused AdamW", dict(fused_adamw=True),
         skip_on_cpu="needs CUDA: the fused AdamW kernel is CUDA-only"),
    # past the lecture
    Rung("micro-batch", "micro-batch {B}", {}, kind="past"),  # the memory the masked loss frees, spent on a larger B
    Rung("defaults", "trainer defaults", None, kind="past"),
    # each on the defaults alone, ranked against them: a speed-up that wins (+1% tok/s or more, the losses unchanged)
    # becomes a default. First what CUDA's defaults replaced (on a CPU, its defaults already): the full loss, and the
    # micro-batch as given, where the defaults' search goes up from B to 2B, one micro-batch a step
    Rung("full-loss", "full loss", dict(loss="full"), kind="speed-up"),
    Rung("given-batch", "micro-batch as given", dict(grow_batch_size=False), kind="speed-up"),
    Rung("fp8-head", "FP8 head", dict(fp8_head=True), kind="speed-up",
         skip_on_cpu="needs CUDA: a GPU of compute capability 8.9 or later"),
    # the modern recipe's model and optimizers: what a step of it costs (it needs far fewer)
    Rung("modern", "modern recipe", dict(recipe="modern"), kind="modern"),
    # compile options: minutes of autotuning each, so not in the default ladder
    Rung("coordinate-descent", "coordinate descent", dict(coordinate_descent=True), skip_on_cpu=COMPILING_ON_CPU,
         kind="speed-up", long=True),
    Rung("max-autotune", "max-autotune", dict(compile_mode="max-autotune-no-cudagraphs"),
         skip_on_cpu=COMPILING_ON_CPU, kind="speed-up", long=True),
    Rung("cuda-graphs", "CUDA graphs", dict(compile_mode="max-autotune"), skip_on_cpu=COMPILING_ON_CPU,
         kind="speed-up", long=True),
]
KEYS = [rung.key for rung in RUNGS]
MICRO_BATCHES_A_STEP = {"lecture": 1, "past": 2, "speed-up": 2, "modern": 2}

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
    """Runs the trainer until n_steps steps are in its log, then stops it. Returns the step records, the first with
    logged_after_s: the seconds from the launch until it was logged (to the 0.2 s of the polling: imports, set-up,
    the micro-batch search and the first step); or an error string."""
    with open(output, "w") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    launched = time.monotonic()
    deadline, first_logged = launched + timeout, None
    try:
        while process.poll() is None and time.monotonic() < deadline:
            logged = len(read_steps(log_path))
            if logged and first_logged is None:
                first_logged = time.monotonic() - launched
            if logged >= n_steps:
                break
            time.sleep(0.2)
    finally:
        if process.poll() is None:  # its own session: the kill reaches the compile workers it started too
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    steps = read_steps(log_path)
    if len(steps) >= n_steps:
        steps[0]["logged_after_s"] = first_logged if first_logged is not None else time.monotonic() - launched
        return steps
    if time.monotonic() >= deadline:
        return f"timed out after {timeout} s, at {len(steps)} of {n_steps} steps"
    with open(output) as f:
        return last_line(f.read())  # out of memory, or anything else: the row says why, and the ladder goes on


def micro_batch_trained(log_path):
    """The micro-batch of the run's start record (--grow-batch-size may change it)."""
    with open(log_path) as f:
        return next(record["micro_batch"] for record in map(json.loads, f) if "event" in record)


def rung_command(settings, B, micro_batches, args, data_dir, log_dir, fit):
    """The trainer's command for warm-up + timed steps of micro_batches micro-batches of B sequences. fit: the
    trainer's micro-batch search, as its defaults run it; else B itself, or the row says it does not fit."""
    T = args.seq_len
    n_steps = args.warmup_steps + args.timed_steps
    return [
        sys.executable, TRAINER, "--data", data_dir, "--log-dir", log_dir, "--no-resume", "--device", args.device,
        "--n-layer", str(args.n_layer), "--n-head", str(args.n_head), "--n-embd", str(args.n_embd),
        "--batch-size", str(B), *([] if fit else ["--no-fit-batch-size"]),
        "--seq-len", str(T), "--block-size", str(T), "--total-batch-size", str(micro_batches * B * T),
        # one step more than is read: the run is stopped before its final evaluation and checkpoint
        "--max-steps", str(n_steps + 1),
        "--eval-every", "0", "--val-tokens", str(T), "--hellaswag-every", "0", "--core-every", "0",
        "--num-samples", "0", "--checkpoint-every", "0",
        *as_flags(settings),
    ]


def run_rung(settings, B, micro_batches, args, data_dir, log_dir, timeout, fit):
    """Trains as rung_command says; the median timed step, the first step, the micro-batch trained and the last timed
    step's loss as a dict, or an error string."""
    n_steps = args.warmup_steps + args.timed_steps
    command = rung_command(settings, B, micro_batches, args, data_dir, log_dir, fit)
    log_path = os.path.join(log_dir, "log.jsonl")
    steps = train_until_logged(command, log_path, n_steps, log_dir + ".out", timeout)
    if isinstance(steps, str):
        return steps
    timed = [r for r in steps if r["step"] >= args.warmup_steps][: args.timed_steps]
    # the (lower) median step: a step that really happened, so its time, tok/s and MFU agree with each other
    median = sorted(timed, key=lambda r: r["dt_ms"])[(len(timed) - 1) // 2]
    return {"micro_batch": micro_batch_trained(log_path), "ms_per_step": median["dt_ms"],
            "tok_per_sec": median["tok_per_sec"], "mfu": median.get("mfu"),
            "peak_mem_gib": max((r["peak_mem_gb"] for r in steps if "peak_mem_gb" in r), default=None),
            "first_step_s": steps[0]["dt_ms"] / 1000, "launch_s": steps[0]["logged_after_s"],
            "timed_ms": [r["dt_ms"] for r in timed],
            "loss": timed[-1]["train_loss"]}


NAME = "{:<26}"
NUMBERS = "{:>4} {:>7} {:>8} {:>8} {:>10} {:>6} {:>8} {:>8} {:>8} {:>8}"
HEADER = NAME.format("rung") + " " + NUMBERS.format("B", "launch", "1st step", "ms/step", "tok/s", "MFU", "peak GiB",
                                                     "speed-up", "loss", "Δ loss")


def format_numbers(result, speedup, loss_change):
    mfu = f"{100 * result['mfu']:.1f}%" if result["mfu"] is not None else "-"
    mem = f"{result['peak_mem_gib']:.2f}" if result["peak_mem_gib"] is not None else "-"
    loss = f"{result['loss']:.4f}" if result["loss"] is not None else "-"
    return NUMBERS.format(result["micro_batch"], f"{result['launch_s']:.1f} s", f"{result['first_step_s']:.1f} s",
                          f"{result['ms_per_step']:.1f}", f"{result['tok_per_sec']:,.0f}", mfu, mem,
                          f"{speedup:.3f}x" if speedup else "-", loss,
                          f"{loss_change:+.0e}" if loss_change is not None else "-")


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
    parser.add_argument("--rungs", default="", help=f"the rungs to run, by name, comma-separated, in the ladder's "
                        f"order whatever the order given (default: all but the compile modes'): {', '.join(KEYS)}")
    parser.add_argument("--compile-modes", action="store_true",
                        help="also the rungs of torch.compile's tuning (minutes each), after the others")
    parser.add_argument("--rung-timeout", type=int, default=300,
                        help="seconds a rung may take before its row says so (default: 300)")
    parser.add_argument("--time-budget", type=int, default=0,
                        help="seconds for the whole ladder: a rung starts only while some are left, and stops when "
                             "they are spent (default: 0, none)")
    parser.add_argument("--json", default="", help="also write the table to this JSON file")
    parser.add_argument("--dry-run", action="store_true", help="print each rung's command, its flags read by the "
                                                              "trainer's parser; run none")
    args = parser.parse_args(argv)
    preset = {**MODEL_SIZES[args.model], **DEFAULTS} if not args.tiny else TINY
    for name, value in preset.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    for name in ("batch_size", "lecture_batch_size", "seq_len", "timed_steps", "rung_timeout"):
        if getattr(args, name) <= 0:
            parser.exit(2, f"error: --{name.replace('_', '-')} must be positive, not {getattr(args, name)}\n")
    for name in ("warmup_steps", "time_budget"):
        if getattr(args, name) < 0:
            parser.exit(2, f"error: --{name.replace('_', '-')} must be zero or more, not {getattr(args, name)}\n")
    named = [key for key in args.rungs.split(",") if key]
    unknown = [key for key in named if key not in KEYS]
    if unknown:
        parser.exit(2, f"error: --rungs {','.join(unknown)}: no such rung; the rungs are {', '.join(KEYS)}\n")
    args.rungs = named or [rung.key for rung in RUNGS if args.compile_modes or not rung.long]
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available() and not args.dry_run:
        parser.exit(2, "error: --device cuda, but PyTorch sees no CUDA GPU; use --device cpu (with --tiny)\n")
    return args


def main(argv=None):
    args = parse_args(argv)
    T, start = args.seq_len, time.perf_counter()
    deadline = start + args.time_budget if args.time_budget else float("inf")
    print(f"speed ladder: {args.n_layer} layers, {args.n_head} heads, width {args.n_embd}, T={T} on {args.device}; "
          f"median of {args.timed_steps} steps after {args.warmup_steps} warm-up steps")
    if not args.dry_run:
        print(HEADER)
    rows, lecture_settings, previous, defaults = [], {}, None, None
    with tempfile.TemporaryDirectory(prefix="speed_ladder_") as tmp:
        data_dir = os.path.join(tmp, "data")
        os.makedirs(data_dir)
        most_sequences = max(args.lecture_batch_size, 2 * args.batch_size)  # a step's, of any rung
        write_random_shards(data_dir, (args.warmup_steps + args.timed_steps + 1) * most_sequences * T + 1, T + 1)
        for number, rung in enumerate(RUNGS, 1):
            B = args.lecture_batch_size if rung.kind == "lecture" else args.batch_size
            name = f"{number}. {rung.name.format(B=B)}"
            row = {"rung": name, "key": rung.key, "batch_size": B, "settings": rung.settings}
            skipped = rung.skip_on_cpu if args.device == "cpu" else ""
            # kept by the lecture's rungs after it, run or not; not those of a rung the CPU cannot run
            if rung.kind == "lecture" and not skipped:
                lecture_settings = {**lecture_settings, **rung.settings}
            if rung.key not in args.rungs:
                continue
            if not skipped and time.perf_counter() >= deadline:
                skipped = f"no time left of --time-budget {args.time_budget} s"
            if skipped:
                print(NAME.format(name), f"skipped: {skipped}", flush=True)
                rows.append({**row, "status": "skipped", "reason": skipped})
                save(args, rows, time.perf_counter() - start)
                continue
            print(NAME.format(name), end=" ", flush=True)  # the rung's name shows while it runs
            if rung.settings is None:
                settings = {}  # the trainer's own defaults
            else:
                settings = lecture_settings if rung.kind in ("lecture", "past") else rung.settings
            timeout = max(1, int(min(args.rung_timeout, deadline - time.perf_counter())))
            command_args = (settings, B, MICRO_BATCHES_A_STEP[rung.kind], args, data_dir,
                            os.path.join(tmp, f"log_{number}"))
            fit = rung.kind not in ("lecture", "past") or rung.settings is None
            if args.dry_run:
                command = rung_command(*command_args, fit)
                parse_trainer_args(command[2:])  # exits on a flag the trainer does not take
                print("dry run: python train_gpt2.py", " ".join(command[2:]), flush=True)
                continue
            result = run_rung(*command_args, timeout, fit)
            if isinstance(result, str):
                print(f"failed: {result[:120]}", flush=True)
                rows.append({**row, "status": "failed", "reason": result, "flags": as_flags(settings)})
                save(args, rows, time.perf_counter() - start)
                continue
            base = defaults if rung.kind in ("speed-up", "modern") else previous  # tokens/s: the batch may change
            speedup = result["tok_per_sec"] / base["tok_per_sec"] if base else None
            loss_change = (result["loss"] - defaults["loss"] if rung.kind == "speed-up" and defaults
                           and None not in (result["loss"], defaults["loss"]) else None)
            print(format_numbers(result, speedup, loss_change), flush=True)
            rows.append({**row, "status": "ok", "flags": as_flags(settings), **result, "speedup": speedup,
                         "loss_change": loss_change})
            save(args, rows, time.perf_counter() - start)
            if rung.kind in ("lecture", "past"):
                previous = result
            if rung.key == "defaults":
                defaults = result

    if args.dry_run:
        return
    with torch.device("meta"):  # the shapes alone
        model = GPT(GPTConfig(T, GPT2_VOCAB, args.n_layer, args.n_head, args.n_embd))
    peak = peak_flops("cuda") if args.device == "cuda" else None
    print("speed-up: tokens/s over the previous rung that ran, the speed-ups' and the modern recipe's over the "
          "trainer's defaults; launch: seconds from the trainer's launch to its first step logged (imports, set-up, "
          "the micro-batch search, compiling); 1st step: its time, mostly compilation where compile is on; loss: of "
          "the last timed step, and (Δ) its change from the defaults' at that step")
    print(f"MFU = (6N + 12*L*H*Q*T) flops per token x tokens per step / step time / the GPU's dense bf16 peak"
          f"{f' ({peak / 1e12:.0f} TFLOPS)' if peak else ' (no GPU with a known peak here: no MFU)'}; "
          f"N = parameters but the position embedding: {flops_per_token(model, T) / 1e9:.3g} GFLOP per token here")
    wall = time.perf_counter() - start
    save(args, rows, wall)
    print(f"{device_name(args)} | torch {torch.__version__} | T={T}, B as in each row | the ladder took {wall:.0f} s")


def device_name(args):
    return torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"


def save(args, rows, wall):
    """The rows so far to --json, if given: after each rung, so that a ladder stopped midway keeps what it measured."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name(args), "torch": torch.__version__, "batch_size": args.batch_size,
                       "lecture_batch_size": args.lecture_batch_size, "seq_len": args.seq_len,
                       "n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd,
                       "warmup_steps": args.warmup_steps, "timed_steps": args.timed_steps, "wall_s": wall,
                       "rungs": rows}, f, indent=2)


if __name__ == "__main__":
    main()
