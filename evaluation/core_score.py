"""
The DCLM CORE score (Li et al., DataComp-LM: https://arxiv.org/abs/2406.11794) of GPT-2 style models, computed as
nanochat computes it, so that the numbers compare: the mean over the bundle's 22 in-context-learning tasks of each
task's accuracy centered on its random baseline b, (acc - b) / (1 - b). nanochat measured OpenAI's GPT-2 on it: 124M
0.1139, 355M 0.1849, 774M 0.2146, 1.5B 0.2565 (its "time to GPT-2" leaderboard is defined by the 1.5B's).

    python train_gpt2.py --eval-only --init-from gpt2 --core-every 1              # OpenAI's GPT-2 124M
    python train_gpt2.py --eval-only --resume log/ckpt_019073.pt --core-every 1   # a checkpoint, or an export:
    python train_gpt2.py --eval-only --init-from hf/run1 --core-every 1

What is nanochat's, as read in karpathy/nanochat (nanochat/core_eval.py, scripts/base_eval.py, nanochat/tokenizer.py;
scripts/base_train.py's CORE settings as its forks quote them):
- the bundle: eval_bundle.zip, its tasks, their random baselines and their examples (core_bundle.py reads it).
- the examples: a task's lines shuffled by random.Random(1337), then the first max_per_task (nanochat's training
  scores 500 a task every 2000 steps; base_eval every one). The few-shot examples of the example at index i of that
  list are random.Random(1234 + i).sample() of the others' indices, so a subset's prompts are not the whole task's.
- the prompts (Jinja templates there, string concatenation here; the tests render nanochat's templates to check): each
  few-shot example, then a blank line ("\n\n"), then the example. Multiple choice: query + delimiter + choice, a
  few-shot example with its gold choice. Schema: context option + delimiter + continuation. Language modeling: the
  context stripped + delimiter + continuation; the prompt without its continuation stripped of surrounding whitespace.
- the tokens: GPT-2's <|endoftext|> before each prompt (the BOS nanochat's tokenizers take for GPT-2); a prompt longer
  than the model's context keeps its last tokens (nanochat crops at GPT-2's 1024 so), the scored range moved with it.
- the scoring: multiple choice scores each option from the options' common token prefix to its end, schema the
  options' common token suffix; the option of lowest mean loss over them is the choice (Python's min: the first of
  equals). Language modeling is right only if the greedy prediction equals every continuation token (exact tokens:
  nanochat's pull request #437, comparing lowercased text, was closed unmerged). A task's accuracy is the fraction
  right; CORE the mean of (acc - b/100) / (1 - b/100). nanochat evaluates under bf16 autocast on CUDA, as runs do here.

What is ours, and changes no choice: the rows of many examples and options go through each forward pass, sorted by
length and padded on the right with <|endoftext|> (a causal model's scored positions never see it), at a fixed set of
shapes under torch.compile; the output layer and its softmax run at the scored positions alone (the models' at=); a
prompt is tokenized in pieces split where GPT-2's pre-tokenizer splits anyway, so that the few-shot examples a task's
prompts share are tokenized once; the examples are split over the ranks, and their choices gathered. Where nanochat
stops on an assertion (a crop cutting into the scored range; a language modeling prompt whose continuation adds no
token, or whose tokens without it are not the start of its tokens with it), what its indices say is scored.
The text's "<|endoftext|>" is text, as hellaswag.py has it (nanochat's own tokenizer reads it so; a Hugging Face one
would make it the special token).
"""

import collections.abc
import math
import random
import time
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from evaluation import core_bundle
from machinery import checks
from machinery.downloads import default_cache_dir
from machinery.errors import UsageError
from machinery.tokenizer import EOT, gpt2_tokenizer

EVERY = "core_every"  # the training run's setting of the steps between its evaluations
NAME, KEY = "CORE", "core"  # on a model card; the score its log records hold
OPENAI_CORE = {"gpt2": 0.1139, "gpt2-medium": 0.1849, "gpt2-large": 0.2146, "gpt2-xl": 0.2565}  # as nanochat measured
IN_TRAINING = 500  # examples a task in the evaluations during training, as nanochat's base_train
SHUFFLE_SEED, FEWSHOT_SEED = 1337, 1234
SHAPES = 3  # under torch.compile, rows are padded to block_size, block_size / 2, ..., one graph each
SCORED = 4  # under torch.compile, a pass of n tokens scores n / SCORED at most, those logits alone computed


class Bundle(NamedTuple):
    tasks: list
    prepared: dict  # (max_per_task, block_size, rank, world_size) -> Prepared: prompts are tokenized once


