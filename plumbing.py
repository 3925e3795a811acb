"""
The plumbing of a training run: what train_gpt2.py, hellaswag.py and fineweb.py need that teaches nothing about GPT-2.

- the GPT-2 tokenizer from the shipped gpt2.tiktoken;
- one-line errors, agreed on by every rank, or taken from a rank that failed alone;
- JSON read from files that may be damaged: one file, or a JSON-lines file line by line;
- shard files: how their names say their split, their two formats (.npy, and llm.c's .bin), and fineweb.py's
  manifest of them;
- files written whole or not at all, and what to say when the disk, a quota or a file-size limit stops a write;
- directory locks (run_files.py holds the log directory's, with all else a run writes there);
- downloads into a cache that the processes of a node share;
- the CPU heap setting.

It never imports torch at the top: fineweb.py, which never runs distributed, should not wait a second to import it.
"""

import contextlib
import ctypes
import errno
import functools
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import uuid

import numpy as np
import requests
import tiktoken
from safetensors import safe_open
from tiktoken.load import load_tiktoken_bpe

try:
    import fcntl
    import resource  # here, not where it is used: a process at its open-file limit can import nothing
except ImportError:  # Windows: two runs in one directory are not caught there, nor an open-file limit named
    fcntl = resource = None

HERE = os.path.dirname(os.path.abspath(__file__))

# -----------------------------------------------------------------------------
# The GPT-2 tokenizer, and shard names

GPT2_VOCAB = 50257  # tokens of the GPT-2 tokenizer
EOT = 50256  # <|endoftext|>, which separates documents
GPT2_BPE_FILE = os.path.join(HERE, "gpt2.tiktoken")  # GPT-2's BPE ranks, shipped (tiktoken's r50k_base)
# a shard's split is a whole word of its name (x_val_000000.npy, x_train.bin), so that "interval_train" is no val shard
SPLIT_WORD = re.compile(r"(?:^|[_.-])(train|val)(?=[_.-]|$)")


