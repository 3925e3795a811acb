"""
CORE's speed: examples per second of evaluation/core_score.py's evaluation against a plain one of the same model on
the same examples, one example (its options together) a forward pass with the softmax over every position, as nanochat's
core_eval runs. Both must choose alike; the plain one is timed on fewer examples when it would take long.

    python benchmarks/core_speed.py                     # the quick start's model, 12 examples a task: ~3 min on a core
    python benchmarks/core_speed.py --core-data DIR     # the real bundle (an unzipped eval_bundle.zip)
    python benchmarks/core_speed.py --device cuda       # GPT-2 124M's shapes, every example: the full CORE's time

Without --core-data the tasks are a synthetic bundle of the real one's shape, written to a temporary directory: its
22 tasks with their kinds, few-shot counts, delimiters, numbers of options and of examples (91,037 in all), and
about their lengths, in words of the play. The weights are random (timing needs no training) unless --init-from
names OpenAI's (gpt2, ...) or an --export-hf directory. On CUDA, as in a run: bf16 autocast and torch.compile, the
first evaluation's time (its prompts tokenized, its shapes compiled) apart from the second's. On a CPU that other work
shares, set OMP_NUM_THREADS=1: threads that wait for each other slow the small matrix products of ours the most.
"""

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
sys.path.insert(0, REPO)
import train_gpt2  # noqa: E402
from evaluation import core_score  # noqa: E402
from machinery import tokenizer  # noqa: E402
from train_gpt2 import GPT, MODEL_SIZES, GPTConfig, TrainConfig, autocast_context, compile_model, model_of  # noqa: E402

# label: (kind, shots, delimiter, options, examples, random baseline %, context words, answer words)
ANSWER = "\nAnswer: "
REAL_SHAPE = {
    "hellaswag_zeroshot": ("multiple_choice", 0, " ", 4, 10042, 25, 30, 15),
    "jeopardy": ("language_modeling", 10, ANSWER, 0, 2117, 0, 20, 2),
    "bigbench_qa_wikidata": ("language_modeling", 10, " ", 0, 20321, 0, 8, 2),
    "arc_easy": ("multiple_choice", 10, ANSWER, 4, 2376, 25, 20, 4),
    "arc_challenge": ("multiple_choice", 10, ANSWER, 4, 1172, 25, 25, 5),
    "copa": ("multiple_choice", 0, " ", 2, 100, 50, 10, 6),
    "commonsense_qa": ("multiple_choice", 10, " ", 5, 1221, 20, 40, 2),
    "piqa": ("multiple_choice", 10, ANSWER, 2, 1838, 50, 12, 20),
    "openbook_qa": ("multiple_choice", 0, " ", 4, 500, 25, 12, 4),
    "lambada_openai": ("language_modeling", 0, " ", 0, 5153, 0, 70, 1),
    "hellaswag": ("multiple_choice", 10, " ", 4, 10042, 25, 30, 15),
    "winograd": ("schema", 0, " ", 2, 273, 50, 12, 6),
    "winogrande": ("schema", 0, " ", 2, 1267, 50, 15, 6),
    "bigbench_dyck_languages": ("language_modeling", 10, " ", 0, 1000, 0, 30, 4),
    "agi_eval_lsat_ar": ("multiple_choice", 3, " ", 5, 230, 20, 200, 1),
    "bigbench_cs_algorithms": ("language_modeling", 10, " ", 0, 1320, 0, 25, 1),
    "bigbench_operators": ("language_modeling", 10, " ", 0, 210, 0, 20, 1),
    "bigbench_repeat_copy_logic": ("language_modeling", 10, " ", 0, 32, 0, 15, 10),
    "squad": ("language_modeling", 10, " ", 0, 10570, 0, 130, 3),
    "coqa": ("language_modeling", 0, " ", 0, 7983, 0, 250, 2),
    "boolq": ("multiple_choice", 10, ANSWER, 2, 3270, 62, 100, 1),
    "bigbench_language_identification": ("multiple_choice", 10, " ", 11, 10000, 9.1, 25, 1),
}


