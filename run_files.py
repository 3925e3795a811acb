"""
The log directory of a run of train_gpt2.py, and what is written in it: its lock, which keeps a second run out; the
files a run writes there (what a fresh start moves aside, and a resume that abandons later checkpoints); checkpoint
files and directories written whole or not at all, pruned, and held by their readers (--eval-only beside the training)
so that no pruning deletes one being read; and the run's log, log.jsonl, with Weights & Biases beside it.

checkpoints.py and reporting.py use it; it never imports torch at the top, as plumbing.py, which it builds on.
"""

import contextlib
import errno
import functools
import json
import math
import os
import shutil
import signal
import time

import plumbing
from plumbing import UsageError

try:
    import fcntl
except ImportError:  # Windows: a checkpoint being read is not held there
    fcntl = None

# -----------------------------------------------------------------------------
# The log directory: what a run writes there, and its checkpoint files

LOG_FILE = "log.jsonl"  # the run's record (RunLog)
CHECKPOINT = r"ckpt_\d+\.(pt|dcp)"  # a checkpoint's name as a regex: a file ckpt_<step>.pt, or --fsdp's directory
# What a run writes in its log directory, as regexes of names: a fresh start moves an earlier run's aside, and every
# other file there (the shell's out.txt, the user's notes) stays where it is, untouched.
PARTIAL = CHECKPOINT + r"\.tmp(\.old)?"  # a checkpoint being written, or one being replaced by its step's new one
ABANDONED = CHECKPOINT + r"\.abandoned(\.\d+)?"  # a checkpoint newer than the one a run resumed from, moved aside
RUN_FILES = [r"log\.jsonl", r"curves\.png", CHECKPOINT, PARTIAL, ABANDONED, r"wandb"]


def checkpoint_step(path):
    return int(os.path.splitext(os.path.basename(path))[0][len("ckpt_"):])


def checkpoint_path(log_dir, step, sharded=False):
    """Where the checkpoint of step goes: a file, or with --fsdp a directory."""
    return os.path.join(log_dir, f"ckpt_{step:06d}.{'dcp' if sharded else 'pt'}")


def checkpoint_paths(log_dir):
    """Checkpoints in log_dir, oldest first: by step, as past step 999,999 the names outgrow their 6-digit padding."""
    return sorted(plumbing.files_in(log_dir, CHECKPOINT), key=checkpoint_step)


class CheckpointGone(ValueError):
    """No checkpoint at the path (any more): the training pruned it, or replaced it, while a reader was choosing it."""


def flock(fd, operation):
    """fcntl.flock, but on a file system that has no such locks (some network ones), nothing: its checkpoints are
    read unguarded, as they were before these locks. Raises BlockingIOError for a lock another process holds."""
    try:
        fcntl.flock(fd, operation)
    except OSError as e:
        if e.errno not in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP):
            raise


class CheckpointReadLock:
    """A shared flock on the checkpoint at path (its file, or --fsdp's directory), held from choosing it until its
    tensors are loaded (release): the training deletes or moves no checkpoint a reader holds (unread). --eval-only,
    --sample and --export-hf read checkpoints while the training that writes them goes on. flock, not lockf: POSIX
    record locks are dropped when any descriptor of the file closes, and torch.load opens it again."""

    def __init__(self, path):
        self.fd = None
        if fcntl is None:  # Windows: no flock, and no descriptors of directories
            return
        try:
            self.fd = os.open(path, os.O_RDONLY)  # a directory too
        except FileNotFoundError as e:
            if os.path.lexists(path):  # a broken symbolic link: unreadable, not gone
                raise
            raise CheckpointGone(f"{type(e).__name__}: {e}") from None
        try:
            flock(self.fd, fcntl.LOCK_SH)  # waits only while the training deletes or moves it
            locked, named = os.fstat(self.fd), os.stat(path)
            if (locked.st_dev, locked.st_ino) != (named.st_dev, named.st_ino):
                raise FileNotFoundError
        except FileNotFoundError:
            self.release()
            raise CheckpointGone(f"{path} was deleted or replaced as it was opened") from None
        except BaseException:
            self.release()
            raise

    def release(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    __del__ = release


@contextlib.contextmanager
def unread(path, wait):
    """An exclusive flock on path while inside, so that it can be deleted or moved: no reader is loading it
    (CheckpointReadLock). Yields True; or at once False if a reader holds it and not wait."""
    if fcntl is None:
        yield True
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            print(f"waiting for a process that is loading {path} (--eval-only, --sample, --export-hf) to finish")
            flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)


