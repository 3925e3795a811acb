"""
The DCLM CORE score (Li et al., DataComp-LM: https://arxiv.org/abs/2406.11794) of GPT-2 style models, computed as
nanochat computes it, so that the numbers compare: the mean over the bundle's 22 in-context-learning tasks of each
task's accuracy centered on its random baseline b, (acc - b) / (1 - b). nanochat measured OpenAI's GPT-2 on it: 124M
0.1139, 355M 0.1849, 774M 0.2146, 1.5B 0.2565 (its "time to GPT-2" leaderboard is defined by the 1.5B's).

    python train_gpt2.py --eval-only --init-from gpt2 --core-every 1              # OpenAI's GPT-2 124M
    python train_gpt2.py --eval-only --resume log/ckpt_019073.pt --core-every 1   # a checkpoint, or an export:
    python train_gpt2.py --eval-only --init-from hf/run1 --core-every 1

What is nanochat's, as read in karpathy/nanochat (nanochat/core_eval.py, scripts/base_eval.py, nanochat/tokenizer.py;
scripts/base_train.py's CORE settings as its forks quote them) and, for the bundle's format, in mlfoundations/dclm
(eval/*.yaml, eval/eval_meta_data_v1.csv):
- the bundle: eval_bundle.zip (CORE_BUNDLE_URL, nanochat's EVAL_BUNDLE_URL; CORE_BUNDLE_SHA256, the sha256 that
  several projects using it pin: there was no internet here to fetch it),
  holding eval_bundle/core.yaml, whose `icl_tasks` each give a label, a dataset_uri under eval_data/, num_fewshot (a
  list: its first number), an icl_task_type (multiple_choice, schema or language_modeling) and an optional
  continuation_delimiter (" " if not given); eval_meta_data.csv, whose "Random baseline" of each "Eval Task" is in
  percent; and the task files, a JSON example a line: multiple choice {query, choices, gold}, schema {context_options,
  continuation, gold}, language modeling {context, continuation}.
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
import csv
import math
import os
import random
import shutil
import time
import uuid
import zipfile
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from machinery import checks, downloads, files
from machinery.downloads import default_cache_dir
from machinery.errors import BadFile, UsageError
from machinery.ranks import failing_together
from machinery.tokenizer import EOT, gpt2_tokenizer

CORE_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
CORE_BUNDLE_SHA256 = "90a7c19e28ee7a52b4f6e1f87658deb9fde7f63deba2379045bdb1fe9ea5d200"
BUNDLE = "eval_bundle"  # the directory the zip holds, and its name in the cache
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
EVERY = "core_every"  # the training run's setting of the steps between its evaluations
NAME, KEY = "CORE", "core"  # on a model card; the score its log records hold
OPENAI_CORE = {"gpt2": 0.1139, "gpt2-medium": 0.1849, "gpt2-large": 0.2146, "gpt2-xl": 0.2565}  # as nanochat measured
IN_TRAINING = 500  # examples a task in the evaluations during training, as nanochat's base_train
SHUFFLE_SEED, FEWSHOT_SEED = 1337, 1234
SHAPES = 3  # under torch.compile, rows are padded to block_size, block_size / 2, ..., one graph each
SCORED = 4  # under torch.compile, a pass of n tokens scores n / SCORED at most, those logits alone computed


class Task(NamedTuple):
    label: str
    kind: str  # its icl_task_type
    num_fewshot: int
    delimiter: str  # between a prompt's context and its continuation
    baseline: float  # the accuracy of guessing, in [0, 1)
    examples: list  # of dicts, in the file's order
    path: str


class Bundle(NamedTuple):
    tasks: list
    prepared: dict  # (max_per_task, block_size, rank, world_size) -> Prepared: prompts are tokenized once


def examples_per_task(max_per_task, final):
    """The examples a task in an evaluation, per --core-max-per-task: 0 is nanochat's way, IN_TRAINING of them during
    training and every one in the final evaluation (and --eval-only's); None for every one."""
    return max_per_task or (None if final else IN_TRAINING)


# -----------------------------------------------------------------------------
# The bundle: downloaded once, read, checked


def load(directory, cache_dir, max_per_task):
    """The bundle's tasks from directory, or downloaded once into cache_dir ("" for either: the default), each
    checked to hold enough examples for the evaluations that --core-max-per-task max_per_task asks for."""
    path = directory or fetch_bundle(cache_dir or default_cache_dir())
    fix = f"delete {path} to download it again" if not directory else "fix it, or pass --core-data a good copy"
    tasks = read_bundle(path, fix)
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


def fetch_bundle(cache_dir):
    """The bundle's directory in cache_dir, downloaded (CORE_BUNDLE_URL, or $CORE_BUNDLE_URL's mirror) and unpacked
    once per node, and once for the runs that share the cache: the first holds a lock that the others wait on."""
    directory, zip_path = os.path.join(cache_dir, BUNDLE), os.path.join(cache_dir, f"{BUNDLE}.zip")
    url = os.environ.get("CORE_BUNDLE_URL", CORE_BUNDLE_URL)
    with failing_together():  # also the wait: it ends once every node's bundle is there
        if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not os.path.isdir(directory):
            unwritable = (f"cannot write to the cache directory {cache_dir} ({{reason}}); pass --cache-dir or set "
                          f"$GPT2_CACHE_DIR to a writable directory, or pass --core-data DIR")
            with files.waiting_for_lock(os.path.join(cache_dir, f"{BUNDLE}.lock"), unwritable):
                if not os.path.isdir(directory):  # another run may have unpacked it while this one waited
                    if not os.path.exists(zip_path):  # one left by a run stopped while unpacking was checked
                        print(f"downloading {url} to {zip_path}")
                        downloads.download(url, zip_path, check_zip, "CORE bundle",
                                          f"pass --core-data DIR (an unzipped copy of {os.path.basename(url)})")
                    unpack(zip_path, directory)
    return directory


def check_zip(path):
    """Raises BadFile unless path is the bundle's zip: its checksum, and its core.yaml in eval_bundle/."""
    digest = downloads.sha256_of(path)
    if digest != CORE_BUNDLE_SHA256:
        raise BadFile(f"its sha256 is {digest}, not {CORE_BUNDLE_SHA256}")
    try:
        with zipfile.ZipFile(path) as bundle:
            if f"{BUNDLE}/core.yaml" not in bundle.namelist():
                raise BadFile(f"it holds no {BUNDLE}/core.yaml")
    except zipfile.BadZipFile as e:
        raise BadFile(f"not a zip file ({e})")


def unpack(zip_path, directory):
    """The zip's eval_bundle/ into directory, whole or not at all; the zip is deleted once it is there."""
    temp = f"{directory}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with zipfile.ZipFile(zip_path) as bundle:
            bundle.extractall(temp)
        os.rename(os.path.join(temp, BUNDLE), directory)
        os.remove(zip_path)
    except OSError as e:
        files.raise_if_no_room(e, directory, lambda: "make room in the cache directory, or pass --core-data DIR")
        raise UsageError(f"cannot unpack {zip_path} into {directory} ({e}); pass --cache-dir or set "
                         f"$GPT2_CACHE_DIR to a writable directory, or pass --core-data DIR") from None
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def read_bundle(directory, fix):
    """The tasks of the bundle in directory, as its core.yaml lists them, with their baselines and examples. Raises
    UsageError, naming the file (and line) and ending with fix, what to do about it."""
    config_path, meta_path = os.path.join(directory, "core.yaml"), os.path.join(directory, "eval_meta_data.csv")
    if not os.path.isfile(config_path):
        raise UsageError(f"CORE bundle {directory}: no core.yaml in it; pass --core-data the eval_bundle directory "
                         f"that eval_bundle.zip unpacks to")
    baselines = read_baselines(meta_path, fix)
    tasks, numbers = [], {}  # numbers: the task number of each label
    for number, entry in enumerate(read_config(config_path, fix), start=1):
        where = f"{config_path}: task {number}"
        if not (isinstance(entry, dict) and isinstance(entry.get("label"), str)
                and isinstance(entry.get("dataset_uri"), str)):
            raise UsageError(f"{where} needs a label and a dataset_uri; {fix}")
        label, kind = entry["label"], entry.get("icl_task_type")
        if label in numbers:  # a label names a task's baseline and its scores: the second would take the first's
            raise UsageError(f"{where} has the label {label}, as task {numbers[label]} has; each task needs a label "
                             f"of its own, naming its row of {meta_path} (its random baseline); {fix}")
        numbers[label] = number
        if kind not in TASK_TYPES:
            raise UsageError(f"{where} ({label}) has icl_task_type {kind!r}; CORE knows {', '.join(TASK_TYPES)}; "
                             f"{fix}")
        shots = entry.get("num_fewshot")
        shots = shots[0] if isinstance(shots, list) and shots else shots
        delimiter = entry.get("continuation_delimiter", " ")
        if not (isinstance(shots, int) and not isinstance(shots, bool) and shots >= 0 and isinstance(delimiter, str)):
            raise UsageError(f"{where} ({label}) needs num_fewshot, a number of examples from 0 (as [10]), and a "
                             f"continuation_delimiter that is text, if any; {fix}")
        if label not in baselines:
            raise UsageError(f"{where} ({label}) is not in {meta_path} (its \"Eval Task\" column): no random baseline "
                             f"to center it on; {fix}")
        path = os.path.join(directory, "eval_data", entry["dataset_uri"])
        tasks.append(Task(label, kind, shots, delimiter, baselines[label], read_examples(path, kind, label, fix),
                          path))
    return tasks


def read_config(path, fix):
    """core.yaml's icl_tasks."""
    try:
        import yaml
    except ImportError:
        raise UsageError("the CORE evaluation reads its bundle's core.yaml with PyYAML, which is not installed: "
                         "pip install pyyaml")
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError) as e:  # RecursionError: nested too deep
        raise UsageError(f"cannot read {path} ({files.first_line(e)}); {fix}")
    if not (isinstance(config, dict) and isinstance(config.get("icl_tasks"), list) and config["icl_tasks"]):
        raise UsageError(f"{path} lists no icl_tasks; {fix}")
    return config["icl_tasks"]


