"""
Prepare pretraining shards: FineWeb-Edu from the Hugging Face hub, or local text.

    python fineweb.py                      # FineWeb-Edu sample-10BT -> edu_fineweb10B/
    python fineweb.py --input input.txt --output shakespeare --shard-size 100000

Every document is prefixed by <|endoftext|> (50256) and tokenized with the GPT-2
BPE shipped next to this file (gpt2.tiktoken, no network needed). Tokens go into
shards of --shard-size tokens saved as uint16 .npy; the first shard is the
validation split: PREFIX_val_000000.npy, PREFIX_train_000001.npy, ... (the names
and format of build-nanogpt's fineweb.py, so shards are interchangeable).

Hub files are streamed with requests one at a time (HF_ENDPOINT / --endpoint for
mirrors, HF_TOKEN for gated access), checked against their sha256, tokenized by
all cores while the next file downloads, and deleted once tokenized. Interrupt
it any time and run the same command again: it resumes from manifest.json in the
output directory and produces the same bytes as an uninterrupted run.
"""

import argparse
import ctypes
import json
import multiprocessing
import os
import queue
import re
import shutil
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import islice
from urllib.parse import quote

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import requests
import tiktoken
from tqdm import tqdm

from machinery.downloads import (
    CONNECT_TIMEOUT,
    GaveUp,
    Refused,
    Retrying,
    fetch,
    get,
    hub_headers,
    intact,
    sha256_of,
    wait_before_retry,
)
from machinery.errors import BadFile, UsageError
from machinery.files import directory_lock, no_room, parse_json, write_atomically
from machinery.shard_files import MANIFEST, PREPARATION_FILES, SHARD_SUFFIXES, SPLIT_WORD, read_manifest
from machinery.tokenizer import EOT, gpt2_tokenizer

JSONL_LINES_PER_UNIT = 1024  # a jsonl file is tokenized in units of this many lines
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# `kill` and a closed terminal, which end the run as Ctrl-C does (not SIGHUP where there is none: Windows)
STOP_SIGNALS = [getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)]

# -----------------------------------------------------------------------------
# tokenization, in worker processes: each job is one unit of a source file
# (a parquet row group, a batch of jsonl lines or a whole .txt file)

def init_worker(parent_pid):
    global encoding, open_parquet
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    for signum in STOP_SIGNALS:  # as forked, the main process's handler: a SIGTERM from `kill` must end a worker
        signal.signal(signum, signal.SIG_DFL)
    if sys.platform == "linux":  # a `kill -9` of the main process takes the workers with it, not left to finish alone
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # it died before prctl
            os._exit(1)
    encoding = gpt2_tokenizer()
    open_parquet = (None, None)  # (path, ParquetFile): footers of big files take ms to parse

def start_workers(count):
    """The tokenizer processes. With fork they all start here, while this process has a single thread: a fork
    while another thread holds a lock (an import's, say) can leave the child waiting for it forever."""
    # the start method is named because Python 3.14 made forkserver the default on Linux, where the workers' parent
    # would be the fork server, not this process: fork where PR_SET_PDEATHSIG ties them to it, spawn elsewhere
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    pool = ProcessPoolExecutor(count, mp_context=context, initializer=init_worker, initargs=(os.getpid(),))
    # a Ctrl-C (or SIGTERM) while the pool forks its workers lands in an at-fork hook, which swallows the
    # KeyboardInterrupt ("Exception ignored in: _releaseLock") and the run goes on: hold it until the pool is whole
    deferred = []
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, *STOP_SIGNALS)}
    handlers = {signum: handler for signum, handler in handlers.items() if callable(handler)}  # not those ignored
    for signum in handlers:
        signal.signal(signum, lambda signum, frame: deferred.append(signum))
    try:
        pool.submit(int)  # with fork, the first task starts every worker
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    if deferred:
        stop_workers(pool)
        handlers[deferred[0]](deferred[0], None)  # raises as the signal would have
    return pool

def stop_workers(pool):
    # without waiting for the units in flight, which can be a whole .txt file; ProcessPoolExecutor has no public
    # way to do that before Python 3.14's terminate_workers()
    workers = list(pool._processes.values())
    for worker in workers:  # SIGKILL: a worker still starting runs this process's own SIGTERM handler, forked with it
        worker.kill()
    for worker in workers:
        worker.join()
    # a worker stopped while sending its tokens leaves half a message in the result pipe, and the pool's thread
    # would wait in recv() for the rest forever (and shutdown with it): with the last writer closed it reads EOF
    pool._result_queue._writer.close()
    pool.shutdown(cancel_futures=True)

def parquet_file(path):
    global open_parquet
    if open_parquet[0] != path:
        if open_parquet[1] is not None:
            open_parquet[1].close()
        open_parquet = (path, pq.ParquetFile(path))
    return open_parquet[1]

