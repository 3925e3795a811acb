"""
DCLM's CORE bundle, the data of core_score.py's evaluation: downloaded once per node (and once for the runs that share a
cache), checked, and read into its tasks; anything wrong in it is refused in one line that names the file (and line)
and says what to do. As nanochat uses it, in the format mlfoundations/dclm gives it (eval/*.yaml,
eval/eval_meta_data_v1.csv): eval_bundle.zip (CORE_BUNDLE_URL, nanochat's EVAL_BUNDLE_URL; CORE_BUNDLE_SHA256, the
sha256 that several projects using it pin: there was no internet here to fetch it),
holding eval_bundle/core.yaml, whose `icl_tasks` each give a label, a dataset_uri under eval_data/, num_fewshot (a
list: its first number), an icl_task_type (multiple_choice, schema or language_modeling) and an optional
continuation_delimiter (" " if not given); eval_meta_data.csv, whose "Random baseline" of each "Eval Task" is in
percent; and the task files, a JSON example a line: multiple choice {query, choices, gold}, schema {context_options,
continuation, gold}, language modeling {context, continuation}.
"""

import csv
import math
import os
import shutil
import uuid
import zipfile
from typing import NamedTuple

from machinery import downloads, files
from machinery.errors import BadFile, UsageError
from machinery.ranks import failing_together

CORE_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
CORE_BUNDLE_SHA256 = "90a7c19e28ee7a52b4f6e1f87658deb9fde7f63deba2379045bdb1fe9ea5d200"
BUNDLE = "eval_bundle"  # the directory the zip holds, and its name in the cache
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")


class Task(NamedTuple):
    label: str
    kind: str  # its icl_task_type
    num_fewshot: int
    delimiter: str  # between a prompt's context and its continuation
    baseline: float  # the accuracy of guessing, in [0, 1)
    examples: list  # of dicts, in the file's order
    path: str


def fetch(cache_dir):
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


def read(directory, fix):
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
        for line_number, example, error in files.json_lines(path):
            if isinstance(error, UnicodeDecodeError):
                raise error  # the file cannot be read as text: below
            try:
                if error is not None:
                    raise error
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
