"""
GPT-2 124M against the modern recipe at the same size (--recipe modern: 12 layers, width 768), each trained by
train_gpt2.py as a user runs it, on the same batches of real text: shards that fineweb.py makes from the Python
packages installed on this machine, so that a GPU machine with no internet can run it. Made for one call of about 5
minutes on an H100 or H200 (--budget).

    python benchmarks/recipes_124m.py --out $OUT             # one GPU: text, shards, then each recipe, in 300 s
    python benchmarks/recipes_124m.py --dry-run              # any machine: the commands, in order
    python benchmarks/recipes_124m.py --cpu --out /tmp/r124  # any machine: the whole path at a tiny size

It prints each recipe's validation loss against tokens and against seconds of training, its tok/s, and the tokens
and seconds the modern recipe needs to reach GPT-2's final validation loss. --out keeps each command's output, both
logs and recipes_124m.json; the text, shards and checkpoints (2 GB or more) go in a temporary folder (--work).

Both recipes train with their own defaults but for the run's length: --steps steps of --total-batch-size tokens,
GPT-2's warmup a tenth of them (the modern recipe has none), at micro-batch 64 as given (the search for it compiles
several sizes: half a minute of a short call). Flags after -- go to both trainers.
"""

import argparse
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from recipes import first_reached  # noqa: E402
from speed_ladder import as_flags  # noqa: E402

from machinery.shard_files import open_shard, shard_paths  # noqa: E402