def unit_texts(job):
    kind, path = job[0], job[1]
    if kind == "parquet":
        _, _, row_group, field = job
        try:
            # one thread: the other cores are busy with their own row groups
            column = parquet_file(path).read_row_group(row_group, columns=[field], use_threads=False).column(0)
        except pa.ArrowException as e:
            raise UsageError(f"{path}: cannot read row group {row_group} ({e})")
        return [text for text in column.to_pylist() if text is not None]
    if kind == "jsonl":
        _, _, first_line_number, lines, field = job
        texts = []
        for line_number, line in enumerate(lines, first_line_number):
            if not line.strip():
                continue
            try:
                text = parse_json(line)[field]
            except ValueError as e:
                raise UsageError(f"{path}:{line_number}: malformed JSON ({e}); fix or delete that line")
            except (KeyError, TypeError):
                raise UsageError(f"{path}:{line_number}: no '{field}' field; name the text field with --text-field")
            if not isinstance(text, str):
                raise UsageError(f"{path}:{line_number}: '{field}' is not a string")
            texts.append(text)
        return texts
    with open(path, "rb") as f:
        data = f.read()
    try:
        return [data.decode("utf-8")]
    except UnicodeDecodeError as e:
        raise UsageError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8")

def encode_ordinary(text):
    # encode_to_numpy with no special tokens allowed is encode_ordinary without building a Python list
    try:
        return encoding.encode_to_numpy(text, disallowed_special=())
    except UnicodeEncodeError:  # lone surrogates (from jsonl escapes): repaired as encode_ordinary does
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return encoding.encode_to_numpy(text, disallowed_special=())

def tokenize_unit(job):
    eot = np.array([EOT], dtype=np.uint32)
    pieces = []
    for text in unit_texts(job):
        pieces += (eot, encode_ordinary(text))
    # the GPT-2 vocabulary (50257) fits uint16
    return np.concatenate(pieces).astype(np.uint16) if pieces else np.empty(0, dtype=np.uint16)

def file_units(path, first_unit, field):
    """Yield (unit index, job, fraction of the file) for the units of one source file, from first_unit on."""
    if path.endswith(".parquet"):
        try:
            with pq.ParquetFile(path) as pf:
                schema, row_groups = pf.schema_arrow, pf.num_row_groups
        except pa.ArrowException as e:
            raise UsageError(f"{path} is not a readable parquet file ({e})")
        if field not in schema.names:
            raise UsageError(f"{path} has no '{field}' column (it has {', '.join(schema.names)}); "
                             "name the text column with --text-field")
        column_type = schema.field(field).type
        if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
            raise UsageError(f"{path}: column '{field}' holds {column_type}, not text; "
                             "name the text column with --text-field")
        for row_group in range(first_unit, row_groups):
            yield row_group, ("parquet", path, row_group, field), 1 / row_groups
    elif path.endswith(".jsonl"):
        size = max(os.path.getsize(path), 1)
        with open(path, "rb") as f:
            for _ in islice(f, first_unit * JSONL_LINES_PER_UNIT):
                pass
            unit = first_unit
            while lines := list(islice(f, JSONL_LINES_PER_UNIT)):
                first_line_number = unit * JSONL_LINES_PER_UNIT + 1
                yield unit, ("jsonl", path, first_line_number, lines, field), sum(map(len, lines)) / size
                unit += 1
    elif first_unit == 0:
        yield 0, ("txt", path), 1.0

# -----------------------------------------------------------------------------
# sources: the hub's parquet files, or local files

def refusal(error, args):
    """What the hub's refusal of a request (downloads.Refused) means for this run, and what to do."""
    if error.status in (401, 403):
        return (f"{args.endpoint} refused access to {args.dataset} (HTTP {error.status}); set HF_TOKEN to a "
                "Hugging Face token that can read it (https://huggingface.co/settings/tokens)")
    if error.status == 404:
        return f"{error.url} not found (HTTP 404); check --dataset and --subset"
    return str(error)

def retrying(args, stop):
    """How a failing request is retried: as --retries and --retry-delay say, each retry said above the progress bar."""
    return Retrying(args.retries, args.retry_delay, "--retries, --retry-delay", tqdm.write, stop)

def list_hub_files(args, stop):
    url = f"{args.endpoint}/api/datasets/{args.dataset}/tree/main/{args.subset}"
    session, files, failures = requests.Session(), [], 0
    # first, for a network that drops packets: the first try alone can take that long
    print(f"asking {args.endpoint} for the files of {args.dataset}/{args.subset} (each try waits up to "
          f"{CONNECT_TIMEOUT} s to connect)")
    while url:
        try:
            with get(session, url, hub_headers()) as response:
                entries, next_url = response.json(), response.links.get("next", {}).get("url")
            files += [{"path": e["path"], "size": e["size"], "sha256": (e.get("lfs") or {}).get("oid")}
                      for e in entries if e.get("type") == "file" and e["path"].endswith(".parquet")]
        # first: requests' JSONDecodeError (for a proxy's HTML page, say) is a ValueError but also a
        # RequestException, and asking again would only get the same page
        except (ValueError, KeyError, TypeError, AttributeError):
            raise UsageError(f"unexpected answer from {url} (not the hub's JSON list of files); "
                             "is --endpoint (or HF_ENDPOINT) a Hugging Face hub or mirror?")
        except requests.RequestException as e:
            failures += 1
            wait_before_retry(failures, e, args.endpoint, retrying(args, stop))
            continue
        url = next_url
    if not files:
        raise UsageError(f"no parquet files in {args.dataset}/{args.subset} at {args.endpoint}; check --subset")
    return sorted(files, key=lambda f: f["path"])

