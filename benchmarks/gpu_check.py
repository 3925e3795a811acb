"""
The calls on a GPU machine, prepared here: what the project needs measured, in order, within --budget seconds (8
minutes), each part in a process of its own, then one table of everything. A part starts only while time is left for
it; what had none is named, for the next call (--parts). The comparison of the recipes at 124M is a call of its own.

    python benchmarks/gpu_check.py --out $OUT             # on one H100: every part but the last, in at most 8 minutes
    python benchmarks/gpu_check.py --parts recipes-124m --budget 300 --out $OUT   # the second call: the recipes
    python benchmarks/gpu_check.py --parts compile-modes --out $OUT   # a later call: what had no time
    python benchmarks/gpu_check.py --cpu                  # any machine, before the GPU call: every part starts
    python benchmarks/gpu_check.py --dry-run              # any machine: the commands, in order

The parts, most needed first (the speed-ups that a call ranked and settled are out of it):
  tests           python -m pytest -q tests/test_cuda.py: the CUDA-only tests (the FP8 head under inductor too)
  ladder          benchmarks/speed_ladder.py: the trainer's defaults against what they replaced, and the FP8 head on
                  them, ranked (5 timed steps)
  modern-peak     benchmarks/small_cards.py --caps 0 -- --recipe modern: the modern recipe's tok/s, MFU and peak memory
  profiles        benchmarks/profile_step.py --recipes modern gpt2: the 10 operations that take the most of each
                  recipe's step, side by side
  core-all        benchmarks/core_speed.py --device cuda: every example, as the end of a run scores it
  compile-modes   benchmarks/speed_ladder.py: the defaults again, coordinate descent, max-autotune, CUDA graphs
                  (minutes of compiling each)
  recipes-124m    benchmarks/recipes_124m.py: GPT-2 124M against the modern recipe on shards of real text, made
                  there (a call of its own, about 5 minutes)
Each part's whole output is written to --out (PART.txt, and the JSON of those that write one). --cpu runs each part's
command as the GPU call would, alone in a fresh process, with the flags that make it a CPU pass: the CUDA tests are
collected and skip, the benchmarks read their flags and inputs and print their plan (--dry-run).
"""

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import NamedTuple

import torch

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
BENCHMARKS = os.path.join(REPO, "benchmarks")
LADDER_STEPS = ["--warmup-steps", "2", "--timed-steps", "5"]  # the first step compiles; 5 timed: a median


class Part(NamedTuple):
    name: str
    seconds: int  # at most, if the budget has them
    command: list  # after `python`; {out} is --out, {inner} the seconds given less the time to stop and report
    what: str
    on_cpu: list = []  # flags added to command by --cpu: a pass of its code on the CPU, or its plan (--dry-run)
    alone: bool = False  # a call of its own: run only where --parts names it


