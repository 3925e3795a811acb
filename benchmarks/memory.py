"""
The memory each GPU needs to train a GPT-2 size with DDP (the default) and with FSDP (--fsdp), for a number of GPUs,
and with --shards, with HSDP (--fsdp on several nodes: each tensor split over a node's GPUs): the weights, gradients
and optimizer state computed from how each lays them out (exact, from the model's own parameters), an estimate of the
activations, and with --measure, the peak memory and speed of real train_gpt2.py runs on this machine's GPUs beside
them (DDP's and FSDP's). Below them, the bytes of a checkpoint that each rank writes.

    python benchmarks/memory.py                                    # GPT-2 XL on 8 GPUs of 40 GiB at micro-batch 2
    python benchmarks/memory.py --world-size 32 --shards 8         # and on 4 nodes of 8 GPUs, HSDP beside them
    python benchmarks/memory.py --model gpt2 --world-size 1 --batch-size 64 --accumulation-steps 8   # any machine
    python benchmarks/memory.py --model gpt2 --world-size 1 --batch-size 64 --accumulation-steps 8 --gpu-gib 80 \\
        --measure                                                  # one 80 GB GPU: computed, then measured
    python benchmarks/memory.py --measure                          # 8 GPUs: the GPT-2 XL question, measured

The rows are per GPU (per rank), in GiB, for bf16 autocast (FSDP then gathers the blocks' weights in bf16). Computed
without a GPU or any memory: the model is built on the meta device. --measure trains 10 steps of random tokens twice,
without and with --fsdp, under torchrun on --world-size GPUs of this machine, and reads from each run's log.jsonl rank
0's peak of torch.cuda.max_memory_allocated, and the median tok/s and MFU of the steps after the first two (the first
compiles). Each run ends with its final checkpoint, in a temporary directory removed right after (GPT-2 XL's is about
19 GB: set TMPDIR to a disk with room).
"""

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

import torch

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from speed_ladder import read_steps, write_random_shards  # noqa: E402

from machinery.step_memory import activation_bytes, logits_bytes, model_state, numel, parameters_of  # noqa: E402
from train_gpt2 import MODEL_SIZES, PADDED_VOCAB, RECIPES, GPTConfig, model_of  # noqa: E402

TRAINER = os.path.join(REPO, "train_gpt2.py")
BLOCK_SIZE = 1024  # the trainer's default position table, which the measured runs use too
GIB = 2**30
MEASURED_STEPS = 10
UNTIMED_STEPS = 2  # the first compiles, the second may still settle
FAILURE_LINES = 25  # of a failed run's output, printed
RUN_TIMEOUT = 900  # seconds for one measured run: GPT-2 XL compiles for minutes, then writes its checkpoint
LABELS = {
    "weights": "weights (fp32)",
    "gradients": "gradients (fp32)",
    "optimizer": "optimizer state (fp32)",
    "ddp_buckets": "DDP's gradient buckets (fp32)",
    "fsdp_gathered": "FSDP's gathered weights in flight",
    "fsdp_accumulation": "FSDP's unsharded gradients (accumulation)",
    "bf16_copies": "autocast's bf16 copies of the weights",
    "model_state": "model state",
    "activations": "activations saved for the backward",
    "logits": "bf16 logits (modern's DDP: and gradient)",
    "total": "total (estimate)",
}


def count_parameters(model, recipe):
    with torch.device("meta"):  # shapes without storage: GPT-2 XL's 1.5B parameters take no memory and no time
        gpt = model_of(GPTConfig(block_size=BLOCK_SIZE, vocab_size=PADDED_VOCAB, recipe=recipe, **MODEL_SIZES[model]))
    return parameters_of(gpt)


def keep_unless_weight(saved, weight_shapes, tensor):
    """A saved-tensor hook: keeps tensor in saved by its storage, unless its shape is a weight's or a buffer's (or
    transposed): those are the model's, not the tokens'."""
    if tuple(tensor.shape) not in weight_shapes:
        saved[tensor.untyped_storage().data_ptr()] = tensor
    return tensor


