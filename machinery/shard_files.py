"""
The token shards the trainer reads, as fineweb.py writes them: how their names say their split, their two formats
(.npy, and llm.c's .bin), and fineweb.py's manifest of a preparation, finished or not.
"""

import errno
import os
import re

import numpy as np

from machinery.errors import BadFile, DataError, UsageError
from machinery.files import files_in, lock_holder, open_file_limit_in_words, parse_json

# a shard's split is a whole word of its name (x_val_000000.npy, x_train.bin), so that "interval_train" is no val shard
SPLIT_WORD = re.compile(r"(?:^|[_.-])(train|val)(?=[_.-]|$)")

BIN_MAGIC, BIN_VERSION, BIN_HEADER_INTS = 20240520, 1, 256  # llm.c's shard header
SHARD_SUFFIXES = (".npy", ".bin")  # the formats shard_layout reads: a new one is a suffix here and a branch there


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
    if error.errno == errno.EMFILE:  # not the shard's fault: the process holds as many files as it may
        return f"{path}: cannot open this shard: too many open files (the shard is fine): {open_file_limit_in_words()}"
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