def download(source, args, stop):
    """Fetch one hub file into OUTPUT/downloads, verified; a partial .part file is resumed with a Range request."""
    path = os.path.join(args.output, "downloads", os.path.basename(source["path"]))
    if os.path.exists(path):
        if intact(path, source["size"], source["sha256"]):
            return path
        os.remove(path)  # a file of the same name, left by a run with other settings
    os.makedirs(os.path.dirname(path), exist_ok=True)
    url = f"{args.endpoint}/datasets/{args.dataset}/resolve/main/{quote(source['path'])}"
    started = time.perf_counter()
    try:
        if fetch(url, path, path + ".part", source["path"], retrying(args, stop), size=source["size"],
                 sha256=source["sha256"], headers=hub_headers()) is None:
            return None
    except BadFile:
        raise UsageError(f"{source['path']} from {args.endpoint} failed its checksum twice (expected "
                         f"{source['size']:,} bytes with sha256 {source['sha256']}); the mirror may serve a damaged or "
                         "stale copy: try another HF_ENDPOINT")
    megabytes = source["size"] / 1e6
    rate = megabytes / (time.perf_counter() - started)
    tqdm.write(f"downloaded {source['path']} ({megabytes:.0f} MB, {rate:.1f} MB/s)")
    return path

class Downloads:
    """Hub files downloaded one at a time, in the order asked for, by a daemon thread: an interrupted run exits at
    once rather than after a stalled read (closing the socket from another thread would not wake that read)."""

    def __init__(self, sources, args, stop):
        self.sources, self.args, self.stop = sources, args, stop
        self.asked, self.finished, self.changed = queue.Queue(), {}, threading.Condition()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while (i := self.asked.get()) is not None and not self.stop.is_set():
            try:
                outcome = download(self.sources[i], self.args, self.stop), None
            except Exception as e:  # raised in the main thread, by path()
                outcome = None, e
            with self.changed:
                self.finished[i] = outcome
                self.changed.notify()

    def ask(self, i):
        if i < len(self.sources):
            self.asked.put(i)

    def ready(self, i):
        return i in self.finished

    def path(self, i):
        with self.changed:
            self.changed.wait_for(lambda: i in self.finished)
            path, error = self.finished.pop(i)
        if error is not None:
            raise error
        return path

    def close(self):
        """Wait for the download in flight to see `stop`, so that nothing writes in downloads/ any more."""
        self.asked.put(None)
        self.thread.join()

INPUT_SUFFIXES = (".txt", ".jsonl", ".parquet")

def is_hidden(relative):
    """Whether a path relative to an --input directory is hidden: its name or a folder's starts with a dot (Jupyter's
    .ipynb_checkpoints/, macOS's ._a.txt)."""
    return any(part.startswith(".") for part in relative.split(os.sep))

def files_under(directory):
    """The .txt, .jsonl and .parquet files under directory, sorted, and apart those that are hidden: paths relative
    to it."""
    found, hidden = [], []
    for root, _, names in os.walk(directory):
        for name in names:
            if name.endswith(INPUT_SUFFIXES):
                relative = os.path.relpath(os.path.join(root, name), directory)
                (hidden if is_hidden(relative) else found).append(relative)
    return sorted(found), sorted(hidden)

