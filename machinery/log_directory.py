"""
The log directory of a run: its lock, which keeps a second run out (locked); what a fresh start moves aside, whole or
not at all, and what a resume abandons (the checkpoints after the one it resumed from), once every rank has read its
checkpoint (move_aside_for_run).
"""

import contextlib
import os
import time

import torch.distributed as dist

from machinery import files
from machinery.checkpoints import ABANDONED, CHECKPOINT, PARTIAL, checkpoint_paths, checkpoint_step, is_log_dir_of
from machinery.errors import UsageError
from machinery.locks import without_readers
from machinery.ranks import failing_together
from machinery.run_log import LOG_FILE
from machinery.signals import StoppedBySignal, StopSignals

# What a run writes in its log directory, as regexes of names: a fresh start moves an earlier run's aside, and every
# other file there (the shell's out.txt, the user's notes) stays where it is, untouched.
RUN_FILES = [r"log\.jsonl", r"curves\.png", CHECKPOINT, PARTIAL, ABANDONED, r"wandb"]


def lock(log_dir, exclusive):
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
    return files.directory_lock(log_dir, refusal if exclusive else None,
                                   f"--log-dir {log_dir}: cannot write in it ({{reason}}); pass a directory this run "
                                   f"may write to")


@contextlib.contextmanager
def locked(cfg, env):
    """Rank 0 holds the log directory's lock (lock) while inside; every rank stops if it cannot."""
    with contextlib.ExitStack() as held:
        with failing_together():
            if env.rank == 0:
                held.enter_context(lock(cfg.log_dir, exclusive=not cfg.eval_only))
        yield


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


def move_old_run_aside(log_dir, why="starting fresh"):
    """Moves the files an earlier run wrote in log_dir into a new directory (aside_directory), saying why: all of them,
    or none if a signal comes before the first is moved, or an error stops it. Half of them moved would be two runs,
    and a later start would resume the half left in log_dir."""
    old = files.files_in(log_dir, "|".join(RUN_FILES))
    if not old:
        return
    with StopSignals() as signals, contextlib.ExitStack() as held:
        try:  # first, no file held by a reader (a checkpoint --eval-only, say, is loading): the wait a signal stops
            for path in old:
                held.enter_context(without_readers(path, wait=True))
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


def move_aside_old_files(log_dir, resumed_from, resumed_step):
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
    for stale in files.files_in(log_dir, PARTIAL):  # a save cut short by a crash
        files.remove(stale)
    for path in checkpoint_paths(log_dir):
        if checkpoint_step(path) > resumed_step:
            aside = unused_name(path + ".abandoned")  # resuming twice from one checkpoint abandons a step twice
            with without_readers(path, wait=True):
                os.rename(path, aside)
            print(f"moved {path} aside to {aside}: this run continues from step {resumed_step}")


def move_aside_for_run(run):
    """Readies the log directory for the run (move_aside_old_files), once every rank has read its checkpoint: rank 0
    moves an old run's files aside, or the checkpoints past the one it resumed from; every rank stops if it cannot.
    --eval-only moves nothing."""
    cfg, env = run.cfg, run.env
    if env.world_size > 1:  # every rank has read its checkpoint before rank 0 moves any file
        dist.barrier()
    with failing_together():
        if run.master and not cfg.eval_only:
            try:
                move_aside_old_files(cfg.log_dir, run.resumed_from, run.step)
            except OSError as e:
                raise UsageError(f"--log-dir {cfg.log_dir}: cannot use it ({e}); pass a directory this run may "
                                 f"write to")