def examples_per_task(max_per_task, final):
    """The examples a task in an evaluation, per --core-max-per-task: 0 is nanochat's way, IN_TRAINING of them during
    training and every one in the final evaluation (and --eval-only's); None for every one."""
    return max_per_task or (None if final else IN_TRAINING)


# -----------------------------------------------------------------------------
# The bundle's tasks, each with enough examples for the evaluations asked for


def load(directory, cache_dir, max_per_task):
    """The bundle's tasks from directory, or downloaded once into cache_dir ("" for either: the default), each
    checked to hold enough examples for the evaluations that --core-max-per-task max_per_task asks for."""
    path = directory or core_bundle.fetch(cache_dir or default_cache_dir())
    fix = f"delete {path} to download it again" if not directory else "fix it, or pass --core-data a good copy"
    tasks = core_bundle.read(path, fix)
    for task in tasks:
        if not task.examples:
            raise UsageError(f"CORE task {task.label}: {task.path} holds no examples; {fix}")
        for final in (False, True):
            count = min(len(task.examples), examples_per_task(max_per_task, final) or len(task.examples))
            if count <= task.num_fewshot:
                why = (f"raise --core-max-per-task above {task.num_fewshot}" if count < len(task.examples) else fix)
                raise UsageError(f"CORE task {task.label} ({task.path}) is {task.num_fewshot}-shot, and an evaluation "
                                 f"draws from {count} examples of it: each needs {task.num_fewshot} others; {why}")
    return Bundle(tasks, {})


# -----------------------------------------------------------------------------
# Prompts: nanochat's examples, few-shot examples and text, tokenized


class RangeWithout(collections.abc.Sequence):
    """range(n) without the index skipped, a sequence that random.sample draws from with no list of it made. nanochat
    makes that list for each example: for bigbench_qa_wikidata's 20,321 examples, 400 million items in all."""

    def __init__(self, n, skipped):
        self.n, self.skipped = n, skipped

    def __len__(self):
        return self.n - 1

    def __getitem__(self, index):
        if not 0 <= index < self.n - 1:
            raise IndexError(index)
        return index + (index >= self.skipped)


def chosen_examples(task, max_per_task):
    """The task's examples that an evaluation of max_per_task a task scores (None: every one), in nanochat's order."""
    examples = list(task.examples)
    random.Random(SHUFFLE_SEED).shuffle(examples)
    return examples[:max_per_task]


def fewshot_indices(index, count, num_fewshot):
    return random.Random(FEWSHOT_SEED + index).sample(RangeWithout(count, index), num_fewshot) if num_fewshot else []


def demonstration(task, example):
    """A few-shot example's text: its prompt, with its right answer."""
    if task.kind == "multiple_choice":
        return f"{example['query']}{task.delimiter}{example['choices'][example['gold']]}"
    if task.kind == "schema":
        return f"{example['context_options'][example['gold']]}{task.delimiter}{example['continuation']}"
    return f"{example['context'].strip()}{task.delimiter}{example['continuation']}"


def option_texts(task, examples, index):
    """The prompts of examples[index], one per option (language modeling: without its continuation, then with it),
    each a list of pieces of text that join into nanochat's prompt: its few-shot examples each followed by a blank
    line, then the example split at its delimiter."""
    shots = [demonstration(task, examples[i]) for i in fewshot_indices(index, len(examples), task.num_fewshot)]
    pieces = [(shot if i == 0 else "\n\n" + shot) for i, shot in enumerate(shots)]
    head = "\n\n" if shots else ""  # the blank line after the last few-shot example
    example, delimiter = examples[index], task.delimiter
    if task.kind == "multiple_choice":
        return [pieces + [head + example["query"], delimiter + choice] for choice in example["choices"]]
    if task.kind == "schema":
        continuation = delimiter + example["continuation"]
        return [pieces + [head + context, continuation] for context in example["context_options"]]
    context = head + example["context"].strip()
    return [stripped(pieces + [context + delimiter]), pieces + [context, delimiter + example["continuation"]]]


def stripped(pieces):
    """The pieces of "".join(pieces).strip()."""
    pieces = list(pieces)
    for end, strip in ((-1, str.rstrip), (0, str.lstrip)):
        while pieces and not strip(pieces[end]):
            pieces.pop(end)
        if pieces:
            pieces[end] = strip(pieces[end])
    return pieces


def splits_cleanly(left, right):
    """Whether GPT-2's tokens of left + right are left's, then right's. Its pre-tokenizer never puts a character
    that is not whitespace and the whitespace after it in one chunk, and how it chunks the text before that
    character depends on nothing after it (right's first character is ASCII whitespace, which every definition of
    whitespace counts; left's last is no whitespace by Python's, which counts more than the regex's \\s)."""
    return bool(left) and bool(right) and not left[-1].isspace() and right[0] in " \n\t\r"