def latest_checkpoint(log_dir, before_step=None):
    """The path of the latest checkpoint in log_dir (of a step before before_step, if given), or None."""
    paths = [p for p in checkpoint_paths(log_dir) if before_step is None or checkpoint_step(p) < before_step]
    return paths[-1] if paths else None


def lock_log_dir(log_dir, exclusive):
    """The log directory, locked for this run if exclusive: a second run in it would move the first's files aside, or
    resume from its live checkpoints, and prune them. --eval-only, which only appends its lines to log.jsonl, may run
    beside the training it evaluates. Also checks now that the run can write there, and append to its log.jsonl (in a
    group's shared directory, another user's file may not be writable), not at its first log line."""
    refusal = (f"another run is using --log-dir {log_dir} ({{holder}}); wait for it to end or stop it, or pass another "
               f"--log-dir")
    log = os.path.join(log_dir, LOG_FILE)
    try:
        if os.path.isfile(log):
            open(log, "a").close()
    except OSError as e:
        raise UsageError(f"--log-dir {log_dir}: cannot append to {log} ({e.strerror}); make it writable for this user, "
                         f"or pass another --log-dir (--resume PATH still reads a checkpoint of this one)") from None
    return plumbing.directory_lock(log_dir, refusal if exclusive else None,
                                   f"--log-dir {log_dir}: cannot write in it ({{reason}}); pass a directory this run "
                                   f"may write to")


def unused_name(path):
    """path, or if that is taken, the first of path.1, path.2, ... that is not."""
    n, name = 0, path
    while os.path.lexists(name):
        n += 1
        name = f"{path}.{n}"
    return name


def aside_directory(log_dir):
    """A new directory for an earlier run's files, on log_dir's own file system, which a rename cannot leave: beside
    the directory that log_dir is, or links to (`log -> /scratch/...`), <dir>.<date-time>; inside it where it is the
    root of its file system (a container's bind mount, a scratch volume)."""
    real = os.path.realpath(log_dir)
    parent = os.path.dirname(real)
    if os.stat(parent).st_dev != os.stat(real).st_dev:
        parent = real
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = unused_name(os.path.join(parent, f"{os.path.basename(real)}.{stamp}"))  # two starts in one second
    os.mkdir(aside)
    return aside


class StoppedBySignal(Exception):
    """SIGINT or SIGTERM, come while StopSignals raises them."""


class StopSignals:
    """While inside, the first SIGINT or SIGTERM raises StoppedBySignal unless deferred is set; any other is only kept
    (their names, in caught) for after. Their handlers are given back on leaving. SIGTERM's own would end the process
    at once, and SIGINT's KeyboardInterrupt print a traceback, wherever they came."""

    def __init__(self):
        self.deferred, self.caught = False, []

    def __enter__(self):
        self.handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig, handler in self.handlers.items():
            if handler != signal.SIG_IGN:  # a background job's SIGINT, which its shell ignores: left so
                signal.signal(sig, self.on_signal)
        return self

    def __exit__(self, *exception):
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)

    def on_signal(self, signum, frame):
        self.caught.append(signal.Signals(signum).name)
        if not self.deferred:
            self.deferred = True  # once: a second signal never cuts short the handling of the first
            raise StoppedBySignal


def move_old_run_aside(log_dir, why="starting fresh"):
    """Moves the files an earlier run wrote in log_dir into a new directory (aside_directory), saying why: all of them,
    or none if a signal comes before the first is moved, or an error stops it. Half of them moved would be two runs,
    and a later start would resume the half left in log_dir."""
    old = plumbing.files_in(log_dir, "|".join(RUN_FILES))
    if not old:
        return
    with StopSignals() as signals, contextlib.ExitStack() as held:
        try:  # first, every file unread (not a checkpoint that --eval-only, say, is loading): the wait a signal stops
            for path in old:
                held.enter_context(unread(path, wait=True))
            signals.deferred = True  # from here on, the renames: none waits, and none is left half done
        except StoppedBySignal:
            raise UsageError(f"{why}: stopped by {signals.caught[0]} before the old run's files were moved aside; "
                             f"they stay in {log_dir}, as they were")
        aside = aside_directory(log_dir)
        try:
            for path in old:  # checkpoints first (by name): a crash midway leaves none to resume without its log
                os.rename(path, os.path.join(aside, os.path.basename(path)))
        except OSError:
            with contextlib.suppress(OSError):  # no run split in two, nor an empty directory left at each failed try
                for name in os.listdir(aside):
                    os.rename(os.path.join(aside, name), os.path.join(log_dir, name))
                os.rmdir(aside)
            raise
    names = ", ".join(os.path.basename(path) for path in old)
    if signals.caught:
        raise UsageError(f"{why}: stopped by {signals.caught[0]} as the old run's files were moved aside; all of them "
                         f"({names}) were moved from {log_dir} to {aside}, and nothing was trained")
    print(f"{why}: moved the old run's files ({names}) from {log_dir} aside to {aside}")