def synthetic_bundle(directory, max_examples=None):
    """Writes a bundle of REAL_SHAPE's tasks (at most max_examples of each) into directory; returns it."""
    with open(os.path.join(REPO, "input.txt")) as f:
        words = f.read().split()
    rng = random.Random(0)

    def text(count):
        return " ".join(rng.choice(words) for _ in range(max(1, round(count * rng.uniform(0.5, 1.5)))))

    config, meta = ["icl_tasks:"], ["Eval Task,Random baseline"]
    for label, (kind, shots, delimiter, options, count, baseline, context, answer) in REAL_SHAPE.items():
        examples = []
        for _ in range(min(count, max_examples or count)):
            if kind == "multiple_choice":
                example = {"query": text(context), "choices": [text(answer) for _ in range(options)], "gold": 0}
            elif kind == "schema":
                example = {"context_options": [text(context) for _ in range(options)], "continuation": text(answer),
                           "gold": 0}
            else:
                example = {"context": text(context), "continuation": text(answer)}
            examples.append(json.dumps(example))
        os.makedirs(os.path.join(directory, "eval_data"), exist_ok=True)
        with open(os.path.join(directory, "eval_data", f"{label}.jsonl"), "w") as f:
            f.write("\n".join(examples) + "\n")
        config.append(f"- label: {label}\n  dataset_uri: {label}.jsonl\n  num_fewshot: [{shots}]\n"
                      f"  icl_task_type: {kind}\n  continuation_delimiter: {json.dumps(delimiter)}")
        meta.append(f"{label},{baseline}")
    with open(os.path.join(directory, "core.yaml"), "w") as f:
        f.write("\n".join(config) + "\n")
    with open(os.path.join(directory, "eval_meta_data.csv"), "w") as f:
        f.write("\n".join(meta) + "\n")
    return directory


def plain_outcomes(model, task, max_per_task, block_size, device, autocast_ctx):
    """Each example's outcome, one forward pass an example: its prompts (core_score.py's text) tokenized whole, cropped,
    padded to the longest, the loss and the argmax at every position, as nanochat's evaluate_example does."""
    enc, examples, outcomes = tokenizer.gpt2_tokenizer(), core_score.chosen_examples(task, max_per_task), []
    for index in range(len(examples)):
        rows = [[tokenizer.EOT] + enc.encode_ordinary("".join(pieces))
                for pieces in core_score.option_texts(task, examples, index)]
        if task.kind == "language_modeling":
            spans, rows = [(len(rows[0]), len(rows[1]))], rows[1:]
        elif task.kind == "multiple_choice":
            common = next((i for i in range(min(map(len, rows))) if len({row[i] for row in rows}) > 1),
                          min(map(len, rows)))
            spans = [(common, len(row)) for row in rows]
        else:
            common = next((i for i in range(min(map(len, rows))) if len({row[-1 - i] for row in rows}) > 1),
                          min(map(len, rows)))
            spans = [(len(row) - common, len(row)) for row in rows]
        crops = [max(0, len(row) - block_size) for row in rows]
        rows = [row[crop:] for row, crop in zip(rows, crops)]
        spans = [(max(1, start - crop), end - crop) for (start, end), crop in zip(spans, crops)]
        width = max(map(len, rows))
        tokens = torch.tensor([row + [tokenizer.EOT] * (width - len(row)) for row in rows], device=device)
        with torch.no_grad(), autocast_ctx:
            logits, _ = model(tokens)
            losses = F.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten(), reduction="none")
            losses, predictions = losses.view(tokens.shape), logits.argmax(dim=-1)
        if task.kind == "language_modeling":
            (start, end), = spans
            outcomes.append(int(predictions[0, start - 1:end - 1].tolist() == rows[0][start:end]))
        else:
            means = [losses[i, start - 1:end - 1].mean().item() for i, (start, end) in enumerate(spans)]
            outcomes.append(means.index(min(means)))
    return outcomes


def timed(function):
    started = time.perf_counter()
    result = function()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - started