def tokenized(pieces, enc, cache):
    """The token arrays of the text pieces: <|endoftext|>, then those of each run of pieces joined where a piece
    does not split cleanly from the next. cache (text -> its array) makes the pieces prompts share tokenized once."""
    runs = []
    for piece in pieces:
        if runs and not splits_cleanly(runs[-1], piece):
            runs[-1] += piece
        else:
            runs.append(piece)
    arrays = [EOT_ARRAY]
    for run in runs:
        if run not in cache:
            cache[run] = np.array(enc.encode_ordinary(run), dtype=np.uint16)
        arrays.append(cache[run])
    return arrays


EOT_ARRAY, EMPTY = np.array([EOT], dtype=np.uint16), np.zeros(0, dtype=np.uint16)


def common_length(rows, from_end=False):
    """The length of the tokens all rows (lists of token arrays) begin with (from_end: end with): the arrays they
    share, the same objects, then the rest compared token by token, as nanochat's find_common_length does."""
    sides = [row[::-1] if from_end else row for row in rows]  # the same arrays, from the end compared first
    shared = 0
    while all(shared < len(side) and side[shared] is sides[0][shared] for side in sides):
        shared += 1
    rests = [np.concatenate((row[:len(row) - shared] if from_end else row[shared:]) or [EMPTY]) for row in rows]
    rests = [rest[::-1] for rest in rests] if from_end else rests
    common = min(len(rest) for rest in rests)
    for rest in rests[1:]:
        differ = np.flatnonzero(rests[0][:common] != rest[:common])
        common = min(common, differ[0]) if len(differ) else common
    return sum(len(array) for array in sides[0][:shared]) + int(common)


class Row(NamedTuple):
    """A prompt's tokens: the arrays that join into them, the first crop dropped (a prompt longer than the model's
    block keeps its last tokens), and the scored ones, tokens[start:end] of what is left."""
    arrays: tuple
    crop: int
    start: int
    end: int

    @property
    def length(self):
        return sum(len(array) for array in self.arrays) - self.crop

    @property
    def scored(self):
        return self.end - self.start


def rows_of(task, examples, index, enc, block_size, cache):
    """The rows of examples[index]: one per option, or for language modeling one, and what each scores."""
    options = [tokenized(pieces, enc, cache) for pieces in option_texts(task, examples, index)]
    lengths = [sum(len(array) for array in option) for option in options]
    if task.kind == "multiple_choice":
        starts = [common_length(options)] * len(options)
    elif task.kind == "schema":
        starts = [length - common_length(options, from_end=True) for length in lengths]
    else:
        starts, options, lengths = lengths[:1], options[1:], lengths[1:]
    rows = []
    for option, start, length in zip(options, starts, lengths):
        crop = max(0, length - block_size)
        rows.append(Row(tuple(option), crop, max(1, start - crop), length - crop))  # position 0 predicts nothing
    return rows


class Prepared(NamedTuple):
    """One rank's share of an evaluation: its rows, and for each of its examples (task index, the example's index in
    the evaluation, its first row, its number of rows)."""
    rows: list
    examples: list
    counts: list  # each task's examples in the evaluation, the ranks' together


def prepare(tasks, max_per_task, block_size, rank=0, world_size=1):
    """The rows of the examples rank scores in an evaluation of max_per_task examples a task (None: all): every
    world_size-th example of the tasks' in turn."""
    enc, rows, examples, counts, offset = gpt2_tokenizer(), [], [], [], 0
    for task_index, task in enumerate(tasks):
        chosen = chosen_examples(task, max_per_task)
        cache = {}  # a task's few-shot examples recur in its prompts; the next task's do not
        for index in range(len(chosen)):
            if (offset + index) % world_size == rank:
                new_rows = rows_of(task, chosen, index, enc, block_size, cache)
                examples.append((task_index, offset + index, len(rows), len(new_rows)))
                rows += new_rows
        counts.append(len(chosen))
        offset += len(chosen)
    return Prepared(rows, examples, counts)


# -----------------------------------------------------------------------------
# Scoring: many rows to a forward pass


