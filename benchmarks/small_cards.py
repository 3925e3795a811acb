"""
The default GPT-2 124M run on this GPU whole, then with its memory capped to that of smaller cards (a 40 GB A100, a
24 GB RTX 3090/4090, by torch.cuda.set_per_process_memory_fraction): each run finds its micro-batch (microbatch.py)
and trains a few steps of random tokens. A row for each: the micro-batch chosen, how long finding it took (mostly
torch.compile compiling each size tried), the first step's time, the median tok/s of the steps after it, and the
peak memory (torch.cuda.max_memory_allocated). With --history PATH, the first run's steps are recorded
(torch.cuda.memory._record_memory_history), the snapshot is written to PATH (for https://pytorch.org/memory_viz),
and the largest blocks alive at its peak are listed by the line that allocated them: where the step's memory goes.

    python benchmarks/small_cards.py                                  # the whole card, 37 GiB, 22 GiB; 10 steps each
    python benchmarks/small_cards.py --caps 0 --steps 3 --history memory.pickle   # where the default step's memory goes
    python benchmarks/small_cards.py --caps 22 -- --recipe modern     # flags after -- go to train_gpt2.py
    python benchmarks/small_cards.py --dry-run -- --recipe modern     # any machine: each run's command, its flags read
"""

import argparse
import collections
import json
import os
import pickle
import re
import runpy
import statistics
import subprocess
import sys
import tempfile

import torch

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from speed_ladder import read_steps, write_random_shards  # noqa: E402

TRAINER = os.path.join(REPO, "train_gpt2.py")
GIB = 2**30
CARDS = {37.0: "a 40 GB A100", 22.0: "a 24 GB RTX 3090/4090"}  # what their drivers leave to a process, about
SEARCH_LINE = re.compile(r"^micro-batch (\d+), as .* found in ([\d.]+) s", re.M)


def trainer_args(data_dir, log_dir, steps, extra):
    """The default run, on random shards, for steps steps, with no evaluation but the final one."""
    return ["--data", data_dir, "--log-dir", log_dir, "--no-resume", "--max-steps", str(steps), "--eval-every", "0",
            "--hellaswag-every", "0", "--core-every", "0", "--num-samples", "0", "--checkpoint-every", "0",
            "--val-tokens", "8192", *extra]


def print_runs(args):
    """Each run's command, as measure runs it, once train_gpt2.py's parser has read its flags (exiting on a bad one)."""
    import train_gpt2

    for gib in args.caps:
        flags = trainer_args("DATA", f"LOG_{gib:g}", args.steps, args.trainer_args)
        train_gpt2.parse_args(flags)
        print(f"{'the whole card' if not gib else f'{gib:g} GiB'}: python train_gpt2.py {' '.join(flags)}")


def run_capped(gib, history, args):
    """In this process: the CUDA memory capped to gib GiB (0: the whole card), the memory history recorded if history
    names a file, then train_gpt2.py with args, as `python train_gpt2.py ARGS` runs it."""
    if gib:
        torch.cuda.set_per_process_memory_fraction(gib * GIB / torch.cuda.get_device_properties(0).total_memory)
    if history:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    sys.argv = [TRAINER, *args]
    try:
        runpy.run_path(TRAINER, run_name="__main__")
    finally:
        if history:
            torch.cuda.memory._dump_snapshot(history)