def plan(args, model_name, shapes, max_per_task, plain_per_task):
    """--dry-run: a small bundle made and read (or --core-data's), the model's shapes built on the meta device (no
    memory), and one line of what would be timed."""
    with torch.device("meta"):
        n_params = sum(p.numel() for p in model_of(GPTConfig(**shapes)).parameters())
    with tempfile.TemporaryDirectory() as scratch:  # a synthetic bundle of 11 examples a task: enough for 10 shots
        directory = args.core_data or synthetic_bundle(scratch, 11)
        bundle = core_score.load(directory, "", 11)
    counts = ({task.label: len(task.examples) for task in bundle.tasks} if args.core_data else
              {label: shape[4] for label, shape in REAL_SHAPE.items()})
    examples = sum(min(count, max_per_task or count) for count in counts.values())
    print(f"dry run: {model_name} shapes, {n_params / 1e6:.1f}M parameters, on {args.device}: ours would score "
          f"{examples:,} examples of {len(bundle.tasks)} tasks, the plain evaluation {plain_per_task or 'all'} a task")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--core-data", help="a CORE bundle directory (default: a synthetic one of the real shape)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", choices=["quickstart", *MODEL_SIZES],
                        help="the shapes: the quick start's (8 layers, width 128, context 256; the CPU's default) or "
                             "OpenAI's (gpt2: the CUDA default)")
    parser.add_argument("--init-from", help="load weights: OpenAI's --model (downloaded), or an --export-hf directory")
    parser.add_argument("--max-per-task", type=int, help="examples a task that ours scores (0: all; default: 12 on "
                                                         "the CPU, all on CUDA)")
    parser.add_argument("--plain-per-task", type=int, help="examples a task that the plain evaluation scores "
                                                           "(default: --max-per-task on the CPU, 12 on CUDA)")
    parser.add_argument("--tokens-per-pass", type=int,
                        help="ours: tokens a forward pass (default: a run's micro-batch: 8 x 128 for the quick start, "
                             "64 x 1024 for GPT-2)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, help="default: on CUDA")
    parser.add_argument("--dry-run", action="store_true", help="make and read the bundle, build the model's shapes on "
                                                              "no device, and say what would be timed; time nothing")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    model_name = args.model or ("gpt2" if cuda else "quickstart")
    max_per_task = (12 if not cuda else 0) if args.max_per_task is None else args.max_per_task
    plain_per_task = (max_per_task if not cuda else 12) if args.plain_per_task is None else args.plain_per_task
    compiled = cuda if args.compile is None else args.compile
    if model_name == "quickstart":
        shapes = {k: train_gpt2.SHAKESPEARE[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")}
        tokens_per_pass = args.tokens_per_pass or 8 * 128
    else:
        shapes = dict(MODEL_SIZES[model_name], block_size=1024, vocab_size=train_gpt2.PADDED_VOCAB)
        tokens_per_pass = args.tokens_per_pass or 64 * 1024
    torch.manual_seed(0)
    if args.dry_run:
        return plan(args, model_name, shapes, max_per_task, plain_per_task)
    if args.init_from:
        model = GPT.from_pretrained(args.init_from, GPTConfig(**shapes)).to(args.device).eval()
    else:
        model = model_of(GPTConfig(**shapes)).to(args.device).eval()
    if cuda:
        torch.set_float32_matmul_precision("high")
    autocast_ctx = autocast_context(args.device, "bf16") if cuda else contextlib.nullcontext()
    fast = compile_model(model, TrainConfig(compile=compiled))
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.core_data or synthetic_bundle(scratch, None if max_per_task == 0 else
                                                       max(max_per_task, plain_per_task))
        bundle = core_score.load(directory, "", max_per_task)
    device_name = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{model_name} shapes, {n_params / 1e6:.1f}M parameters, on {device_name}; compile {compiled}; "
          f"{len(bundle.tasks)} tasks of {args.core_data or 'the synthetic bundle'}")

    def ours(per_task):
        return core_score.evaluate(fast, bundle, args.device, autocast_ctx, max_per_task=per_task or None,
                             block_size=shapes["block_size"], tokens_per_pass=tokens_per_pass, fixed_shapes=compiled)

    first, first_seconds = timed(lambda: ours(max_per_task))
    second, second_seconds = timed(lambda: ours(max_per_task))
    print(f"ours, {first.examples:,} examples ({max_per_task or 'all'} a task), {tokens_per_pass:,} tokens a pass: "
          f"first {first_seconds:.1f} s (prompts tokenized{', shapes compiled' if compiled else ''}), then "
          f"{second_seconds:.1f} s: {second.examples / second_seconds:,.1f} examples/s; CORE {second.core:.4f}")
    plain, plain_seconds = timed(lambda: {task.label: plain_outcomes(model, task, plain_per_task or None,
                                                                     shapes["block_size"], args.device, autocast_ctx)
                                          for task in bundle.tasks})
    plain_examples = sum(len(outcomes) for outcomes in plain.values())
    same = ours(plain_per_task) if plain_per_task != max_per_task else second
    differ = sum(a != b for label in plain for a, b in zip(plain[label], same.outcomes[label]))
    plain_rate, our_rate = plain_examples / plain_seconds, second.examples / second_seconds
    print(f"plain, {plain_examples:,} examples ({plain_per_task or 'all'} a task), one example a pass: "
          f"{plain_seconds:.1f} s: {plain_rate:,.1f} examples/s; {differ} of its choices differ from ours")
    print(f"ours is {our_rate / plain_rate:.1f}x as fast (with its first evaluation's tokenizing"
          f"{' and compiling' if compiled else ''}: {first.examples / first_seconds / plain_rate:.1f}x)")


if __name__ == "__main__":
    main()