def is_log_dir_of(path, log_dir):
    """Whether log_dir is the directory of the checkpoint at path, by whatever path (a link to it or to the
    directory, another mount)."""
    try:
        return os.path.samefile(os.path.dirname(os.path.realpath(path)), log_dir)
    except OSError:
        return False


def prepare_log_dir(log_dir, resumed_from, resumed_step):
    """A fresh run (resumed_from None) moves an earlier run's files aside, and so does a run resumed from another
    directory's checkpoint: a run in log_dir is another one, which it must neither prune nor continue the log of. A
    run resumed from a checkpoint of log_dir moves aside the checkpoints newer than its own (abandoned, or
    unreadable), so that they are never resumed later."""
    if resumed_from is None:
        move_old_run_aside(log_dir)
        return
    if not is_log_dir_of(resumed_from, log_dir):
        move_old_run_aside(log_dir, f"resuming {resumed_from}, a checkpoint of another directory")
        return
    for stale in plumbing.files_in(log_dir, PARTIAL):  # a save cut short by a crash
        plumbing.remove(stale)
    for path in checkpoint_paths(log_dir):
        if checkpoint_step(path) > resumed_step:
            aside = unused_name(path + ".abandoned")  # resuming twice from one checkpoint abandons a step twice
            with unread(path, wait=True):
                os.rename(path, aside)
            print(f"moved {path} aside to {aside}: this run continues from step {resumed_step}")


def no_room_for_checkpoint(log_dir, size, keep):
    """What to do when a checkpoint of about size bytes does not fit, in words."""
    return (f"a checkpoint needs about {size / 2**20:,.1f} MiB, {plumbing.free_mib(log_dir):,.1f} MiB are free "
            f"(saving needs room for --keep-checkpoints {keep} of them and one more); make room, then run the same "
            f"command again: it resumes from {latest_checkpoint(log_dir) or 'the start'}")


def write_checkpoint(log_dir, step, save, size, keep):
    """Writes log_dir/ckpt_<step>.pt whole or not at all, with save(file); size: about how many bytes it takes."""
    path = checkpoint_path(log_dir, step)
    t0 = time.perf_counter()
    plumbing.write_atomically(path, save, path + ".tmp", lambda: no_room_for_checkpoint(log_dir, size, keep))
    print(f"saved {path} ({os.path.getsize(path) / 2**20:,.0f} MiB in {time.perf_counter() - t0:.1f} s)")


def write_sharded_checkpoint(log_dir, step, save, size, keep, master):
    """Writes log_dir/ckpt_<step>.dcp/ whole or not at all: rank 0 makes ckpt_<step>.dcp.tmp/, save(directory) fills
    it, every rank writing its own part (torch.distributed.checkpoint, which rank 0 ends with the index of all parts),
    then rank 0 renames it. Every rank calls it, save being collective; size: about how many bytes all ranks write."""
    path = checkpoint_path(log_dir, step, sharded=True)
    temp, t0 = path + ".tmp", time.perf_counter()
    if_no_room = functools.partial(no_room_for_checkpoint, log_dir, size, keep)
    with plumbing.failing_together():  # also the barrier after which every rank looks for the directory
        if master:
            try:
                if os.path.exists(temp):  # a save cut short, in this very run
                    plumbing.remove(temp)
                os.mkdir(temp)
            except OSError as e:
                plumbing.raise_if_no_room(e, path, if_no_room)
                raise UsageError(f"--log-dir {log_dir}: cannot make the checkpoint directory {temp} ({e.strerror})")
    with plumbing.failing_together():
        if not os.path.isdir(temp):
            raise UsageError(f"--log-dir {log_dir}: this node does not see the checkpoint directory {temp} that rank 0 "
                             f"made; put --log-dir on a file system that every node shares")
    failure = None
    try:
        save(temp)
        if master:  # torch.distributed.checkpoint syncs its own files; the rest of them too, before the rename
            for name in os.listdir(temp):
                plumbing.sync_file(os.path.join(temp, name))
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is no Exception
        failure = e
    what = None if failure is None else f"{type(failure).__name__}: {plumbing.first_line(failure)}"
    failed = None if failure is None else (plumbing.no_room(failure), what)
    failed = plumbing.first_error_of_any_rank(failed)  # on every rank, as of rank 0's part alone: none is left waiting
    if failed is not None:
        if master:
            shutil.rmtree(temp, ignore_errors=True)
        reason, what = failed
        if reason is None:  # not for lack of room: the rank it happened on shows its traceback
            if failure is not None:
                raise failure
            raise UsageError(f"another rank failed to write its part of {path} ({what})")
        with plumbing.failing_together():  # rank 0's line, with the room there is once the partial directory is gone
            if master:
                raise UsageError(f"{reason} writing {path}: {if_no_room()}")
    if master:
        replaced = path + ".tmp.old"
        if os.path.exists(path):  # the same step saved again, evaluated since: the new one takes its place
            with unread(path, wait=True):
                os.replace(path, replaced)
        os.replace(temp, path)
        plumbing.sync_directory(log_dir)
        if os.path.exists(replaced):
            plumbing.remove(replaced)
        written = sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))
        print(f"saved {path} ({written / 2**20:,.0f} MiB in {time.perf_counter() - t0:.1f} s)")