LADDER_PLAN = ["--dry-run", "--device", "cuda"]  # each rung's command for a GPU, read by the trainer's parser
PARTS = [
    Part("tests", 150, ["-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join("tests", "test_cuda.py")],
         "tests/test_cuda.py"),
    Part("ladder", 270, [os.path.join(BENCHMARKS, "speed_ladder.py"), "--rungs",
                         "defaults,full-loss,given-batch,fp8-head", *LADDER_STEPS, "--time-budget", "{inner}",
                         "--json", "{out}/ladder.json"], "ladder", LADDER_PLAN),
    Part("modern-peak", 120, [os.path.join(BENCHMARKS, "small_cards.py"), "--caps", "0", "--steps", "3", "--json",
                              "{out}/modern_peak.json", "--", "--recipe", "modern"], "modern recipe, whole card",
         ["--dry-run"]),
    Part("profiles", 150, [os.path.join(BENCHMARKS, "profile_step.py"), "--top", "10", "--recipes", "modern", "gpt2"],
         "profile", ["--dry-run"]),
    Part("core-all", 180, [os.path.join(BENCHMARKS, "core_speed.py"), "--device", "cuda"], "CORE, every example",
         ["--dry-run"]),
    Part("compile-modes", 600, [os.path.join(BENCHMARKS, "speed_ladder.py"), "--rungs",
                                "defaults,coordinate-descent,max-autotune,cuda-graphs", *LADDER_STEPS,
                                "--time-budget", "{inner}", "--json", "{out}/compile_modes.json"], "compile modes",
         LADDER_PLAN),
    Part("recipes-124m", 300, [os.path.join(BENCHMARKS, "recipes_124m.py"), "--budget", "{inner}", "--out",
                               "{out}/recipes_124m"], "GPT-2 against the modern recipe at 124M", ["--dry-run"],
         alone=True),
]
NAMES = [part.name for part in PARTS]
FIRST_CALL = [part.name for part in PARTS if not part.alone]
LEAST = 30  # seconds: a part is not started with less
STOPPING = 20  # seconds a ladder keeps back from its time to stop its last rung and write its table


def command_of(part, out, seconds, cpu=False):
    """The part's command line; with cpu, its CPU pass (on_cpu's flags before those that go to the trainer)."""
    command = [arg.format(out=out, inner=seconds - STOPPING) for arg in part.command]
    if cpu:
        cut = command.index("--") if "--" in command else len(command)
        command[cut:cut] = part.on_cpu
    return [sys.executable, *command]


def json_written(part, out):
    """The JSON file that part writes (its --json), or None."""
    return part.command[part.command.index("--json") + 1].format(out=out) if "--json" in part.command else None


def run_part(part, out, seconds, cpu=False):
    """Runs part for at most seconds, then interrupts it (as Ctrl-C does: a ladder stops the trainer it started);
    its status ('done', 'failed: exit N', 'timed out'), seconds taken and output. An earlier call's JSON in out goes
    first: the table is of this call's."""
    if json_written(part, out) and os.path.exists(json_written(part, out)):
        os.remove(json_written(part, out))
    started = time.monotonic()
    process = subprocess.Popen(command_of(part, out, seconds, cpu), cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=seconds)
        status = "done" if process.returncode == 0 else f"failed: exit {process.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGINT)
        try:
            output, _ = process.communicate(timeout=STOPPING)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
        status = "timed out"
    with open(os.path.join(out, f"{part.name}.txt"), "w") as f:
        f.write(output)
    return status, time.monotonic() - started, output


def ladder_rows(path):
    """[(what, result)] of a speed ladder's JSON: a row a rung."""
    with open(path) as f:
        rungs = json.load(f)["rungs"]
    rows = []
    for rung in rungs:
        if rung["status"] != "ok":
            rows.append((rung["rung"], f"{rung['status']}: {rung['reason'][:150]}"))
            continue
        mfu = f"MFU {100 * rung['mfu']:.1f}%" if rung["mfu"] is not None else "MFU -"
        peak = f"{rung['peak_mem_gib']:.2f} GiB" if rung["peak_mem_gib"] is not None else "- GiB"
        ranked = f" | {rung['speedup']:.3f}x" if rung.get("speedup") else ""
        change = f" ({rung['loss_change']:+.1e})" if rung.get("loss_change") is not None else ""
        rows.append((rung["rung"], f"B {rung['micro_batch']} | {rung['tok_per_sec']:,.0f} tok/s{ranked} | {mfu} | "
                                   f"{peak} | launch {rung['launch_s']:.0f} s, 1st step {rung['first_step_s']:.1f} s | "
                                   f"loss {rung['loss']:.4f}{change}"))
    return rows


def result_rows(part, status, output, out):
    """[(what, result)]: what part measured, from its output and JSON; else its status and last line."""
    last = next((line for line in reversed(output.splitlines()) if line.strip()), "no output")
    try:
        if part.name in ("ladder", "compile-modes"):
            rows = ladder_rows(json_written(part, out))
            return [(f"{part.what}: {what}", result) for what, result in rows] + (
                [(part.what, f"{status}: {last[:150]}")] if status != "done" else [])
        if part.name == "tests":
            return [(part.what, last if status == "done" else f"{status}: {last[:150]}")]
        if part.name.startswith("core"):
            ours = next(line for line in output.splitlines() if line.startswith("ours,"))
            return [(part.what, ours if status == "done" else f"{status}: {ours}")]
        if part.name == "profiles":  # a line of each recipe's, at its end
            lines = [line for line in output.splitlines() if re.match(r"\w+: [\d.]+ ms a step; ", line)]
            summaries = dict.fromkeys(lines)  # printed after each table, then together at the end: a row each
            rows = [(f"{part.what}, {line.split(':')[0]}", line.split(": ", 1)[1][:300]) for line in summaries]
            return rows + ([(part.what, f"{status}: {last[:150]}")] if status != "done" or not rows else [])
        if part.name == "recipes-124m":  # its last line sums it up
            return [(part.what, last[:300] if status == "done" else f"{status}: {last[:150]}")]
        with open(json_written(part, out)) as f:
            row = json.load(f)["rows"][0]
        mfu = "MFU -" if row["mfu"] is None else f"MFU {100 * row['mfu']:.1f}%"
        return [(part.what, f"B {row['micro_batch']} | {row['tok_per_sec']:,.0f} tok/s | {mfu} | "
                            f"{row['peak_gib']:.2f} GiB | 1st step {row['first_step_s']:.1f} s")]
    except (OSError, ValueError, KeyError, IndexError, StopIteration):  # none written: the run's last line says why
        return [(part.what, f"{status}: {last[:150]}")]


def commit():
    """The checkout's commit, or 'unknown' (a copy of the tree with no .git, or no git)."""
    try:
        found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    except OSError:
        return "unknown"
    return found.stdout.strip() or "unknown"


def table(rows, header):
    width = max(len(what) for what, _ in rows)
    return [header] + [f"{what:<{width}}  {result}" for what, result in rows]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(FIRST_CALL), help=f"those to run, in this order: "
                        f"{', '.join(NAMES)} (default: all but {', '.join(sorted(set(NAMES) - set(FIRST_CALL)))}, "
                        f"a call of its own)")
    parser.add_argument("--budget", type=int, default=480, help="seconds for them all (default: 480, 8 minutes)")
    parser.add_argument("--out", default="gpu_check_out", help="where each part's output goes (default: "
                                                               "gpu_check_out/)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run none")
    parser.add_argument("--cpu", action="store_true", help="run each part's CPU pass: a check, on any machine, that "
                                                          "every part starts and runs as far as a CPU can take it")
    args = parser.parse_args(argv)
    args.parts = [name for name in args.parts.split(",") if name]
    unknown = [name for name in args.parts if name not in NAMES]
    if unknown:
        parser.exit(2, f"error: --parts {','.join(unknown)}: no such part; the parts are {', '.join(NAMES)}\n")
    if args.budget < LEAST:
        parser.exit(2, f"error: --budget {args.budget}: a part needs {LEAST} s at least\n")
    if not (args.dry_run or args.cpu) and not torch.cuda.is_available():
        parser.exit(2, "error: gpu_check.py measures a CUDA GPU, and PyTorch sees none here; --dry-run lists its "
                       "commands\n")
    return args