def saved_per_token(recipe, compiled=True, n_embd=128, n_head=2, batch_size=3, seq_len=40):
    """The recipe's saved_per_token (RECIPES[recipe].memory), counted: the tensors that the compiled bf16 step's
    forward pass saves for its backward (autograd's saved-tensor hooks see what AOTAutograd saves), at one layer and at
    two, on the CPU. The backend aot_eager_decomp_partition runs the partitioner that decides them as inductor's does,
    without generating code. A weight's bf16 copy (autocast's) is counted apart, by its shape: the sizes here are
    chosen to match no other. Not compiled: its saved_per_token_eager, the eager fp32 step's, a CPU's."""
    per_model = []
    for n_layer in (1, 2):
        torch.manual_seed(0)
        model = model_of(GPTConfig(block_size=seq_len, vocab_size=PADDED_VOCAB, n_layer=n_layer, n_head=n_head,
                                   n_embd=n_embd, recipe=recipe))
        weight_shapes = {shape for t in [*model.parameters(), *model.buffers()]
                         for shape in (tuple(t.shape), tuple(t.shape)[::-1])}
        saved = {}  # each storage once
        tokens = torch.randint(0, PADDED_VOCAB - 47, (batch_size, seq_len))
        step = torch.compile(model, dynamic=False, backend="aot_eager_decomp_partition") if compiled else model
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(keep_unless_weight, saved, weight_shapes),
                                                      lambda t: t):
            with torch.autocast("cpu", torch.bfloat16, enabled=compiled):
                _, loss = step(tokens, tokens)
        loss.backward()
        logits = sum(t.untyped_storage().nbytes() for t in saved.values() if t.shape[-1:] == (PADDED_VOCAB,))
        rest = sum(t.untyped_storage().nbytes() for t in saved.values()) - logits
        per_model.append((rest / (batch_size * seq_len * n_embd), logits / (batch_size * seq_len * PADDED_VOCAB)))
    (one, logits), (two, _) = per_model
    return two - one, 2 * one - two, logits


def memory_rows(args):
    """(the parameters, {row: (DDP bytes, FSDP bytes)}) per rank for the settings; with --shards, HSDP's bytes third:
    FSDP's on one group of --shards ranks, as each tensor is split over a group (the replicas add only an all-reduce
    of the gradients' slices, in place)."""
    params, memory = count_parameters(args.model, args.recipe), RECIPES[args.recipe].memory
    rows = model_state(params, args.world_size, memory, args.accumulation_steps)
    if args.shards:
        group = model_state(params, args.shards, memory, args.accumulation_steps)
        rows = {key: (*row, group[key][1]) for key, row in rows.items()}
    size = MODEL_SIZES[args.model]
    activations = activation_bytes(memory.saved_per_token, size["n_layer"], size["n_embd"], args.batch_size,
                                   args.seq_len)
    ddp_logits, sharded_logits = logits_bytes(memory, args.batch_size, args.seq_len, PADDED_VOCAB)
    columns = len(rows["weights"])
    rows["activations"] = (activations,) * columns
    rows["logits"] = (ddp_logits,) + (sharded_logits,) * (columns - 1)
    rows["total"] = tuple(sum(rows[key][i] for key in ("model_state", "activations", "logits")) for i in range(columns))
    return params, rows


def column_names(args):
    return ["DDP", "FSDP"] + ([f"HSDP {args.world_size // args.shards}x{args.shards}"] if args.shards else [])


def line(label, cells):
    return f"{label:<44}" + "".join(f" {cell:>15}" for cell in cells)


def gib(value):
    return "-" if value is None else f"{value / GIB:.2f}"


def fits(total, gpu_gib):
    spare = gpu_gib - total / GIB
    return f"yes, {spare:.1f} left" if spare >= 0 else f"no, {-spare:.1f} over"


def table(rows, gpu_gib, names):
    """The rows in GiB under the layouts' names, a rule above the sums, and whether each total fits."""
    lines = [line("GiB per rank", names)]
    for key, values in rows.items():
        if key in ("model_state", "total"):
            lines.append(line("", ["-" * 15] * len(names)))
        lines.append(line(LABELS[key], [gib(value) for value in values]))
    lines.append(line(f"fits in {gpu_gib:g} GiB?", [fits(total, gpu_gib) for total in rows["total"]]))
    return lines