def local_sources(paths, skip_hidden=True):
    """The input files (path, size, checksum) in the order they are read; the hidden files of a directory too unless
    skip_hidden, in the one order of their paths, as fineweb.py read them before it skipped them."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            found, hidden = files_under(path)
            if not skip_hidden:
                found, hidden = sorted(found + hidden), []
            if hidden:  # copies of the data, mostly, which the trainer would never read as shards either
                print(f"--input {path}: skipped {len(hidden)} hidden file{'s' if len(hidden) > 1 else ''}, whose "
                      f"name or folder's starts with a dot (e.g. {hidden[0]}), as train_gpt2.py skips hidden shards")
            if not found:
                raise UsageError(f"--input {path}: no .txt, .jsonl or .parquet files in that directory"
                                 + (" but hidden ones, which are skipped" if hidden else ""))
            files += [os.path.join(path, relative) for relative in found]
        elif not os.path.isfile(path):
            raise UsageError(f"--input {path}: no such file")
        elif not path.endswith(INPUT_SUFFIXES):
            raise UsageError(f"--input {path}: unsupported type; use .txt (one document), .jsonl or .parquet")
        else:
            files.append(path)
    return [{"path": os.path.abspath(p), "size": os.path.getsize(p), "sha256": sha256_of(p)} for p in files]

# -----------------------------------------------------------------------------
# output: shards, the carried partial shard and the manifest, each written whole

def output_lock(output):
    """Refuse to run while another fineweb.py writes the same output directory: the two would mix their shards."""
    return directory_lock(output, f"another fineweb.py is writing {output} ({{holder}}); wait for it to finish or stop "
                                  "it, or choose another --output",
                          f"--output {output}: cannot write in it ({{reason}}); choose a directory this run may "
                          "write to")

# the temp files' names hold neither "train" nor "val", so loaders listing shards never see a half-written one
TEMP_PREFIX = ".writing."
IF_NO_ROOM = "free some space or choose another --output, then run the same command again to resume"

def write_whole(path, write):
    """Writes path whole or not at all with write(file); a full disk is a UsageError that says how to resume."""
    temp = os.path.join(os.path.dirname(path), f"{TEMP_PREFIX}{os.getpid()}.tmp")
    write_atomically(path, write, temp, lambda: IF_NO_ROOM)

def save_manifest(args, manifest):
    path = os.path.join(args.output, MANIFEST)
    write_whole(path, lambda f: f.write(json.dumps(manifest, indent=1).encode()))

def shard_name(prefix, index):
    return f"{prefix}_{'val' if index == 0 else 'train'}_{index:06d}.npy"

def with_flag(flag, value):
    if value is None:
        return f"without {flag}"
    return f"with {flag} {' '.join(value) if isinstance(value, list) else value}"

def hidden_sources(sources, inputs):
    """The paths of the sources that are hidden files of an --input directory, which fineweb.py once read too."""
    directories = [os.path.abspath(path) for path in inputs if os.path.isdir(path)]
    return [source["path"] for source in sources if any(
        source["path"].startswith(directory + os.sep) and is_hidden(os.path.relpath(source["path"], directory))
        for directory in directories)]

def sources_changed(before, now):
    """The first difference between the input files a preparation was started with and these, in words."""
    now_by_path, paths_before = {source["path"]: source for source in now}, {source["path"] for source in before}
    for source in before:
        if source["path"] not in now_by_path:
            return f"{source['path']} is gone"
        if now_by_path[source["path"]] != source:
            return f"{source['path']} changed"
    added = [source["path"] for source in now if source["path"] not in paths_before]
    return f"{added[0]} is new" if added else "they are read in another order"

def open_manifest(args, config, stop):
    """Load the output directory's manifest (refusing a different configuration) or start a new one."""
    try:
        manifest = read_manifest(args.output)  # the trainer's reading of it, as it decides whether to train on them
    except BadFile as e:
        raise UsageError(f"{os.path.join(args.output, MANIFEST)}: {e}; delete {args.output} to start it afresh, or "
                         f"choose another --output")
    resuming = manifest and manifest["next"]["tokens"]  # with no tokens made yet there is nothing to mix: afresh
    read_before = hidden_sources(manifest["sources"], args.input) if resuming and args.input else []
    sources = local_sources(args.input, skip_hidden=not read_before) if args.input else None
    if resuming:
        old_prefix = manifest["config"]["--prefix"]
        if SPLIT_WORD.search(old_prefix):  # fineweb.py once named shards after --output, split word and all
            raise UsageError(f"{args.output} holds shards named {shard_name(old_prefix, 0)}, which train_gpt2.py "
                             f"refuses (the name says both splits); delete {args.output} to make them afresh, "
                             "or choose another --output")
        for flag, value in config.items():
            old = manifest["config"].get(flag)
            if old != value:
                raise UsageError(f"{args.output} holds shards made {with_flag(flag, old)}, not "
                                 f"{with_flag(flag, value)}; rerun {with_flag(flag, old)} to continue them, "
                                 "or choose another --output")
        if sources is not None and sources != manifest["sources"]:
            raise UsageError(f"the input files differ from those {args.output} was started with: "
                             f"{sources_changed(manifest['sources'], sources)}; put them back as they were, or "
                             "choose another --output")
        if read_before:
            print(f"{args.output} was started by an earlier fineweb.py, which read hidden files too: resuming with "
                  f"its list, {len(read_before)} hidden file{'s' if len(read_before) > 1 else ''} and all (e.g. "
                  f"{read_before[0]}), as its shards began")
        return manifest
    # a run of ours stopped (killed, disk full) between renaming its first shard into place and recording it
    ours = manifest and re.compile(rf"{re.escape(manifest['config']['--prefix'])}_(val|train)_\d{{6}}\.npy")
    for name in os.listdir(args.output):
        if ours and ours.fullmatch(name):
            os.remove(os.path.join(args.output, name))  # made again below
        elif name.endswith(SHARD_SUFFIXES) and SPLIT_WORD.search(name):
            raise UsageError(f"{args.output} holds shards without a manifest.json (made by another tool?); "
                             "choose another --output or move them away")
    manifest = {
        "config": config,
        "sources": sources or list_hub_files(args, stop),
        # how many shards are complete, each of --shard-size tokens (the last, at the end, of what is left): not
        # their list, which made each rewrite of the manifest (one a shard) longer than the last
        "shards": 0,
        # the token stream continues at unit `unit` of source `file`, skipping its first `skip` tokens,
        # after the tokens of the shards and of the `carry` file (a partial shard)
        "next": {"file": 0, "unit": 0, "skip": 0, "carry": None, "tokens": 0, "documents": 0},
        "done": False,
    }
    save_manifest(args, manifest)
    return manifest