def prune_checkpoints(log_dir, keep):
    """Deletes all but the latest keep checkpoints; only once the newest is durably in place (write_checkpoint). One
    that a reader is loading stays until a later prune: the training never waits for a reader."""
    for old in checkpoint_paths(log_dir)[:-keep]:
        with unread(old, wait=False) as unheld:
            if unheld:
                plumbing.remove(old)


# -----------------------------------------------------------------------------
# The run's log: log.jsonl, and Weights & Biases


def finite_only(record):
    """record with null for each NaN or infinity, which JSON has no words for (strict parsers, jq, refuse them)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


def import_wandb(project):
    """wandb, an optional dependency: imported only when --wandb-project asks for it."""
    try:
        import wandb
    except ImportError:
        raise UsageError(f"--wandb-project {project} needs the wandb package: pip install wandb "
                         f"(or leave out --wandb-project)") from None
    return wandb


class RunLog:
    """Rank 0's record of a run: lines appended to <log-dir>/log.jsonl (never truncated), and the same records in a
    W&B run with --wandb-project."""

    def __init__(self, log_dir):
        self.log_dir, self.path = log_dir, os.path.join(log_dir, LOG_FILE)
        self.wandb, self.wandb_step = None, 0
        self.wandb_id = None  # kept in the checkpoints: a resumed run continues the same W&B run

    def write(self, record):
        record = finite_only(record)
        plumbing.append_line(self.path, json.dumps(record, allow_nan=False), lambda: (
            f"make room, then run the same command again: it resumes from "
            f"{latest_checkpoint(self.log_dir) or 'the start'}"))
        if self.wandb:
            self.wandb.log(record, step=self.wandb_step)
            self.wandb_step += 1

    def start_wandb(self, project, name, config):
        """Starts logging to W&B, under <log-dir>/wandb (where WANDB_MODE=offline leaves it, for `wandb sync`),
        continuing the W&B run of wandb_id if set."""
        wandb = import_wandb(project)
        try:
            self.wandb = wandb.init(project=project, name=name or None, id=self.wandb_id, resume="allow",
                                    dir=self.log_dir, config=config)
        except wandb.errors.Error as e:  # not logged in, no network, ...
            reason = str(e).strip().partition("\n")[0]  # its hints run over several lines
            raise UsageError(f"--wandb-project {project}: W&B cannot start the run ({reason}); log in with "
                             f"`wandb login`, or set WANDB_MODE=offline on a machine with no internet (and "
                             f"`wandb sync` later)") from None
        # W&B's step only goes up, but a resumed run logs the steps after its checkpoint again: W&B's step is the
        # record's line in log.jsonl, which only grows, across resumes and offline runs alike, and every chart's x-axis
        # is the training step, so a step trained again is drawn again rather than refused as a step back in time.
        with open(self.path, "a+") as f:
            f.seek(0)
            self.wandb_step = sum(1 for _ in f)
        self.wandb.define_metric("*", step_metric="step")
        self.wandb_id = self.wandb.id

    def finish(self, failed):
        """Ends the W&B run, if one started: failed, if an error stopped the run."""
        if self.wandb is not None:
            self.wandb.finish(exit_code=1 if failed else 0)