CHECKPOINT_LABEL = "checkpoint written per rank"
CHECKPOINT_NOTE = (
    "Checkpoint: the fp32 weights and optimizer state that rank 0 writes of each checkpoint (the tied embedding once), "
    "as the others write as much or none: DDP's rank 0 all of it (ckpt_<step>.pt) and the others nothing; FSDP's ranks "
    "each their slice; HSDP's first replica its slices, the other replicas nothing. Beside them, rank 0's run.pt: some "
    "KB.")


def checkpoint_bytes(rows):
    """The bytes rank 0 writes of a checkpoint, for each layout of rows (memory_rows'): its weights and optimizer
    state, as each layout holds them in memory, since each slice is written by the rank that holds it."""
    return [weights + optimizer for weights, optimizer in zip(rows["weights"], rows["optimizer"])]


def header(args, params):
    blocks, rest = numel(params.blocks), numel(params.rest)
    gpt2 = args.recipe == "gpt2"
    optimizer = "AdamW, 2 fp32 moments per parameter" if gpt2 else \
        "Muon, 1 fp32 momentum per block matrix parameter, and Adam, 2 per embedding and head parameter"
    steps = f"{args.accumulation_steps} accumulation step{'s' if args.accumulation_steps > 1 else ''}"
    about = (f"{args.model}, --recipe {args.recipe}: {blocks + rest:,} parameters, {blocks:,} in {params.n_layer} "
             f"blocks and {rest:,} in the " + ("embedding, position table, final norm and head (tied)" if gpt2 else
                                                "embedding and head") + f"; {optimizer}")
    hsdp = f"; HSDP: {args.world_size // args.shards} replicas x {args.shards} shards" if args.shards else ""
    return textwrap.wrap(about, 118) + [f"world size {args.world_size}, micro-batch {args.batch_size} x "
                                        f"{args.seq_len} tokens, {steps}, bf16 autocast{hsdp}"]


NOTES = (
    "FSDP: the sharded rows are rank 0's slice (each tensor's rows split over the ranks; under HSDP over a group of "
    "--shards ranks, a node, as FSDP's on that many); gathered in flight: the root (embedding, head, final norm) in "
    "fp32, kept from forward to backward, and about 2 blocks in bf16; its unsharded gradients: with accumulation > 1 "
    "only. DDP: its buckets copy the gradients, with more than one process only. "
    "Activations, the same for all: the bytes the compiled bf16 step saves for its backward, counted on a CPU "
    "(saved_per_token): per token, {0}*C per layer and {1}*C outside them for --recipe gpt2 ({3}*C and {4}*C for "
    "modern), and the B*T*V bf16 logits, which GPT-2's compiled backward overwrites with their gradient (the modern "
    "recipe's, with DDP, holds it beside them). At GPT-2 124M, B=64 on one H100 the estimate was within 5% of the "
    "peaks measured, DDP's and FSDP's (docs/LOG.md, 2026-11-25). Not counted: the CUDA context, the caching "
    "allocator's free blocks, and transients: a block's gradients "
    "before their reduce-scatter, the one bf16 matrix ShardedMuon gathers.").format(
        *RECIPES["gpt2"].memory.saved_per_token, *RECIPES["modern"].memory.saved_per_token)


# -----------------------------------------------------------------------------
# --measure: train_gpt2.py itself, a few steps without and with --fsdp.


def trainer_command(args, data_dir, log_dir, fsdp):
    """Always under torchrun, also on one GPU: one command for every world size, and the launch the README gives; at
    world size 1 the trainer runs under it as it would alone (no DDP wrapper; --fsdp makes its own 1-process group)."""
    B, T, W = args.batch_size, args.seq_len, args.world_size
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={W}", TRAINER,
        "--data", data_dir, "--log-dir", log_dir, "--no-resume", "--model", args.model, "--recipe", args.recipe,
        "--batch-size", str(B), "--no-fit-batch-size",  # B itself, or the run says it does not fit
        "--seq-len", str(T), "--total-batch-size", str(B * T * W * args.accumulation_steps),
        "--dtype", "bf16", "--max-steps", str(MEASURED_STEPS), "--eval-every", "0", "--hellaswag-every", "0",
        "--core-every", "0", "--num-samples", "0", "--checkpoint-every", "0", "--val-tokens", str(T),
    ] + (["--fsdp"] if fsdp else [])