@functools.cache
def gpt2_tokenizer():
    """The GPT-2 BPE from the shipped gpt2.tiktoken (tiktoken's r50k_base): no network needed. Read once per process:
    parsing its 50,000 ranks takes a noticeable fraction of a second, and evaluations and samples ask for it often."""
    ranks = load_tiktoken_bpe(GPT2_BPE_FILE)
    pattern = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    return tiktoken.Encoding("gpt2", pat_str=pattern, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": EOT})


# -----------------------------------------------------------------------------
# One-line errors, on every rank


class UsageError(Exception):
    """A mistake or a problem the user can fix: the command line prints it as one line, without a traceback."""


class DataError(UsageError):
    """Training data that cannot be read, or holds what no model can train on, found as the stream reaches it."""


def every_rank(value):
    """[each rank's value], on every rank; [value] in a single process. All ranks must call it."""
    import torch.distributed as dist  # here, not at the top: see the module's docstring

    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def first_error_of_any_rank(error):
    """The first rank's error message (or None), on every rank: a rank that stopped alone would leave the others
    waiting in their next collective, forever under NCCL, or dying in it with tracebacks. All ranks must call it."""
    return next((e for e in every_rank(error) if e is not None), None)


# how a collective breaks as a process in it dies: gloo's connection to it closed or reset, NCCL's ncclRemoteError
PEER_DIED = r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited"


def dead_peer(error):
    """Which rank died, in words ("rank 1", or "another rank" among more than two), if error (or one it was raised
    from) is a collective that broke as that rank's process died; else None."""
    import torch.distributed as dist  # here, not at the top: see the module's docstring

    while error is not None:
        if isinstance(error, RuntimeError) and re.search(PEER_DIED, str(error)):
            return f"rank {1 - dist.get_rank()}" if dist.get_world_size() == 2 else "another rank"
        error = error.__cause__ or error.__context__
    return None


@contextlib.contextmanager
def failing_alone(after_a_death):
    """For work that one rank may fail in alone while the others wait in a collective of it (out of memory in a
    training step, whose backward pass the others reduce gradients in), where the ranks cannot vote as in
    failing_together: a UsageError raised inside leaves its line in the process group's store (torchrun's agent's, or
    rank 0's), and a rank whose collective broke as that rank left (gloo's "Connection closed by peer") raises that
    line instead. A rank that died leaving no line (kill -9, the kernel's out-of-memory killer) leaves the others one
    that says so, then after_a_death(): what is kept, and what to do. Under NCCL such a collective may hang until
    torchrun stops the rank."""
    import torch.distributed as dist  # here, not at the top: see the module's docstring

    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    store = dist.distributed_c10d._get_default_store() if several else None  # no public name for the group's own
    try:
        yield
    except UsageError as e:
        if store is not None:
            store.set(f"error/{dist.get_rank()}", str(e))
        raise
    except Exception as e:
        if store is None:
            raise
        keys = [f"error/{rank}" for rank in range(dist.get_world_size())]
        try:
            error = next((store.get(key).decode() for key in keys if store.check([key])), None)
        except RuntimeError:  # the store left with its rank (rank 0's, outside torchrun)
            error = None
        if error is None and (dead := dead_peer(e)) is not None:
            error = (f"{dead} died (killed, perhaps by the kernel's out-of-memory killer, or failed: its own output "
                     f"says why); {after_a_death()}")
        if error is None:
            raise
        raise UsageError(error) from None


def any_rank(flag, device):
    """True on every rank if flag is True on any of them."""
    import torch  # here, not at the top: see the module's docstring
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    votes = torch.tensor(float(flag), device=device)
    dist.all_reduce(votes)
    return votes.item() > 0


@contextlib.contextmanager
def failing_together():
    """A UsageError raised inside on any rank stops every rank with it: raised on one rank alone, as by work only rank 0
    does, it would leave the others waiting in their next collective. Every rank must enter; it is also a barrier."""
    error = None
    try:
        yield
    except UsageError as e:
        error = str(e)
    error = first_error_of_any_rank(error)
    if error is not None:
        raise UsageError(error)


# -----------------------------------------------------------------------------
# JSON read from files that may be damaged


class BadFile(Exception):
    """What is wrong with a file's contents, without its name: the caller says which file and what to do about it."""


def parse_json(text):
    """text as JSON; a ValueError for what is not JSON, or is nested too deep for json to parse. json raises a
    RecursionError for that (a damaged line of 200,000 ['s), which every reader would otherwise have to know of."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deep to parse") from None


def json_records(path):
    """(line number, the JSON object it holds) for each line of a JSON-lines file such as log.jsonl, with None for a
    line that holds none: the last line of a run killed mid-write, a damaged block. Its readers skip such a line and
    read the rest."""
    with open(path, "rb") as f:  # decoded line by line: bytes that are not UTF-8 damage their line only
        for number, line in enumerate(f, start=1):
            try:
                record = parse_json(line.decode("utf-8"))
            except ValueError:
                record = None
            yield number, record if isinstance(record, dict) else None


# -----------------------------------------------------------------------------
# Shard files: how the trainer finds and opens what fineweb.py writes

BIN_MAGIC, BIN_VERSION, BIN_HEADER_INTS = 20240520, 1, 256  # llm.c's shard header
SHARD_SUFFIXES = (".npy", ".bin")  # the formats shard_layout reads: a new one is a suffix here and a branch there


def files_in(directory, pattern):
    """The files of directory whose names fully match the regex pattern. Not glob: "run[a]" is a name, not a pattern."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(os.path.join(directory, name) for name in names if re.fullmatch(pattern, name))


class Shard:
    """A shard's tokens, read from its file as they are sliced (shard[a:b], a uint16 array): only where they begin in
    the file and how many there are are kept. A memory map per shard would keep a descriptor open for each, and
    FineWeb-Edu's larger samples make thousands of shards, past the 1024 open files a process commonly may hold."""

    def __init__(self, path, offset, length):
        self.path, self.offset, self.length = path, offset, length

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        start, stop, _ = index.indices(self.length)  # a slice: the stream reads runs of tokens
        tokens = np.empty(max(0, stop - start), dtype=np.uint16)
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset + 2 * start)
                read = f.readinto(tokens)  # buffered: reads on to the end, past one read call's 2 GiB
        except OSError as e:
            raise DataError(unopenable(self.path, e)) from None
        if read < tokens.nbytes:
            raise DataError(f"{self.path}: it ends before token {start + read // 2:,} of {self.length:,}: it changed "
                            f"since this run began; restore it, or make the shards again with fineweb.py")
        return tokens