def carried_tokens(args, manifest):
    """The partial shard that the manifest's "next" resumes with, from its carry file (empty where it names none); a
    UsageError for a place that no run leaves: past the last input file, or a carry damaged or not the tokens
    counted. Resumed, it would write wrong shards, or mark the set complete with inputs unread."""
    state, path = manifest["next"], os.path.join(args.output, MANIFEST)
    afresh = f"delete {args.output} to start it afresh, or choose another --output"
    if state["file"] > len(manifest["sources"]):
        raise UsageError(f"{path}: it resumes at input file {state['file'] + 1} of {len(manifest['sources'])}, past "
                         f"the last: it is damaged; {afresh}")
    if not state["carry"]:
        return np.empty(0, dtype=np.uint16)
    counted = state["tokens"] - manifest["shards"] * args.shard_size  # the tokens past the whole shards
    carry_path = os.path.join(args.output, state["carry"])
    said = f"{carry_path}: the partial shard that {path} resumes with"
    try:
        carry = np.load(carry_path)
    except (OSError, ValueError, EOFError) as e:
        raise UsageError(f"{said} cannot be read ({getattr(e, 'strerror', None) or e}); {afresh}") from None
    tokens = isinstance(carry, np.ndarray) and carry.dtype == np.uint16 and carry.shape == (counted,)
    if not tokens or not 0 < counted < args.shard_size:
        raise UsageError(f"{said} is not the {counted:,} tokens (uint16) that it counts: it is damaged; {afresh}")
    return carry

class ShardWriter:
    """The token stream cut into shards, and the manifest's record of where it stands: a resumed run goes on from
    there and writes the same bytes."""

    def __init__(self, args, manifest):
        self.args, self.manifest = args, manifest
        self.state = manifest["next"]
        self.shard = np.empty(args.shard_size, dtype=np.uint16)
        carry = carried_tokens(args, manifest)
        self.shard[:len(carry)] = carry
        self.fill = len(carry)
        self.tokens = self.tokens_at_start = self.state["tokens"]
        self.documents = self.state["documents"]

    def checkpoint(self, file, unit, skip):
        """Record where the stream goes on, as the manifest's "next" says, with the partial shard as the carry: the
        manifest names a new carry only once it is whole, and the old one goes only once no manifest names it."""
        state, carry = self.state, self.shard[:self.fill]
        old_carry = state["carry"]
        state.update(file=file, unit=unit, skip=skip, carry=None, tokens=self.tokens, documents=self.documents)
        if len(carry):
            state["carry"] = f".carry_{file:06d}.npy"
            write_whole(os.path.join(self.args.output, state["carry"]), lambda f: np.save(f, carry))
        save_manifest(self.args, self.manifest)
        if old_carry and old_carry != state["carry"]:
            os.remove(os.path.join(self.args.output, old_carry))

    def write_shard(self):
        name, tokens = shard_name(self.args.prefix, self.manifest["shards"]), self.shard[:self.fill]
        write_whole(os.path.join(self.args.output, name), lambda f: np.save(f, tokens))
        self.manifest["shards"] += 1
        self.fill = 0

    def append(self, unit_tokens, consumed, file, unit, bar):
        """Add a unit's tokens from `consumed` on, up to --max-tokens; each full shard is written and recorded."""
        args = self.args
        while consumed < len(unit_tokens) and self.tokens != args.max_tokens:
            take = min(args.shard_size - self.fill, len(unit_tokens) - consumed)
            if args.max_tokens is not None:
                take = min(take, args.max_tokens - self.tokens)
            self.shard[self.fill:self.fill + take] = unit_tokens[consumed:consumed + take]
            self.documents += int(np.count_nonzero(self.shard[self.fill:self.fill + take] == EOT))
            self.fill, consumed, self.tokens = self.fill + take, consumed + take, self.tokens + take
            bar.update(take)
            if self.fill == args.shard_size:
                self.write_shard()
                self.checkpoint(file, unit, consumed)