def peak_from_log(log_path):
    """The highest peak_mem_gb (GiB, rank 0's torch.cuda.max_memory_allocated) of the steps logged, or None."""
    return max((r["peak_mem_gb"] for r in read_steps(log_path) if "peak_mem_gb" in r), default=None)


def speed_from_log(log_path):
    """The median step after the first UNTIMED_STEPS (the lower one of an even count: a step that happened, so its
    tok/s and MFU agree), as {"tok_per_sec", "mfu"}, or None if none was logged."""
    timed = sorted((r for r in read_steps(log_path) if r["step"] >= UNTIMED_STEPS), key=lambda r: r["tok_per_sec"])
    if not timed:
        return None
    median = timed[(len(timed) - 1) // 2]
    return {"tok_per_sec": median["tok_per_sec"], "mfu": median.get("mfu")}


def measure_run(args, data_dir, log_dir, fsdp):
    """{"peak_gib", "tok_per_sec", "mfu"} of rank 0 over the run's steps, or the end of its output saying why there
    are none."""
    with open(log_dir + ".out", "w") as out:
        process = subprocess.Popen(trainer_command(args, data_dir, log_dir, fsdp), cwd=REPO, stdout=out,
                                   stderr=subprocess.STDOUT)
        try:
            process.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:  # torchrun passes SIGTERM on to its workers, and kills those that linger
            process.send_signal(signal.SIGTERM)
            process.wait()
    log_path = os.path.join(log_dir, "log.jsonl")
    peak, speed = peak_from_log(log_path), speed_from_log(log_path)
    shutil.rmtree(log_dir, ignore_errors=True)  # the final checkpoint: GPT-2 XL's is about 19 GB
    if peak is not None and speed is not None:
        return {"peak_gib": peak, **speed}
    with open(log_dir + ".out") as f:  # out of memory, most likely; torchrun's summary takes the last lines
        return "\n".join(line for line in f.read().splitlines()[-FAILURE_LINES:] if line.strip())


def measure(args):
    """{"ddp": GiB or why not, "fsdp": ...} of two short runs on random tokens."""
    total = args.batch_size * args.seq_len * args.world_size * args.accumulation_steps
    measured = {}
    with tempfile.TemporaryDirectory(prefix="memory_") as tmp:
        data_dir = os.path.join(tmp, "data")
        os.makedirs(data_dir)
        write_random_shards(data_dir, (MEASURED_STEPS + 1) * total + 1, args.seq_len + 1)
        for name in ("ddp", "fsdp"):
            print(f"measuring {name.upper()}: {MEASURED_STEPS} steps of train_gpt2.py on {args.world_size} GPU(s)...",
                  flush=True)
            measured[name] = measure_run(args, data_dir, os.path.join(tmp, name), fsdp=name == "fsdp")
    return measured


def measured_lines(rows, measured):
    def cells(key, form):
        return [form(run[key]) if isinstance(run, dict) and run[key] is not None else "-" for run in measured.values()]

    ddp, fsdp = measured["ddp"], measured["fsdp"]
    ratio = f"FSDP's tok/s over DDP's: {fsdp['tok_per_sec'] / ddp['tok_per_sec']:.3f}" \
        if isinstance(ddp, dict) and isinstance(fsdp, dict) else ""
    lines = [line("rank 0", ["DDP", "FSDP"]),
             line(LABELS["total"] + ", GiB", [gib(rows["total"][0]), gib(rows["total"][1])]),
             line("measured peak (max_memory_allocated), GiB", cells("peak_gib", "{:.2f}".format)),
             line(f"tok/s (median of steps {UNTIMED_STEPS}-{MEASURED_STEPS - 1})",
                  cells("tok_per_sec", "{:,.0f}".format)),
             line("MFU", cells("mfu", lambda mfu: f"{100 * mfu:.1f}%")), ratio]
    return lines + [f"{name.upper()} failed:\n{why}" for name, why in measured.items() if isinstance(why, str)]


# -----------------------------------------------------------------------------
# The command line.


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line, with no usage above it, like the rest of the errors
        self.exit(2, f"error: {message}\n")


def parse_args(argv=None):
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-xl", choices=list(MODEL_SIZES), help="GPT-2 size (default: gpt2-xl)")
    parser.add_argument("--world-size", type=int, default=8, help="GPUs, one rank each (default: 8)")
    parser.add_argument("--recipe", default="gpt2", choices=["gpt2", "modern"],
                        help="gpt2: tied head, AdamW; modern: untied head, Muon and Adam (default: gpt2)")
    parser.add_argument("--batch-size", type=int, default=2, help="micro-batch: sequences per rank (default: 2)")
    parser.add_argument("--seq-len", type=int, default=1024, help=f"tokens per sequence, at most {BLOCK_SIZE} "
                        f"(default: 1024)")
    parser.add_argument("--accumulation-steps", type=int, default=1,
                        help="micro-batches per optimizer step (default: 1)")
    parser.add_argument("--shards", type=int, default=0, help="also HSDP's memory, each tensor split over this many "
                        "GPUs (a node's: --fsdp-shards) and replicated across the groups (default: 0, no HSDP)")
    parser.add_argument("--gpu-gib", type=float, default=40.0, help="memory of one GPU, to say whether it fits "
                        "(default: 40)")
    parser.add_argument("--json", default="", help="also write the rows (bytes) and measurements to this JSON file")
    parser.add_argument("--measure", action="store_true",
                        help=f"also train {MEASURED_STEPS} steps without and with --fsdp on this machine's GPUs, and "
                        f"print their peak memory and speed")
    args = parser.parse_args(argv)
    for name in ("world_size", "batch_size", "seq_len", "accumulation_steps", "gpu_gib"):
        if not getattr(args, name) > 0:  # written so that NaN fails too
            parser.error(f"--{name.replace('_', '-')} must be positive, not {getattr(args, name)}")
    if args.shards < 0 or (args.shards and args.world_size % args.shards):
        parser.error(f"--shards {args.shards} does not divide --world-size {args.world_size}; pass a divisor of it")
    if args.seq_len > BLOCK_SIZE:
        parser.error(f"--seq-len {args.seq_len} is longer than the model's {BLOCK_SIZE} positions; shorten it")
    if args.measure and not torch.cuda.is_available():
        parser.error("--measure needs CUDA GPUs, and PyTorch sees none here; run it on a GPU machine, or drop "
                     "--measure for the computed table alone")
    if args.measure and args.world_size > torch.cuda.device_count():
        parser.error(f"--measure --world-size {args.world_size}, but this machine has {torch.cuda.device_count()} "
                     f"GPU(s); lower --world-size, or drop --measure")
    return args


def main(argv=None):
    args = parse_args(argv)
    params, rows = memory_rows(args)
    checkpoint = checkpoint_bytes(rows)
    print("\n".join(header(args, params) + [""] + table(rows, args.gpu_gib, column_names(args)) +
                    [line(CHECKPOINT_LABEL, [gib(value) for value in checkpoint]), ""] +
                    textwrap.wrap(NOTES, 118) + textwrap.wrap(CHECKPOINT_NOTE, 118)),
          flush=True)
    measured = None
    if args.measure:
        measured = measure(args)
        print("\n".join([f"measured on {torch.cuda.get_device_name()}:"] + measured_lines(rows, measured)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**vars(args), "parameters": {"blocks": numel(params.blocks), "rest": numel(params.rest)},
                       "rows_bytes": {key: dict(zip(("ddp", "fsdp", "hsdp"), row)) for key, row in rows.items()},
                       "checkpoint_bytes_per_rank": dict(zip(("ddp", "fsdp", "hsdp"), checkpoint)),
                       "measured": measured, "torch": torch.__version__}, f, indent=2)


if __name__ == "__main__":
    main()