def open_shard(path):
    """The Shard of a file: .npy (np.save's 1-D uint16) or .bin (llm.c's format), its header checked against its
    size."""
    try:
        offset, length = shard_layout(path)
    except OSError as e:  # listed, but not to be opened
        raise UsageError(unopenable(path, e)) from None
    if os.path.getsize(path) != offset + 2 * length:
        raise UsageError(f"{path}: its header promises {length} tokens, but the file size disagrees (truncated?); "
                         f"re-create it with fineweb.py")
    return Shard(path, offset, length)


def unopenable(path, error):
    """Why the shard at path could not be opened (error: open's), and what to do about it, in words."""
    if error.errno == errno.EMFILE and resource:  # not the shard's fault: the process holds as many files as it may
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        raise_it = (f"raise it (`ulimit -n {hard if hard != resource.RLIM_INFINITY else 65536}` in the shell that "
                    f"starts the run)" if soft < hard else "ask an administrator to raise its hard limit")
        return (f"{path}: cannot open this shard: too many open files, this process already holds all the {soft} "
                f"that its limit allows (ulimit -n {soft}), the shard is fine; {raise_it}")
    return f"{path}: cannot open this shard ({error.strerror}); {unopenable_fix(path, error)}"


def unopenable_fix(path, error):
    """What to do about a shard that open raised error for, in words."""
    if os.path.isdir(path):
        return "it is a directory named like a shard: move it out of the data directory"
    if os.path.islink(path) and not os.path.exists(path):
        return (f"it links to {os.readlink(path)}, which is gone (purged scratch storage?): restore the shards, or "
                f"make them again with fineweb.py")
    if isinstance(error, PermissionError):  # not os.access, which lets root read anything
        return "this user may not read it: give read permission (chmod a+r), or run as its owner"
    return "check the file, and the file system it is on"


def shard_layout(path):
    """(where the tokens begin, how many there are) in a shard file, from its header alone."""
    with open(path, "rb") as f:
        if path.endswith(".bin"):
            header = np.fromfile(f, dtype=np.int32, count=BIN_HEADER_INTS)
            if len(header) < BIN_HEADER_INTS or header[0] != BIN_MAGIC or header[1] != BIN_VERSION:
                raise UsageError(f"{path}: bad header (want magic {BIN_MAGIC}, version {BIN_VERSION}); re-create "
                                 f"the shard")
            return 4 * BIN_HEADER_INTS, int(header[2])
        if f.read(6) != b"\x93NUMPY":
            raise UsageError(f"{path}: not an .npy file (no NUMPY header); re-create it with fineweb.py")
        f.seek(0)
        try:
            version = np.lib.format.read_magic(f)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            shape, _, dtype = read_header(f)
        except ValueError as e:
            raise UsageError(f"{path}: not a readable .npy shard ({e}); re-create it with fineweb.py") from None
        if dtype != np.uint16 or len(shape) != 1:
            raise UsageError(f"{path}: expected a 1-D uint16 token array, found {dtype} {shape}; re-create it with "
                             f"fineweb.py")
        return f.tell(), shape[0]


def shard_paths(directory, training=True):
    """The train and val shards of a directory, by the split word in their names; to train on, all of them: refused
    where fineweb.py has not finished making them (an evaluation reads the val shard, the first one made)."""
    if training:
        check_prepared(directory)
    splits = {"train": [], "val": []}
    try:
        suffixes = "|".join(re.escape(suffix) for suffix in SHARD_SUFFIXES)
        paths = files_in(directory, rf"[^.].*({suffixes})")  # not hidden files, such as macOS's ._x_train.npy
    except OSError as e:
        raise UsageError(f"--data {directory}: cannot list it ({e.strerror})")
    for path in paths:
        words = set(SPLIT_WORD.findall(os.path.basename(path)))
        if len(words) > 1:
            raise UsageError(f"{path}: its name says both train and val; rename it to one of them")
        for word in words:
            splits[word].append(path)
    for split, found in splits.items():
        if not found:
            raise UsageError(f"--data {directory}: no {split} shards (*_{split}_*.npy or .bin) in it; make them with "
                             f"`python fineweb.py`")
    return splits["train"], splits["val"]


MANIFEST = "manifest.json"  # fineweb.py's record of where its preparation of the shards in its --output stands


