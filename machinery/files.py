"""
Files: JSON read from files that may be damaged, files and directories written whole or not at all (and what to say
when a disk, a quota or a file-size limit stops a write), the open-file limit and descriptors kept for a save,
checksums that files are read back against, and a directory or a cache file held by one process at a time, its lock
file naming the holder (the lock taken with locks.lock).
"""

import contextlib
import errno
import functools
import json
import os
import re
import shutil
import socket
import uuid
import zipfile
import zlib

from machinery import locks, signals
from machinery.errors import UsageError, chain

try:
    import resource  # here, not where it is used: a process at its open-file limit can import nothing
except ImportError:  # Windows: an open-file limit is not named
    resource = None


# -----------------------------------------------------------------------------
# JSON read from files that may be damaged


def files_in(directory, pattern):
    """The files of directory whose names fully match the regex pattern. Not glob: "run[a]" is a name, not a pattern."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(os.path.join(directory, name) for name in names if re.fullmatch(pattern, name))


def parse_json(text):
    """text as JSON; a ValueError for what is not JSON, or is nested too deep for json to parse. json raises a
    RecursionError for that (a damaged line of 200,000 ['s), which every reader would otherwise have to know of."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deep to parse") from None


def json_lines(path, skip_blank=True):
    """(line number, its JSON value, the ValueError that says why it holds none, or None) for each line of a
    JSON-lines file, but blank ones unless skip_blank is False. Decoded line by line: bytes that are not UTF-8 damage
    their line only (a UnicodeDecodeError), which a reader may skip, or refuse as it refuses a file not UTF-8."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            value = error = None
            try:
                text = line.decode("utf-8")
                if skip_blank and not text.strip():
                    continue
                value = parse_json(text)
            except ValueError as e:  # a UnicodeDecodeError is one
                error = e
            yield number, value, error


def json_records(path):
    """(line number, the JSON object it holds) for each line of a JSON-lines file such as log.jsonl, with None for a
    line that holds none: the last line of a run killed mid-write, a damaged block, a blank line. Its readers skip
    such a line and read the rest."""
    for number, value, _ in json_lines(path, skip_blank=False):
        yield number, value if isinstance(value, dict) else None


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
    for link in chain(error):
        if isinstance(link, OSError) and link.errno in NO_ROOM:
            return NO_ROOM[link.errno]
        # torch.distributed.checkpoint's CheckpointException: each failed rank's (exception, traceback)
        for failure, _ in getattr(link, "failures", {}).values():
            reason = no_room(failure)
            if reason:
                return reason
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


def remove(path):
    """Deletes a file, or a directory and all in it."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


# -----------------------------------------------------------------------------
# A directory written whole or not at all


def refuse_unless_new_directory(path, flag):
    """Refuses a path (flag's) that holds anything: what is written there never mixes with other files, nor replaces
    them."""
    if os.path.lexists(path) and not (os.path.isdir(path) and not os.listdir(path)):
        raise UsageError(f"{flag} {path}: it exists and is not an empty directory; pass a new one (or delete it)")


def write_text(directory, name, text):
    with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def remove_killed_writes(out, made_by):
    """Deletes the temporary directories beside out that writers of it (made_by, in words) killed outright (kill -9)
    left: those that hold files and no lock. A running writer locks its own before it writes into it, so that an
    empty one may be a writer's that is starting, and stays. Where no lock can be taken (Windows; a file system that
    cannot lock a directory, NFS), nothing is ever taken for a killed writer's."""
    parent = os.path.dirname(out)
    for name in sorted(os.listdir(parent)):
        if re.fullmatch(re.escape(os.path.basename(out)) + r"\.[0-9a-f]{8}\.tmp", name):
            path = os.path.join(parent, name)
            # an OSError: the directory gone meanwhile, as another writer removed or finished it
            with contextlib.suppress(OSError), locks.holding(path, wait=False) as taken:
                if taken and os.listdir(path):
                    shutil.rmtree(path)
                    print(f"removed {path}, left by {made_by} to {out} that was killed")


@contextlib.contextmanager
def locked_directory(path):
    """Makes the directory path, locked while inside (where there is flock: not on Windows, where a killed writer's
    directory stays), and deletes it if anything is raised inside, while still locked."""
    os.mkdir(path)  # not tempfile.mkdtemp's 0700: the umask's permissions, as any directory the user makes
    with locks.holding(path):  # waits only while another writer looks whether this one is a killed one's
        try:
            yield
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise


def write_directory(out_dir, fill, flag, made_by):
    """Makes out_dir (flag's) with fill(directory), whole or not at all: fill writes into a new directory beside
    out_dir, OUT_DIR.<random>.tmp, which is synced, then renamed to it. A failed or interrupted fill (an error, Ctrl-C,
    SIGTERM) leaves no out_dir, and deletes the temporary one; one that a process killed outright left is deleted by
    the next writer of out_dir (made_by, in words: "an export")."""
    refuse_unless_new_directory(out_dir, flag)
    out = os.path.abspath(out_dir)
    with signals.exiting_on_sigterm():
        try:
            os.makedirs(os.path.dirname(out), exist_ok=True)
            remove_killed_writes(out, made_by)
            temp = f"{out}.{uuid.uuid4().hex[:8]}.tmp"  # beside it, so that the rename stays on one file system
            with locked_directory(temp):
                fill(temp)
                sync_directory(temp)
                os.rename(temp, out)  # over an empty out_dir too; never over a non-empty one
        except BaseException as e:
            raise_if_no_room(e, out_dir, lambda: "make room, then run the same command again")
            if isinstance(e, OSError):
                refuse_unless_new_directory(out_dir, flag)  # another writer of it finished first
                raise UsageError(f"{flag} {out_dir}: cannot write it ({e}); pass a directory you may write to")
            raise
    sync_directory(os.path.dirname(out))


# -----------------------------------------------------------------------------
# The open-file limit (ulimit -n), and descriptors kept for a save


def open_file_limit_in_words():
    """What a process that can open no more files (EMFILE) holds, and how to raise its limit, in words."""
    if resource is None:
        return "this process holds as many files as it may"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    raise_it = (f"raise it (`ulimit -n {hard if hard != resource.RLIM_INFINITY else 65536}` in the shell that "
                f"starts the run)" if soft < hard else "ask an administrator to raise its hard limit")
    return f"this process already holds all the {soft} files that its limit allows (ulimit -n {soft}); {raise_it}"


def cannot_open_a_file():
    """Why this process cannot open one more file now, in words (at its open-file limit: which, and what to do); None
    if it can."""
    try:
        os.close(os.open(os.devnull, os.O_RDONLY))
    except OSError as e:
        return f"too many open files: {open_file_limit_in_words()}" if e.errno == errno.EMFILE else e.strerror
    return None


class DescriptorReserve:
    """A few file descriptors held from the start, their numbers low, and let go while inside released(): a process
    that reached its open-file limit since (ulimit -n) can still write its checkpoint. A limit below the numbers they
    had leaves nothing to let go, as no reserve can help there."""

    def __init__(self, count=8):
        self.count, self.fds = count, []
        self.reopen()

    def reopen(self):
        with contextlib.suppress(OSError):  # as many as there is room for again
            while len(self.fds) < self.count:
                self.fds.append(os.open(os.devnull, os.O_RDONLY))

    def close(self):
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    @contextlib.contextmanager
    def released(self):
        self.close()
        try:
            yield
        finally:
            self.reopen()


# -----------------------------------------------------------------------------
# Checksums: files read back whole, against what was written

CHUNK = 2**20  # read in pieces that stay in the CPU's cache between the read and the CRC


def size_and_crc32(path):
    """(bytes, CRC-32) of the file at path, read whole in chunks."""
    crc, size, chunk = 0, 0, bytearray(CHUNK)
    with open(path, "rb", buffering=0) as f:
        while read := f.readinto(chunk):
            crc, size = zlib.crc32(memoryview(chunk)[:read], crc), size + read
    return size, crc


def zip_record_checks(path):
    """[(bytes, check)] for each record of the zip file at path (torch.save's format): check() says why the record does
    not read back as it was written (its header, its length, its CRC-32), in words, or None. torch.load checks none
    of them: a damaged tensor loads as it is."""
    def check(name):
        try:
            with zipfile.ZipFile(path) as archive, archive.open(name) as record:
                while record.read(CHUNK):
                    pass
        except (zipfile.BadZipFile, EOFError, OSError) as e:
            return f"{os.path.basename(path)}'s record {name} is damaged ({e})"
        return None

    with zipfile.ZipFile(path) as archive:
        return [(info.file_size, functools.partial(check, info.filename)) for info in archive.infolist()]


# -----------------------------------------------------------------------------
# Directory locks


def lock_holder(lock_path):
    """Who holds the lock file at lock_path (directory_lock's), in words; None if no process does."""
    try:
        with open(lock_path) as lock_file:  # closing it lets go of the lock taken here
            if locks.lock(lock_file, exclusive=False, wait=False, record=True) is False:  # only a writer's stops it
                return holder_of(lock_file)
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
            taken = locks.lock(lock_file, wait=False, record=True) if refusal else None
            if taken is False:
                raise UsageError(refusal.format(holder=holder_of(lock_file)))
            if taken:
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
        locks.lock(lock_file, record=True)
        yield