def main(argv=None):
    args = parse_args(argv)
    parts = [part for part in PARTS if part.name in args.parts]
    if args.dry_run:
        for part in parts:
            print(f"{part.name} (at most {part.seconds} s): "
                  f"{' '.join(command_of(part, args.out, part.seconds, args.cpu))}")
        return
    os.makedirs(args.out, exist_ok=True)
    started = time.monotonic()
    deadline = started + args.budget
    rows = []
    for part in parts:
        seconds = int(min(part.seconds, deadline - time.monotonic()))
        if seconds < LEAST:
            rows.append((part.what, f"not run: no time left of --budget {args.budget} s (--parts {part.name})"))
            continue
        print(f"{part.name}: up to {seconds} s", flush=True)
        status, took, output = run_part(part, args.out, seconds, args.cpu)
        print(output, flush=True)
        rows += [(what, f"{result} [{took:.0f} s]" if i == 0 else result)
                 for i, (what, result) in enumerate(result_rows(part, status, output, args.out))]
    device = "CPU pass" if args.cpu else torch.cuda.get_device_name()
    header = (f"{device}, torch {torch.__version__}, commit {commit()}, "
              f"{datetime.date.today()}: {time.monotonic() - started:.0f} s of --budget {args.budget}")
    lines = table(rows, header)
    with open(os.path.join(args.out, "table.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