def read_manifest(directory):
    """fineweb.py's manifest in directory, or None where there is none; BadFile for one that is damaged or another
    tool's. An older fineweb.py's list of its shards is read as their number, which is all any reader needs of it."""
    try:
        with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
            manifest = parse_json(f.read())
        state = manifest["next"]
        if isinstance(manifest["shards"], list):
            manifest["shards"] = len(manifest["shards"])
        well_formed = (isinstance(manifest["config"]["--prefix"], str) and isinstance(manifest["shards"], int)
                       and all(isinstance(s["path"], str) and isinstance(s["size"], int) for s in manifest["sources"])
                       and all(isinstance(state[k], int) for k in ("file", "unit", "skip", "tokens", "documents"))
                       and isinstance(state["carry"], (str, type(None))) and isinstance(manifest["done"], bool))
    except FileNotFoundError:
        return None
    except OSError as e:
        raise BadFile(f"cannot read it ({e.strerror})")
    except (ValueError, KeyError, TypeError):  # not JSON, or JSON of another shape
        well_formed = False
    if not well_formed:
        raise BadFile("it is damaged or not fineweb.py's")
    return manifest


def check_prepared(directory):
    """Refuses, in one line, shards whose fineweb.py manifest says they are not all made yet, or cannot say: a run on
    some of them could not go on once the rest are there, as its position would be in other shards."""
    path = os.path.join(directory, MANIFEST)
    try:
        manifest = read_manifest(directory)
    except BadFile as e:
        raise UsageError(f"--data {directory}: {path}: {e}, so whether its shards are all made is unknown; delete "
                         f"the manifest if fineweb.py finished them, else make them again with fineweb.py into a new "
                         f"--output")
    if manifest is None or manifest["done"]:  # none: not fineweb.py's shards, which are all there is
        return
    made = f"{manifest['shards']} shards and {manifest['next']['tokens']:,} tokens so far"
    holder = lock_holder(os.path.join(directory, ".lock"))
    if holder:
        raise UsageError(f"--data {directory}: fineweb.py is still making these shards ({holder}; {made}); train "
                         f"once it is done")
    raise UsageError(f"--data {directory}: its shards are unfinished ({path} says so: {made}); run the fineweb.py "
                     f"command that made them again, with --output {directory}: it carries on where it stopped")


PREPARATION_FILES = (MANIFEST, "downloads")  # what fineweb.py writes in its output before a shard, beside .lock


def unfinished_preparation(directory):
    """The names in directory when they are all of what fineweb.py writes there before its first shard (hidden
    files, such as its .lock, manifest.json and downloads/): [] for none. None for a directory holding anything
    else, or for no directory."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return None
    return names if all(name.startswith(".") or name in PREPARATION_FILES for name in names) else None


# -----------------------------------------------------------------------------
# Files written whole, and the writes that run out of room

NO_ROOM = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large for this process's file-size limit (ulimit -f)",
}


def no_room(error):
    """What stopped a write for lack of room (disk full, quota, file-size limit), in words; None if something else.
    torch.save raises a RuntimeError that keeps the OSError as its context."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in NO_ROOM:
            return NO_ROOM[error.errno]
        # torch.distributed.checkpoint's CheckpointException: each failed rank's (exception, traceback)
        for failure, _ in getattr(error, "failures", {}).values():
            reason = no_room(failure)
            if reason:
                return reason
        error = error.__cause__ or error.__context__
    return None


def first_line(error):
    """The first line of an error's message: torch's can run over many, and errors here are one line."""
    return (str(error).strip().splitlines() or [""])[0]


def raise_if_no_room(error, path, if_no_room, reason=None):
    """Raises the one-line UsageError of a write to path that ran out of room (reason, if given, or no_room's): the
    reason, path, then if_no_room(), which says what to do. Returns if the error is something else."""
    reason = reason or no_room(error)
    if reason is not None:
        raise UsageError(f"{reason} writing {path}: {if_no_room()}") from None


def sync_file(path, flags=0):
    """Makes what was written to path durable, whoever wrote it."""
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_directory(path):
    """Makes the renames in a directory durable (where directories can be opened: not on Windows)."""
    if hasattr(os, "O_DIRECTORY"):
        sync_file(path, os.O_DIRECTORY)


def write_atomically(path, write, temp, if_no_room):
    """Writes path whole or not at all: write(f) fills temp, which is synced, then renamed to path. A write that runs
    out of room deletes temp and raises a UsageError: the reason, path, then if_no_room(), which says what to do."""
    try:
        with open(temp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp)
        short_write = isinstance(e, OSError) and e.errno is None  # how numpy reports a short write to a full disk
        raise_if_no_room(e, path, if_no_room, NO_ROOM[errno.ENOSPC] if short_write else None)
        raise
    sync_directory(os.path.dirname(os.path.abspath(path)))