def batches(rows, tokens_per_pass, block_size, fixed_shapes):
    """The rows in forward passes, the longest first: each pass's row indices and its shape (rows, length, scored
    tokens), at most tokens_per_pass tokens (or one row, if longer). Under fixed_shapes, so that a compiled model
    compiles SHAPES graphs at most: a pass's length is the least of block_size, block_size / 2, ... that holds its
    longest row, its rows as many as fit, and its scored tokens a fixed max(tokens_per_pass // SCORED, block_size)
    (the rows taken are fewer if theirs would be more); else its rows' longest length, number and scored tokens."""
    order = sorted(range(len(rows)), key=lambda i: -rows[i].length)
    shapes = sorted({max(1, block_size >> k) for k in range(SHAPES)})
    most_scored = max(tokens_per_pass // SCORED, block_size)  # no fewer than one row's
    passes, first = [], 0
    while first < len(order):
        longest = rows[order[first]].length
        length = next(shape for shape in shapes if shape >= longest) if fixed_shapes else longest
        size, last, scored = max(1, tokens_per_pass // length), first, 0
        while last < len(order) and last - first < size and scored + rows[order[last]].scored <= most_scored:
            scored, last = scored + rows[order[last]].scored, last + 1
        shape = (size, length, most_scored) if fixed_shapes else (last - first, length, scored)
        passes.append((order[first:last], shape))
        first = last
    return passes


def assemble(rows, size, length, scored):
    """A forward pass's input (size, length), the rows padded with <|endoftext|> (rows past theirs: all of it); the
    positions of the logits that predict the scored tokens, padded with 0s to scored; and those tokens, and their
    rows' places in the pass."""
    tokens = np.full((size, length), EOT, dtype=np.int64)
    positions, targets, owners = [np.zeros(0, dtype=np.int64)], [EMPTY], [np.zeros(0, dtype=np.int64)]
    for place, row in enumerate(rows):
        row_tokens = np.concatenate(row.arrays)[row.crop:]
        tokens[place, :len(row_tokens)] = row_tokens
        positions.append(np.arange(place * length + row.start - 1, place * length + row.end - 1))
        targets.append(row_tokens[row.start:row.end])
        owners.append(np.full(row.end - row.start, place))
    positions = np.concatenate(positions)
    padded = np.concatenate([positions, np.zeros(scored - len(positions), dtype=np.int64)])
    return [torch.from_numpy(array.astype(np.int64)) for array in (tokens, padded, *map(np.concatenate, (targets,
                                                                                                          owners)))]


def score_rows(model, prepared, device, tokens_per_pass, block_size, fixed_shapes, world_size):
    """(summed loss, count of wrong greedy predictions) over each row's scored tokens, (rows, 2) on the CPU, from the
    logits at the scored positions alone (model(tokens, at=positions)). Every rank runs as many forward passes (the
    last ones empty, of its last shape): under FSDP each lends its slices of the weights to every pass."""
    passes = batches(prepared.rows, tokens_per_pass, block_size, fixed_shapes)
    count = torch.tensor(len(passes), device=device)
    if world_size > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    last_shape = passes[-1][1] if passes else (max(1, tokens_per_pass // block_size), block_size, block_size)
    dtype = torch.float32 if device == "mps" else torch.float64  # MPS has no float64
    totals = torch.zeros(len(prepared.rows), 2, dtype=dtype, device=device)
    for pass_index in range(count.item()):
        indices, shape = passes[pass_index] if pass_index < len(passes) else ([], last_shape)
        tokens, positions, targets, owners = assemble([prepared.rows[i] for i in indices], *shape)
        if device.startswith("cuda"):
            tokens = tokens.pin_memory()  # lets the copy overlap with the GPU's work
        logits, _ = model(tokens.to(device, non_blocking=True), at=positions.to(device))  # (scored, V)
        logits, targets = logits[:len(targets)], targets.to(device)  # the padding's dropped
        losses = F.cross_entropy(logits.float(), targets, reduction="none")
        wrong = logits.argmax(dim=-1) != targets
        rows = torch.tensor(indices, dtype=torch.long)[owners].to(device)
        totals.index_add_(0, rows, torch.stack([losses, wrong], dim=1).to(dtype))
    return totals.cpu()


def choice(task, row_totals, rows):
    """An example's outcome from its rows' totals: the option of lowest mean loss (nanochat's: Python's min, the
    first of equals, a NaN mean of no scored tokens as Python's min has it), or for language modeling 1 if every
    greedy prediction was right, else 0."""
    if task.kind == "language_modeling":
        return int(row_totals[0][1] == 0)
    means = [loss / (row.end - row.start) if row.end > row.start else math.nan
             for (loss, _), row in zip(row_totals, rows)]
    return means.index(min(means))


class Result(NamedTuple):
    core: float
    accuracy: dict  # task label -> the fraction of its examples right
    centered: dict  # task label -> (accuracy - baseline) / (1 - baseline)
    examples: int
    seconds: float
    outcomes: dict  # task label -> each example's outcome, in the evaluation's order: the option chosen, or for
    #                 language modeling 1 if right

    def record(self):
        return {KEY: self.core, "core_accuracy": self.accuracy, "core_centered": self.centered,
                "core_examples": self.examples}

    def line(self):
        return f"core {self.core:.4f} ({len(self.accuracy)} tasks, {self.examples:,} examples, {self.seconds:.0f} s)"


def evaluate(model, bundle, device, autocast_ctx, rank=0, world_size=1, max_per_task=None, block_size=1024,
             tokens_per_pass=16384, fixed_shapes=True):
    """
    The CORE score of model on max_per_task examples of each of the bundle's tasks (None: all), a Result. The ranks
    split the examples, their prompts tokenized once per kind of evaluation (kept in the bundle); every forward pass
    holds at most tokens_per_pass tokens, and under fixed_shapes (for a compiled model) has one of SHAPES shapes.
    Prompts longer than block_size, the model's context, keep their last tokens.
    """
    started, key = time.perf_counter(), (max_per_task, block_size, rank, world_size)
    if key not in bundle.prepared:
        bundle.prepared[key] = prepare(bundle.tasks, max_per_task, block_size, rank, world_size)
    prepared = bundle.prepared[key]
    was_training = model.training
    model.eval()
    with torch.no_grad(), autocast_ctx:
        totals = score_rows(model, prepared, device, tokens_per_pass, block_size, fixed_shapes, world_size).tolist()
    model.train(was_training)
    outcomes = torch.zeros(sum(prepared.counts), dtype=torch.long)  # outcome + 1 at this rank's examples
    for task_index, index, first, count in prepared.examples:
        rows = prepared.rows[first:first + count]
        outcomes[index] = 1 + choice(bundle.tasks[task_index], totals[first:first + count], rows)
    if world_size > 1:
        outcomes = outcomes.to(device)
        dist.all_reduce(outcomes)
    outcomes, offset, accuracy, centered, by_task = (outcomes - 1).tolist(), 0, {}, {}, {}
    for task, count in zip(bundle.tasks, prepared.counts):
        by_task[task.label] = outcomes[offset:offset + count]
        rights = [1 if task.kind == "language_modeling" else example["gold"]  # a language model's outcome: 1 if right
                  for example in chosen_examples(task, max_per_task)]
        right = [outcome == gold for outcome, gold in zip(by_task[task.label], rights)]
        accuracy[task.label] = sum(right) / count
        centered[task.label] = (accuracy[task.label] - task.baseline) / (1 - task.baseline)
        offset += count
    core = sum(centered.values()) / len(centered)
    return Result(core, accuracy, centered, offset, time.perf_counter() - started, by_task)


def check(cfg, env):
    """Refuses a --core-max-per-task below zero, in one line, before the run reads anything (final_settings' checks)."""
    checks.require(cfg, ("core_max_per_task",), lambda v: v >= 0, "zero or more")


def load_run(cfg):
    """The bundle of a training run's CORE evaluations, per its settings (train_gpt2.py's TrainConfig)."""
    return load(cfg.core_data, cfg.cache_dir, cfg.core_max_per_task)


def evaluate_run(run, bundle):
    """The CORE evaluation of a training run (train_gpt2.py's Run) at its step, on the bundle load_run read: (its log
    record's results, its line). --core-max-per-task 0: nanochat's 500 examples a task during training, every one at
    the end; each forward pass as many tokens as a training micro-batch."""
    cfg, env = run.cfg, run.env
    final = cfg.eval_only or run.step == cfg.max_steps
    result = evaluate(run.compiled, bundle, env.device, run.autocast_ctx, env.rank, env.world_size,
                      examples_per_task(cfg.core_max_per_task, final), cfg.block_size,
                      run.micro_batch * cfg.seq_len, cfg.compile)
    return result.record(), result.line()


def card_line(record, published=None):
    """A model card's line on CORE: the score of the weights' logged record (evaluate_run's, with its step), or of
    OpenAI's weights named published as nanochat measured them; else how to measure it."""
    if record is not None:
        return (f"{record[KEY]:.4f} at step {record['step']}, on {record['core_examples']:,} examples of "
                f"{len(record['core_accuracy'])} tasks, scored as nanochat scores it (train_gpt2.py's log.jsonl)")
    if published in OPENAI_CORE:
        return f"{OPENAI_CORE[published]}, as nanochat measured OpenAI's {published} (its 22 tasks)"
    return ("not measured at these weights; `python train_gpt2.py --eval-only --init-from path/to/this/directory "
            "--core-every 1` measures it (DCLM's CORE, as nanochat scores it)")