# -----------------------------------------------------------------------------

def check_tiktoken():
    version = getattr(tiktoken, "__version__", "0.0")
    if tuple(int(part) for part in version.split(".")[:2]) < (0, 11):
        # before 0.11, encode_to_numpy turned "<|endoftext|>" in a text into the special token
        raise UsageError(f"tiktoken {version} is too old; pip install 'tiktoken>=0.11'")

def shard_config(args):
    """The flags that shape the shards, which a resumed run must repeat."""
    # --input first: between a hub directory and a local one, that is the flag to name
    config = {"--input": [os.path.abspath(p) for p in args.input] if args.input else None}
    if not args.input:
        config.update({"--dataset": args.dataset, "--subset": args.subset})
    config.update({"--text-field": args.text_field, "--shard-size": args.shard_size,
                   "--prefix": args.prefix, "--max-tokens": args.max_tokens})
    return config

def deletes_downloads(args):
    return not args.input and not args.keep_downloads

def remove_leftovers(args, manifest):
    # leftovers of a killed run (the lock says none is running): temp files, a superseded carry
    state = manifest["next"]
    for name in os.listdir(args.output):
        if name.startswith(TEMP_PREFIX) or (name.startswith(".carry_") and name != state["carry"]):
            os.remove(os.path.join(args.output, name))
    if deletes_downloads(args):
        for source in manifest["sources"][:state["file"]]:
            finished = os.path.join(args.output, "downloads", os.path.basename(source["path"]))
            if os.path.exists(finished):
                os.remove(finished)

def units_in_order(args, sources, start_file, start_unit, downloads, pending):
    """(file, unit, fraction of the file, job) for each unit, then (file, None, 0, path) at the end of the file;
    None while a hub file is still downloading and units are in flight."""
    for i in range(start_file, len(sources)):
        first_unit = start_unit if i == start_file else 0
        if downloads:
            # the units in flight are finished before waiting for a download: the end of the previous file
            # deletes its parquet and asks for the next download
            while pending and not downloads.ready(i):
                yield None
            path = downloads.path(i)
        else:
            path = sources[i]["path"]
        for unit, job, fraction in file_units(path, first_unit, args.text_field):
            yield i, unit, fraction, job
        yield i, None, 0, path  # end of file i

def submit_units(units, pending, pool, window):
    """Fill the window of units in flight; returns the error of a failed download, to raise once they are done."""
    while len(pending) < window:
        try:
            item = next(units, None)
        except (UsageError, OSError) as e:
            return e  # a download failed: finish the units in flight first, so they are kept
        if item is None:  # no more inputs, or the next one is still downloading
            return None
        i, unit, fraction, job = item
        pending.append((i, unit, fraction, job if unit is None else pool.submit(tokenize_unit, job)))
    return None

def tokenize(args, writer, pool, downloads, bar):
    sources = writer.manifest["sources"]
    start_file, start_unit, start_skip = writer.state["file"], writer.state["unit"], writer.state["skip"]
    total_bytes = sum(s["size"] for s in sources[start_file:])
    bytes_read = tokens_read = 0
    pending = deque()
    units, failure = units_in_order(args, sources, start_file, start_unit, downloads, pending), None
    while True:
        # units are tokenized in parallel, in a bounded window, and consumed in order
        if failure is None:
            failure = submit_units(units, pending, pool, 2 * args.workers)
        if not pending:
            break
        i, unit, fraction, result = pending.popleft()
        if unit is None:  # a source file is finished
            if deletes_downloads(args):
                writer.checkpoint(i + 1, 0, 0)  # its tokens are safe, the file can go
                os.remove(result)
            if downloads:
                downloads.ask(i + 2)  # only now: at most two parquet files on disk
            continue
        unit_tokens = result.result()
        skip = start_skip if (i, unit) == (start_file, start_unit) else 0
        bytes_read += fraction * sources[i]["size"]
        tokens_read += len(unit_tokens) - skip
        writer.append(unit_tokens, skip, i, unit, bar)
        if writer.tokens == args.max_tokens:
            break
        estimate = writer.tokens + tokens_read / max(bytes_read, 1) * (total_bytes - bytes_read)
        bar.total = int(min(estimate, args.max_tokens or estimate))
    if failure is not None:
        raise failure

def finish(args, writer, start):
    if writer.tokens == writer.documents:
        raise UsageError("no text found in the inputs (no documents, or only empty ones); check them and --text-field")
    if writer.fill:
        writer.write_shard()
    writer.manifest["done"] = True
    writer.checkpoint(len(writer.manifest["sources"]), 0, 0)
    if deletes_downloads(args):  # what --max-tokens left unread
        shutil.rmtree(os.path.join(args.output, "downloads"))
    elapsed = time.perf_counter() - start
    tokens, shards = writer.tokens, writer.manifest["shards"]
    print(f"done: {writer.documents:,} documents, {tokens:,} tokens in {shards} shards "
          f"(1 val + {shards - 1} train) in {args.output}; {elapsed:.1f} s, "
          f"{(tokens - writer.tokens_at_start) / elapsed:,.0f} tokens/s")
    if shards == 1:
        print(f"warning: only a validation shard was written; lower --shard-size (now {args.shard_size:,}) "
              "to get train shards")