def append_line(path, line, if_no_room):
    """Appends line (and a newline) to path; one that does not fit is taken back whole, and raises a UsageError."""
    data = (line + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size, written = os.fstat(fd).st_size, 0
        try:
            while written < len(data):  # unbuffered: a failed write is known here, not at a later flush
                written += os.write(fd, data[written:])
        except OSError as e:
            if os.fstat(fd).st_size == size + written:  # never half a line, nor another process's (--eval-only) line
                os.ftruncate(fd, size)
            raise_if_no_room(e, path, if_no_room)
            raise
    finally:
        os.close(fd)


def free_mib(directory):
    return shutil.disk_usage(directory).free / 2**20


def tensor_bytes(obj):
    """About the size of obj saved: the bytes of the tensors in it, each storage once (tied weights share one)."""
    storages, todo = {}, [obj]
    while todo:
        obj = todo.pop()
        if hasattr(obj, "to_local"):  # a DTensor: this rank's slice
            obj = obj.to_local()
        if hasattr(obj, "untyped_storage"):  # a tensor
            storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
    return sum(storages.values())

def remove(path):
    """Deletes a file, or a directory and all in it."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


# -----------------------------------------------------------------------------
# Directory locks


def lock_holder(lock_path):
    """Who holds the lock file at lock_path (directory_lock's), in words; None if no process does."""
    if fcntl is None:
        return None
    try:
        with open(lock_path) as lock_file:
            try:
                fcntl.lockf(lock_file, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a read lock: only a writer's lock stops it
            except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: a writer holds it
                return holder_of(lock_file)
            fcntl.lockf(lock_file, fcntl.LOCK_UN)
    except OSError:  # no lock file: nobody holds it
        pass
    return None


def holder_of(lock_file):
    lock_file.seek(0)
    return lock_file.read().strip() or "a process that did not say which"


@contextlib.contextmanager
def directory_lock(directory, refusal, unwritable):
    """Holds <directory>/.lock while inside, having checked that this process can write there. Raises UsageError:
    refusal.format(holder=...) if another process holds the lock, unwritable.format(reason=...) if it cannot write.
    With no refusal, only checks (a process that shares the directory with others takes no lock).
    A POSIX record lock belongs to its process: the kernel drops it when the process dies, even by SIGKILL, and the
    processes it forks do not hold it. A directory made here that holds nothing but the lock at the end is removed."""
    made = []  # deepest first
    path = os.path.abspath(directory)
    while not os.path.isdir(path) and path != os.path.dirname(path):
        made.append(path)
        path = os.path.dirname(path)
    lock_path = os.path.join(directory, ".lock")
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".write_test.{os.getpid()}")  # the lock file may be writable, the dir not
        open(probe, "w").close()
        os.remove(probe)
        lock_file = open(lock_path, "a+")
    except OSError as e:
        reason = e.strerror
        in_the_way = [path for path in made if os.path.exists(path)]  # a file where a directory must be
        if in_the_way:
            reason = f"{'it' if in_the_way[-1] == made[0] else in_the_way[-1]} is a file, not a directory"
        raise UsageError(unwritable.format(reason=reason)) from None
    with lock_file:
        try:
            if fcntl and refusal:
                try:
                    fcntl.lockf(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except (BlockingIOError, PermissionError):
                    raise UsageError(refusal.format(holder=holder_of(lock_file))) from None
                lock_file.truncate(0)
                lock_file.write(f"pid {os.getpid()} on {socket.gethostname()}")
                lock_file.flush()
            yield
        finally:  # while the lock is held: no other process can have taken the directory meanwhile
            with contextlib.suppress(OSError):
                if made and os.listdir(directory) == [".lock"]:
                    os.remove(lock_path)
                    for path in made:
                        os.rmdir(path)


@contextlib.contextmanager
def waiting_for_lock(path, unwritable):
    """Holds the lock file path while inside, waiting first for any other process that holds it: the runs that share
    a cache download a file into it once, the others waiting for it. The kernel drops the lock of a process that
    dies. Raises UsageError unwritable.format(reason=...) if the file cannot be made."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        lock_file = open(path, "a")
    except OSError as e:
        raise UsageError(unwritable.format(reason=e.strerror or e)) from None
    with lock_file:
        if fcntl:
            fcntl.lockf(lock_file, fcntl.LOCK_EX)
        yield


# -----------------------------------------------------------------------------
# Downloads, once per node, into a cache


def check_safetensors(path):
    """Raises BadFile unless path is a whole safetensors file: its header must cover the file."""
    try:
        with safe_open(path, "pt") as f:
            f.keys()
    except Exception as e:  # safetensors raises its own error types, not OSError
        raise BadFile(str(e))


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def default_cache_dir():
    return os.environ.get("GPT2_CACHE_DIR") or os.path.expanduser("~/.cache/train_gpt2")


def download(url, path, check, what, hint, headers=None):
    """Fetches url to path: the file appears whole and passed by check(temp_path), which raises BadFile, or not at all.
    what names the kind of file and hint says where else to get it, in the one-line errors."""
    cache_dir = os.path.dirname(path)
    # a unique temp name in the same directory: the rename is atomic and concurrent downloads (nodes sharing the
    # cache) don't mix. os.open applies the umask to 0o666, so that a shared $GPT2_CACHE_DIR stays shared
    # (tempfile.mkstemp would make the file private to this user).
    tmp_path = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        os.makedirs(cache_dir, exist_ok=True)
        with open(os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f, \
                requests.get(url, headers=headers, stream=True, timeout=60) as response:
            response.raise_for_status()
            for chunk in response.iter_content(chunk_size=1 << 20):
                f.write(chunk)
        check(tmp_path)  # never cache a truncated or wrong file
        os.replace(tmp_path, path)
    except BadFile as e:
        raise UsageError(f"downloaded {url} is not a valid {what} ({e}); nothing was cached; retry, or "
                         f"{hint}") from None
    except requests.RequestException as e:  # before OSError, which it subclasses
        raise UsageError(f"could not download {url} ({e}); {hint}") from None
    except OSError as e:
        raise UsageError(f"cannot write to the cache directory {cache_dir} ({e}); "
                         f"pass --cache-dir or set $GPT2_CACHE_DIR to a writable directory") from None
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)


def download_openai_weights(name, cache_dir=None):
    """The path of OpenAI's GPT-2 `name` (gpt2, gpt2-medium, ...) in the cache, downloaded once from the Hugging Face
    hub, or from $HF_ENDPOINT's mirror (with $HF_TOKEN, if set, sent to that host only)."""
    endpoint = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    path = os.path.join(cache_dir or default_cache_dir(), name, "model.safetensors")
    headers = {"Authorization": f"Bearer {os.environ['HF_TOKEN']}"} if os.environ.get("HF_TOKEN") else None
    download_once_per_node(f"{endpoint}/openai-community/{name}/resolve/main/model.safetensors", path,
                           check_safetensors, "safetensors file",
                           "set HF_ENDPOINT to a mirror (or HF_TOKEN if it needs a login)", headers)
    return path


def download_once_per_node(url, path, check, what, hint, headers=None):
    """One process per node downloads (the cache may be node-local); the others wait for it, then all read the file.
    A failed download fails every rank with its one-line error. The group may span nodes, so all ranks learn whether
    any node's download failed."""
    with failing_together():  # also the wait: it ends once every node's download has ended
        if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not os.path.exists(path):
            print(f"downloading {url} to {path}")
            download(url, path, check, what, hint, headers)


# -----------------------------------------------------------------------------
# The CPU heap


def keep_freed_memory(keep):
    """On Linux, glibc gives every freed block over 32 MB back to the OS, and the next step faults its pages back in,
    zeroed: on a CPU, GPT-2's 50257-wide logits made that 40% of a small model's step. keep: freed memory stays in the
    heap. Not keep, where memory is tight: every block over 1 MiB is mapped on its own and given back once freed, so
    that no free block in the heap counts against the memory left (glibc's default keeps up to 32 MB ones)."""
    libc = ctypes.CDLL(None) if sys.platform.startswith("linux") else None
    if hasattr(libc, "mallopt"):
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
        libc.mallopt(M_MMAP_MAX, 0 if keep else 1 << 16)  # keep: no block gets an mmap of its own
        if not keep:
            libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30 if keep else 1 << 20)  # the heap's free top goes back past this