def measure(gib, data_dir, work, args, history=""):
    """The row of one run: {"cap_gib", "micro_batch", "search_s", "first_step_s", "tok_per_sec", "mfu" (None where
    the GPU's peak is unknown), "peak_gib"}, or {"cap_gib", "failed": its last lines}."""
    log_dir = os.path.join(work, f"log_{gib:g}")
    command = [sys.executable, __file__, "--run-capped", str(gib), "--history", history, "--",
               *trainer_args(data_dir, log_dir, args.steps, args.trainer_args)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    steps = read_steps(os.path.join(log_dir, "log.jsonl"))
    if result.returncode != 0 or not steps:
        return {"cap_gib": gib, "failed": "\n".join((result.stdout + result.stderr).strip().splitlines()[-8:])}
    found = SEARCH_LINE.search(result.stdout)
    with open(os.path.join(log_dir, "log.jsonl")) as f:
        start = next(json.loads(line) for line in f if '"event"' in line)
    later = steps[1:] or steps  # the first step compiles
    return {"cap_gib": gib, "micro_batch": start["micro_batch"], "search_s": float(found.group(2)) if found else None,
            "first_step_s": steps[0]["dt_ms"] / 1000,
            "tok_per_sec": statistics.median_low([r["tok_per_sec"] for r in later]),
            "mfu": statistics.median_low([r["mfu"] for r in later]) if all("mfu" in r for r in later) else None,
            "peak_gib": max(r.get("peak_mem_gb", 0) for r in steps)}


def table(rows):
    lines = [f"{'memory':<32} {'micro-batch':>11} {'search s':>9} {'1st step s':>10} {'tok/s':>10} {'MFU':>6} "
             f"{'peak GiB':>9}"]
    for row in rows:
        name = "the whole card" if not row["cap_gib"] else f"{row['cap_gib']:g} GiB ({CARDS.get(row['cap_gib'], '')})"
        if "failed" in row:
            lines.append(f"{name:<32} failed:\n{row['failed']}")
            continue
        search = "-" if row["search_s"] is None else f"{row['search_s']:.1f}"  # none when --batch-size fit at once
        mfu = "-" if row.get("mfu") is None else f"{100 * row['mfu']:.1f}%"  # none where the GPU's peak is unknown
        lines.append(f"{name:<32} {row['micro_batch']:>11} {search:>9} {row['first_step_s']:>10.1f} "
                     f"{row['tok_per_sec']:>10,.0f} {mfu:>6} {row['peak_gib']:>9.2f}")
    return lines


# -----------------------------------------------------------------------------
# Where the memory goes: the blocks alive at the peak of a recorded history


def where_allocated(frames, repo=REPO):
    """The line that allocated a block, in words: the deepest frame of this repository's files (the trainer's line),
    else the first frame with a file name (torch's own, inside a compiled graph, say)."""
    ours = [frame for frame in frames if frame.get("filename", "").startswith(repo)]
    frame = (ours or [frame for frame in frames if frame.get("filename")] or [{}])[0]
    if not frame:
        return "(no frames recorded)"
    return f"{os.path.relpath(frame['filename'], repo) if ours else frame['filename']}:{frame['line']} {frame['name']}"


def blocks_at_peak(snapshot, device=0):
    """(peak bytes, [(bytes, where allocated, how many blocks)] of the blocks alive at the peak, largest first) of a
    torch.cuda.memory._snapshot(): its device trace replayed, alloc by alloc and free by free."""
    trace = snapshot["device_traces"][device]
    live, now, peak, peak_at = {}, 0, 0, 0
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            now += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            now -= live.pop(event["addr"])["size"]
        if now > peak:
            peak, peak_at = now, i
    live = {}
    for event in trace[:peak_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    by_line = collections.defaultdict(lambda: [0, 0])
    for event in live.values():
        line = by_line[where_allocated(event.get("frames", []))]
        line[0] += event["size"]
        line[1] += 1
    return peak, sorted(((size, where, count) for where, (size, count) in by_line.items()), reverse=True)


def peak_lines(snapshot, top=15):
    peak, blocks = blocks_at_peak(snapshot)
    lines = [f"alive at the peak of the recorded history, {peak / GIB:.2f} GiB allocated:"]
    lines += [f"{size / GIB:8.2f} GiB in {count:4d} block(s)  {where}" for size, where, count in blocks[:top]]
    return lines


# -----------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caps", type=float, nargs="+", default=[0, 37, 22],
                        help="GiB each run may use, 0 for the whole card (default: 0 37 22)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps of each run (default: 10)")
    parser.add_argument("--history", default="", help="record the first run's memory history and write it here")
    parser.add_argument("--json", default="", help="also write the rows to this JSON file")
    parser.add_argument("--dry-run", action="store_true", help="print each run's command, its flags read by the "
                                                              "trainer's parser; run none")
    parser.add_argument("--run-capped", type=float, default=None, help=argparse.SUPPRESS)  # the child of one run
    parser.add_argument("trainer_args", nargs="*", help="flags for train_gpt2.py, after --")
    args = parser.parse_args(argv)
    if args.run_capped is None and not args.dry_run and not torch.cuda.is_available():
        parser.exit(2, "error: small_cards.py caps a CUDA GPU's memory, and PyTorch sees none here; run it on a GPU "
                       "machine\n")
    if args.steps < 2:
        parser.exit(2, f"error: --steps must be 2 or more (the first compiles), not {args.steps}\n")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.run_capped is not None:
        return run_capped(args.run_capped, args.history, args.trainer_args)
    if args.dry_run:
        return print_runs(args)
    print(f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).total_memory / GIB:.1f} GiB, torch "
          f"{torch.__version__}: train_gpt2.py's defaults, {args.steps} steps of random tokens per run", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="small_cards_") as work:
        data_dir = os.path.join(work, "data")
        os.makedirs(data_dir)
        write_random_shards(data_dir, (args.steps + 1) * 524288 + 1, 8192 + 1025)
        for i, gib in enumerate(args.caps):
            rows.append(measure(gib, data_dir, work, args, args.history if i == 0 else ""))
            print(table(rows)[-1], flush=True)
    print("\n".join(table(rows)))
    if args.history and os.path.exists(args.history):
        with open(args.history, "rb") as f:
            print("\n".join(peak_lines(pickle.load(f))))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