def read_baselines(path, fix):
    """eval_meta_data.csv's random baseline of each task, as a fraction."""
    baselines = {}
    try:
        with open(path, encoding="utf-8", newline="") as f:
            rows = csv.DictReader(f)
            if not {"Eval Task", "Random baseline"} <= set(rows.fieldnames or ()):
                raise UsageError(f"{path} has no \"Eval Task\" and \"Random baseline\" columns; {fix}")
            for row in rows:
                try:
                    baseline = float(row["Random baseline"])
                except (TypeError, ValueError):
                    baseline = math.nan
                if not 0 <= baseline < 100:
                    raise UsageError(f"{path}: line {rows.line_num} has no random baseline from 0 to 100 (percent); "
                                     f"{fix}")
                baselines[row["Eval Task"]] = baseline / 100
    except FileNotFoundError:
        raise UsageError(f"CORE bundle {os.path.dirname(path)}: no eval_meta_data.csv in it; {fix}")
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise UsageError(f"cannot read {path} ({e}); {fix}")
    return baselines


# the fields of an example of each kind: (text fields, the list of options, or None)
FIELDS = {"multiple_choice": (("query",), "choices"), "schema": (("continuation",), "context_options"),
          "language_modeling": (("context", "continuation"), None)}


def read_examples(path, kind, label, fix):
    """A task file's examples, each checked to have its kind's fields; numbers in the text fields become text, as
    nanochat's templates render them."""
    text_fields, options = FIELDS[kind]
    needs = ", ".join(text_fields + ((options, "gold") if options else ()))
    examples = []
    try:
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    example = files.parse_json(line)
                    if not isinstance(example, dict):
                        raise ValueError("not a JSON object")
                    example = dict(example, **{field: text(example[field]) for field in text_fields})
                    if options:
                        if not isinstance(example[options], list):  # a string's letters would be its options
                            raise ValueError(f"its {options} is a {type(example[options]).__name__}, not a list")
                        example[options] = [text(option) for option in example[options]]
                        gold = example["gold"]
                        if not (isinstance(gold, int) and not isinstance(gold, bool)
                                and 0 <= gold < len(example[options])):
                            raise ValueError(f"its gold {gold!r} is not the index of one of its {options}")
                except (ValueError, KeyError, TypeError) as e:
                    raise UsageError(f"CORE task {label}: {path}: line {line_number} is not a {kind} example ({e}; "
                                     f"it needs {needs}); {fix}")
                examples.append(example)
    except FileNotFoundError:
        raise UsageError(f"CORE task {label}: its file {path} is missing; {fix}")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"CORE task {label}: cannot read {path} ({e}); {fix}")
    return examples


def text(value):
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TypeError(f"{value!r} is not text")
    return str(value)


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