RECIPES = ["gpt2", "modern"]
TEXT_SUFFIXES = (".py", ".pyi", ".md", ".rst", ".txt")
LARGEST_FILE = 1_000_000  # bytes: larger files are generated tables and stubs more than code or prose
BYTES_PER_TOKEN = 5  # text written a token needed: Python's sources take 2.2, English prose 4 to 5: enough for either
JSONL_BYTES = 16_000_000  # a jsonl file's text: several files, so that fineweb.py's workers share them
STOPPING = 20  # seconds a stopped trainer is given to save its checkpoint and exit
GPU_DEFAULTS = dict(steps=200, total_batch_size=131072, evals=10, val_tokens=1048576)
CPU_DEFAULTS = dict(steps=16, total_batch_size=1024, evals=4, val_tokens=4096)
GPU_RUN = dict(batch_size=64, fit_batch_size=False, grow_batch_size=False)
CPU_RUN = dict(device="cpu", compile=False, n_layer=2, n_head=2, n_embd=64, block_size=64, seq_len=64, batch_size=8)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="recipes_124m_out", help="where the outputs, logs and results go")
    parser.add_argument("--work", help="where the text, shards and checkpoints go, in a folder removed at the end "
                        "(default: the system's temporary directory)")
    parser.add_argument("--steps", type=int, help="optimizer steps of each recipe (default: 200; 16 with --cpu)")
    parser.add_argument("--total-batch-size", type=int, help="tokens a step (default: 131072, two micro-batches of "
                        "64 x 1024: GPT-2's 524288 leaves few steps to compare in a short call; 1024 with --cpu)")
    parser.add_argument("--evals", type=int, help="validations after step 0 (default: 10; 4 with --cpu)")
    parser.add_argument("--val-tokens", type=int, help="validation tokens (default: 1048576; 4096 with --cpu)")
    parser.add_argument("--budget", type=int, default=300, help="seconds for it all; a recipe still training when "
                        "its share is spent is stopped, and its curve so far reported (default: 300)")
    parser.add_argument("--workers", type=int, default=0, help="fineweb.py's tokenizer processes (default: all cores)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run none")
    parser.add_argument("--cpu", action="store_true", help="the whole path on a CPU at a tiny size: 2 layers, width "
                        "64, on the CPU defaults above")
    args, trainer_flags = parser.parse_known_args(argv)
    if trainer_flags[:1] == ["--"]:
        trainer_flags = trainer_flags[1:]
    elif trainer_flags:
        parser.error(f"unrecognized arguments: {' '.join(trainer_flags)} (flags for train_gpt2.py go after --)")
    for name, value in (CPU_DEFAULTS if args.cpu else GPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("steps", "total_batch_size", "evals", "val_tokens"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.work and not os.path.isdir(args.work):
        parser.error(f"--work {args.work}: no such directory; make it, or leave --work out for a temporary one")
    if args.budget <= 2 * STOPPING:
        parser.error(f"--budget {args.budget}: give it more than {2 * STOPPING} s (a stopped trainer has {STOPPING})")
    args.trainer_flags = trainer_flags
    return args


# -----------------------------------------------------------------------------
# The text: this machine's own packages, as jsonl for fineweb.py


def package_folders():
    """The folders of installed packages this Python reads: its site-packages, and a system Python's dist-packages."""
    folders = {sysconfig.get_paths()[name] for name in ("purelib", "platlib")}
    folders |= {path for path in sys.path if os.path.basename(path) in ("site-packages", "dist-packages")}
    return sorted({os.path.realpath(folder) for folder in folders if os.path.isdir(folder)})


def package_files():
    """The source and documentation files of the installed packages, sorted, each once: those of TEXT_SUFFIXES not
    over LARGEST_FILE bytes."""
    paths = set()
    for root in package_folders():
        for folder, _, names in os.walk(root):
            paths |= {os.path.join(folder, name) for name in names if name.endswith(TEXT_SUFFIXES)}
    return sorted(path for path in paths if os.path.isfile(path) and os.path.getsize(path) <= LARGEST_FILE)


def write_text(directory, max_bytes, seed=0):
    """Writes the package files, in an order fixed by seed, as jsonl files of {"text": ...} in directory until
    max_bytes of text; (files, bytes) written. A random order puts files of every package in the validation shard
    (fineweb.py's first), not the packages of the alphabet's start alone."""
    paths = package_files()
    random.Random(seed).shuffle(paths)
    os.makedirs(directory, exist_ok=True)
    files = written = part_bytes = part = 0
    out = open(os.path.join(directory, f"packages_{part:03d}.jsonl"), "w")
    try:
        for path in paths:
            if written >= max_bytes:
                break
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError):  # unreadable, or not UTF-8: not text fineweb.py takes
                continue
            if part_bytes >= JSONL_BYTES:
                out.close()
                part, part_bytes = part + 1, 0
                out = open(os.path.join(directory, f"packages_{part:03d}.jsonl"), "w")
            out.write(json.dumps({"text": text}) + "\n")
            size = len(text.encode())
            files, written, part_bytes = files + 1, written + size, part_bytes + size
    finally:
        out.close()
    return files, written


# -----------------------------------------------------------------------------
# The commands


def shard_tokens(args):
    """(all tokens, the validation shard's): the tokens both recipes train on, once each, and a tenth of the text
    held out, or --val-tokens if more (one more token: the last target)."""
    train = args.steps * args.total_batch_size
    val = max(-(-train // 9), args.val_tokens + 1)  # a ninth, rounded up: the train shards all of its size but the last
    return train + val, val


def text_bytes(args):
    return int(shard_tokens(args)[0] * BYTES_PER_TOKEN)


def training_tokens(shard_dir):
    """The tokens of the train shards fineweb.py wrote in shard_dir, as the trainer lists and reads them."""
    return sum(len(open_shard(path)) for path in shard_paths(shard_dir)[0])


def fineweb_command(args, text_dir, shard_dir):
    tokens, val = shard_tokens(args)
    command = [sys.executable, os.path.join(REPO, "fineweb.py"), "--input", text_dir, "--output", shard_dir,
               "--max-tokens", str(tokens), "--shard-size", str(val)]
    return command + (["--workers", str(args.workers)] if args.workers else [])


def trainer_command(args, recipe, shard_dir, log_dir):
    settings = dict(data=shard_dir, log_dir=log_dir, recipe=recipe, model="gpt2", max_steps=args.steps,
                    total_batch_size=args.total_batch_size, eval_every=max(1, args.steps // args.evals),
                    val_tokens=args.val_tokens, hellaswag_every=0, core_every=0, num_samples=0, checkpoint_every=0)
    if recipe == "gpt2":
        settings["warmup_steps"] = max(1, args.steps // 10)  # the default's 715 is longer than the run
    settings |= CPU_RUN if args.cpu else GPU_RUN
    return [sys.executable, os.path.join(REPO, "train_gpt2.py"), *as_flags(settings), "--no-resume",
            *args.trainer_flags]


def run_command(command, output, timeout):
    """Runs command, its output to the file output, for at most timeout seconds, then stops it as Ctrl-C does (a
    trainer saves and exits); its status: 'done', 'failed: exit N' or 'stopped after N s'. In a session of its own,
    so that the stop reaches the compile workers it starts; this script interrupted (Ctrl-C, or gpu_check.py's part
    out of time) kills it at once, so that no run is left holding the GPU."""
    timeout = max(1, timeout)
    with open(output, "w") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=STOPPING)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        return f"stopped after {timeout:.0f} s"
    except BaseException:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    return "done" if process.returncode == 0 else f"failed: exit {process.returncode}"


# -----------------------------------------------------------------------------
# The curves, from each trainer's log.jsonl


def read_curve(log):
    """{"vals": [(step, tokens, seconds, val loss)], "tok_per_sec", "mfu", "peak_gib"} of a trainer's log.jsonl:
    seconds of training up to each validation, the first step (compiling) counted at the median step's time."""
    with open(log) as f:
        records = [json.loads(line) for line in f.read().split("\n")[:-1]]  # whole lines: a stopped run's may not be
    steps = {r["step"]: r for r in records if "dt_ms" in r}
    if not steps:
        raise ValueError(f"{log} has no training step")
    later = [steps[s] for s in sorted(steps) if s > 0] or [steps[0]]
    median_step = statistics.median(r["dt_ms"] for r in later) / 1000
    step_seconds = [steps[s]["dt_ms"] / 1000 if s in steps and s > 0 else median_step for s in range(max(steps) + 1)]
    seconds = list(itertools.accumulate(step_seconds, initial=0.0))  # seconds[s]: after s steps
    vals = [(r["step"], r["tokens"], seconds[r["step"]], r["val_loss"]) for r in records
            if "val_loss" in r and r["step"] < len(seconds)]

    def of_steps(key, summed_up):
        found = [r[key] for r in later if r.get(key) is not None]
        return summed_up(found) if found else None

    return dict(vals=vals, tok_per_sec=of_steps("tok_per_sec", statistics.median),
                mfu=of_steps("mfu", statistics.median),
                peak_gib=of_steps("peak_mem_gb", max))  # each step's peak is the run's so far


def compare(gpt2, modern):
    """What the modern recipe's curve says against GPT-2's final validation loss: the tokens and seconds it needs
    to reach it (None: not within its run), and its own loss at GPT-2's tokens and seconds (None: not reached)."""
    _, gpt2_tokens, gpt2_seconds, target = gpt2["vals"][-1]
    by_tokens = [(tokens, loss) for _, tokens, _, loss in modern["vals"]]
    by_seconds = [(seconds, loss) for _, _, seconds, loss in modern["vals"]]
    return dict(target=target, tokens=first_reached(by_tokens, target), seconds=first_reached(by_seconds, target),
                gpt2_tokens=gpt2_tokens, gpt2_seconds=gpt2_seconds, loss_at_tokens=loss_at(by_tokens, gpt2_tokens),
                loss_at_seconds=loss_at(by_seconds, gpt2_seconds))


def loss_at(points, x):
    """The loss of points [(x, loss)] at x, interpolated linearly; None past the last point."""
    for (x0, loss0), (x1, loss1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return loss0 + (loss1 - loss0) * (x - x0) / (x1 - x0) if x1 > x0 else loss1
    return points[-1][1] if points and points[-1][0] == x else None


# -----------------------------------------------------------------------------
# The report


def report(curves, comparison, statuses):
    """The lines printed: the two curves side by side, each recipe's speed and how its run ended where it did not
    end well (statuses), then the comparison."""
    lines = [f"{'step':>5} {'tokens':>12}" + "".join(f" {name + ' val':>11} {name + ' s':>9}" for name in curves)]
    by_step = {name: {step: (seconds, loss) for step, _, seconds, loss in curve["vals"]}
               for name, curve in curves.items()}
    tokens_of = {step: tokens for curve in curves.values() for step, tokens, _, _ in curve["vals"]}
    for step in sorted(tokens_of):
        cells = [(f"{by_step[name][step][1]:11.4f} {by_step[name][step][0]:9.1f}" if step in by_step[name]
                  else " " * 21) for name in curves]
        lines.append(f"{step:5d} {tokens_of[step]:12,d} " + " ".join(cells))
    for name, curve in curves.items():
        step, tokens, seconds, loss = curve["vals"][-1]
        mfu = f", MFU {100 * curve['mfu']:.1f}%" if curve["mfu"] is not None else ""
        peak = f", peak {curve['peak_gib']:.2f} GiB" if curve["peak_gib"] is not None else ""
        ended = "" if statuses.get(name, "done") == "done" else f" ({statuses[name]})"
        lines.append(f"{name}{ended}: val loss {loss:.4f} at step {step} ({tokens:,} tokens, {seconds:.1f} s of "
                     f"training); {curve['tok_per_sec']:,.0f} tok/s{mfu}{peak}")
    if comparison:
        c = comparison
        reached = ("does not reach it in its run" if c["tokens"] is None else
                   f"reaches it after {c['tokens']:,.0f} tokens ({c['tokens'] / c['gpt2_tokens']:.0%} of GPT-2's)"
                   + ("" if c["seconds"] is None else
                      f" and {c['seconds']:.1f} s of training ({c['seconds'] / c['gpt2_seconds']:.0%} of GPT-2's)"))
        at = [f"{c[key]:.4f} at GPT-2's {what}" for key, what in (("loss_at_tokens", "tokens"),
                                                                 ("loss_at_seconds", "seconds")) if c[key] is not None]
        lines.append(f"GPT-2's final val loss {c['target']:.4f}: the modern recipe {reached}"
                     + (f"; its val loss is {', and '.join(at)}" if at else ""))
    return lines


def main(argv=None):
    args = parse_args(argv)
    out = os.path.abspath(args.out)
    if args.dry_run:
        print(f"text: the installed packages' files, about {text_bytes(args) / 1e6:.1f} MB, as jsonl in WORK/text")
        for name, command in commands_in(args, "WORK"):
            print(f"{name}: {' '.join(command)}")
        return
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="recipes_124m_", dir=args.work) as work:
        measured = measure(args, commands_in(args, work), work, out)
    lines = (report(measured["curves"], measured["comparison"], measured["statuses"]) if measured["curves"] else
             ["no recipe logged a step"])
    print("\n".join(lines))
    with open(os.path.join(out, "recipes_124m.json"), "w") as f:
        json.dump(dict(args=vars(args), **measured, lines=lines), f, indent=1)
    if measured["comparison"] is None:
        sys.exit(1)


def commands_in(args, work):
    """[(name, command)]: fineweb.py's over the text in work, then each recipe's trainer's."""
    shard_dir = os.path.join(work, "shards")
    return [("fineweb", fineweb_command(args, os.path.join(work, "text"), shard_dir))] + [
        (recipe, trainer_command(args, recipe, shard_dir, os.path.join(work, f"log_{recipe}"))) for recipe in RECIPES]


def measure(args, commands, work, out):
    """Writes the text, then runs the commands (fineweb.py, then each recipe's trainer), each given an even share of
    what is left of --budget; out gets each command's output and each trainer's log.jsonl (its checkpoints stay in
    work, which goes). The last STOPPING seconds are kept for a trainer stopped at the end of its share."""
    deadline = time.monotonic() + args.budget - STOPPING
    files, size = write_text(os.path.join(work, "text"), text_bytes(args))
    print(f"text: {files:,} files of the installed packages, {size / 1e6:.1f} MB", flush=True)
    curves, statuses = {}, {}
    for i, (name, command) in enumerate(commands):
        try:
            statuses[name] = run_command(command, os.path.join(out, f"{name}.txt"),
                                         (deadline - time.monotonic()) / (len(commands) - i))
        except KeyboardInterrupt:  # Ctrl-C, or gpu_check.py's part out of time: what was logged is reported
            statuses[name] = "interrupted"
        print(f"{name}: {statuses[name]}", flush=True)
        if name == "fineweb":
            if statuses[name] != "done":
                sys.exit(f"error: fineweb.py {statuses[name]}; its output is in {out}/fineweb.txt")
            made = training_tokens(os.path.join(work, "shards"))
            if made < args.steps * args.total_batch_size:  # the packages had too little text: a run sees some twice
                print(f"warning: the text made {made:,} training tokens, fewer than the {args.steps} steps train on "
                      f"({args.steps * args.total_batch_size:,}): both runs see some of it twice", flush=True)
            continue
        log = os.path.join(work, f"log_{name}", "log.jsonl")
        try:
            shutil.copyfile(log, os.path.join(out, f"log_{name}.jsonl"))
            curves[name] = read_curve(log)
        except (OSError, ValueError, KeyError) as e:
            print(f"{name}: no curve ({e}); its output is in {out}/{name}.txt")
        if statuses[name] == "interrupted":
            break
    compared = set(curves) == set(RECIPES) and curves["gpt2"]["vals"][-1][1] > 0  # GPT-2 validated after training
    comparison = compare(curves["gpt2"], curves["modern"]) if compared else None
    return dict(text_files=files, text_bytes=size, training_tokens=made, statuses=statuses, curves=curves,
                comparison=comparison)


if __name__ == "__main__":
    main()