def prepare(args):
    check_tiktoken()
    chosen = args.shard_size is None
    if chosen:
        args.shard_size, chosen = default_shard_size(args)
    stop = threading.Event()
    manifest = open_manifest(args, shard_config(args), stop)
    sources, state = manifest["sources"], manifest["next"]
    if manifest["done"]:
        print(f"{args.output} is already complete: {state['documents']:,} documents, {state['tokens']:,} tokens "
              f"in {manifest['shards']} shards; nothing to do")
        return
    writer = ShardWriter(args, manifest)  # first: it refuses a damaged position before any file goes
    remove_leftovers(args, manifest)
    hub, tokens = not args.input, writer.tokens
    size = f"{args.shard_size:,} tokens per shard" + (" (for a small input: --shard-size sets it)" if chosen else "")
    print(f"{'resuming' if tokens else 'preparing'} {len(sources)} {'hub' if hub else 'local'} files "
          f"({in_bytes(sum(s['size'] for s in sources))}) -> {args.output}, {size}, {args.workers} workers"
          + (f", {tokens:,} tokens already done" if tokens else ""))
    pool = start_workers(args.workers)
    downloads = None
    if hub:
        downloads = Downloads(sources, args, stop)
        downloads.ask(state["file"])
        downloads.ask(state["file"] + 1)  # the next file downloads while this one is tokenized
    start = time.perf_counter()
    bar = tqdm(total=args.max_tokens, initial=tokens, unit="tok", unit_scale=True, mininterval=1,
               desc="tokenizing", dynamic_ncols=True)
    try:
        tokenize(args, writer, pool, downloads, bar)
    except BrokenProcessPool:
        raise UsageError("a tokenizer worker died (killed, most likely for lack of memory); run the same command "
                         "again to resume, with fewer --workers if memory is short") from None
    finally:
        stop.set()  # ends the download in flight, unless it is stalled
        bar.close()
        stop_workers(pool)
    if downloads:
        downloads.close()
    finish(args, writer, start)

# -----------------------------------------------------------------------------

DEFAULT_SHARD_SIZE = 10**8  # tokens: build-nanogpt's FineWeb shards
SMALLEST_SHARD_SIZE = 10_000  # tokens: fewer would validate on too little text to say anything
BYTES_PER_TOKEN = 3.3  # of English text in GPT-2's tokens (tiny Shakespeare's: 1,115,394 bytes, 338,025 tokens)

def default_shard_size(args):
    """--shard-size where it is not given, and whether a small input chose it: that of the shards a preparation in
    --output is making or made (the same command carries on, whatever its inputs became), else 100M tokens, or for
    local text a tenth of its tokens (about) if that is less, but not under SMALLEST_SHARD_SIZE. So a small input makes
    1 validation shard and about 9 train shards, not a validation shard alone."""
    try:
        manifest = read_manifest(args.output)
    except BadFile:  # open_manifest says what is wrong with it
        manifest = None
    made = manifest and manifest["next"]["tokens"] and manifest["config"].get("--shard-size")
    if isinstance(made, int) and made > 0:
        return made, False
    tenth = int(input_bytes(args.input) / BYTES_PER_TOKEN / 10) if args.input else DEFAULT_SHARD_SIZE
    return max(SMALLEST_SHARD_SIZE, min(DEFAULT_SHARD_SIZE, tenth)), tenth < DEFAULT_SHARD_SIZE

def input_bytes(paths):
    """The bytes of the local input files that local_sources reads (0 for a path that is none: it says why)."""
    files = [os.path.join(path, name) for path in paths if os.path.isdir(path) for name in files_under(path)[0]]
    return sum(os.path.getsize(path) for path in files + [p for p in paths if os.path.isfile(p)])

def in_bytes(size):
    """A size in bytes, in words: 812 bytes, 1.1 MB, 27.4 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"

def usable_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # macOS has no affinity

def default_prefix(output):
    """The output directory's name less its split words: shakespeare_train/ gets shakespeare_val_000000.npy, ...
    where shakespeare_train_val_000000.npy would name both splits, and the trainer would refuse it."""
    name = SPLIT_WORD.sub("", os.path.basename(os.path.abspath(output))).strip("_.-")
    return name or "shard"

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", metavar="PATH",
                        help="local .txt (one document each), .jsonl or .parquet files or directories of them, "
                             "instead of the hub dataset")
    parser.add_argument("--output", help="shard directory (default: edu_fineweb10B for the hub dataset)")
    parser.add_argument("--prefix", help="shard name prefix (default: edufineweb for the hub, else the --output name "
                                         "less any word train or val)")
    parser.add_argument("--shard-size", type=int, help="tokens per shard (default: 100M; with --input, a tenth of "
                                                       "the text's tokens, about, if that is less)")
    parser.add_argument("--max-tokens", type=int, help="stop after this many tokens, for trials")
    parser.add_argument("--workers", type=int, default=usable_cores(), help="tokenizer processes (default: all cores)")
    parser.add_argument("--text-field", default="text", help="jsonl field / parquet column holding the text")
    parser.add_argument("--dataset", default="HuggingFaceFW/fineweb-edu", help="hub dataset")
    parser.add_argument("--subset", default="sample/10BT", help="folder of the dataset, e.g. sample/100BT")
    parser.add_argument("--endpoint", default=os.environ.get("HF_ENDPOINT", "https://huggingface.co"),
                        help="hub or mirror URL (default: $HF_ENDPOINT or https://huggingface.co)")
    parser.add_argument("--keep-downloads", action="store_true", help="keep the parquet files in OUTPUT/downloads")
    parser.add_argument("--retries", type=int, default=10, help="retries of a failing request (default: 10)")
    parser.add_argument("--retry-delay", type=float, default=1.0, help="first retry wait in seconds, doubling")
    args = parser.parse_args(argv)
    if args.input and not args.output:
        sys.exit("error: --input needs --output DIR, the directory for the shards")
    args.output = args.output or "edu_fineweb10B"
    if not args.prefix:
        args.prefix = "edufineweb" if not args.input else default_prefix(args.output)
    elif SPLIT_WORD.search(args.prefix):
        sys.exit(f"error: --prefix {args.prefix} holds the word {SPLIT_WORD.search(args.prefix).group(1)!r}, which "
                 "train_gpt2.py reads as a shard's split; choose a prefix without train or val as a word")
    elif args.prefix.startswith(".") or "/" in args.prefix or os.sep in args.prefix:
        sys.exit(f"error: --prefix {args.prefix} would name hidden files or files in another directory; "
                 "choose a plain name such as edufineweb (the directory goes in --output)")
    args.endpoint = args.endpoint.rstrip("/")
    if not args.endpoint.startswith(("http://", "https://")):
        sys.exit(f"error: --endpoint (or HF_ENDPOINT) {args.endpoint!r} is not a URL; e.g. https://huggingface.co")
    for flag, value, least in (("--shard-size", args.shard_size, 1), ("--max-tokens", args.max_tokens, 1),
                               ("--workers", args.workers, 1),
                               ("--retries", args.retries, 0)):
        if value is not None and value < least:
            sys.exit(f"error: {flag} must be at least {least}")
    return args

def remove_if_nothing_made(output):
    """Empties an output directory this run made if all it holds is a manifest (of no tokens: there are no shards)
    and downloads/ with no byte downloaded: the lock's clean-up then removes it. Left behind, it would stand at the
    trainer's default --data, looking like shards."""
    downloads = os.path.join(output, "downloads")
    try:
        partial = os.listdir(downloads) if os.path.isdir(downloads) else []
        if not set(os.listdir(output)) <= {".lock", *PREPARATION_FILES} or any(
                os.path.getsize(os.path.join(downloads, name)) for name in partial):
            return
        shutil.rmtree(downloads, ignore_errors=True)
        os.remove(os.path.join(output, MANIFEST))
    except OSError:  # no manifest, or a download that ended meanwhile (its thread does not wait for this one)
        pass

class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread as Ctrl-C raises KeyboardInterrupt: the same clean-up runs."""

def stop_on_signal(signum, frame):
    raise Stopped(signum)

def stop_on_signals():
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) == signal.SIG_DFL:  # one ignored (nohup's SIGHUP) stays ignored
            signal.signal(signum, stop_on_signal)

def main(argv=None):
    args = parse_args(argv)
    made = not os.path.exists(args.output)
    try:
        with output_lock(args.output):
            try:
                prepare(args)
            finally:
                if made:
                    remove_if_nothing_made(args.output)
    except GaveUp as e:
        sys.exit(f"error: giving up on {args.endpoint} after {e.retries} retries ({e}); check the network or proxy, "
                 "or point HF_ENDPOINT (or --endpoint) at a mirror, e.g. https://hf-mirror.com")
    except Refused as e:
        sys.exit(f"error: {refusal(e, args)}")
    except UsageError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt as e:
        print("\ninterrupted; run the same command again to resume", file=sys.stderr)
        sys.exit(128 + e.args[0] if isinstance(e, Stopped) else 130)
    except OSError as e:
        reason = no_room(e)  # of a write outside write_whole: a download's
        if reason:
            sys.exit(f"error: {reason} writing {e.filename or args.output}: {IF_NO_ROOM}")
        sys.exit(f"error: {e}")

if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # each line as it is said, into a log file too
    stop_on_signals()
    main()
