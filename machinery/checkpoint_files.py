"""
Checkpoint files in a run's log directory: their names, written whole or not at all (a file ckpt_<step>.pt, or with
--fsdp a directory ckpt_<step>.dcp/), pruned, and held by their readers (--eval-only beside the training,
locks.ReadLock) so that no pruning deletes one being read. It never imports torch: what a checkpoint holds is
checkpoints.py's.
"""

import functools
import os
import shutil
import time

from machinery import files, ranks
from machinery.errors import UsageError
from machinery.locks import without_readers

CHECKPOINT = r"ckpt_\d+\.(pt|dcp)"  # a checkpoint's name as a regex: a file ckpt_<step>.pt, or --fsdp's directory
PARTIAL = CHECKPOINT + r"\.tmp(\.old)?"  # a checkpoint being written, or one being replaced by its step's new one
ABANDONED = CHECKPOINT + r"\.abandoned(\.\d+)?"  # a checkpoint newer than the one a run resumed from, moved aside


def checkpoint_step(path):
    return int(os.path.splitext(os.path.basename(path))[0][len("ckpt_"):])


def checkpoint_path(log_dir, step, sharded=False):
    """Where the checkpoint of step goes: a file, or with --fsdp a directory."""
    return os.path.join(log_dir, f"ckpt_{step:06d}.{'dcp' if sharded else 'pt'}")


def checkpoint_paths(log_dir):
    """Checkpoints in log_dir, oldest first: by step, as past step 999,999 the names outgrow their 6-digit padding."""
    return sorted(files.files_in(log_dir, CHECKPOINT), key=checkpoint_step)


def latest_checkpoint(log_dir, before_step=None):
    """The path of the latest checkpoint in log_dir (of a step before before_step, if given), or None."""
    paths = [p for p in checkpoint_paths(log_dir) if before_step is None or checkpoint_step(p) < before_step]
    return paths[-1] if paths else None


def resumes_from(log_dir):
    """How to go on from log_dir's latest checkpoint, in words."""
    try:
        latest = latest_checkpoint(log_dir) or "the start"
    except OSError:  # at the open-file limit, the directory cannot be listed
        latest = f"the latest checkpoint in {log_dir}"
    return f"run the same command again: it resumes from {latest}"


def no_room_for_checkpoint(log_dir, size, keep):
    """What to do when a checkpoint of about size bytes does not fit, in words."""
    return (f"a checkpoint needs about {size / 2**20:,.1f} MiB, {files.free_mib(log_dir):,.1f} MiB are free "
            f"(saving needs room for --keep-checkpoints {keep} of them and one more); make room, then "
            f"{resumes_from(log_dir)}")


def write_checkpoint(log_dir, step, save, size, keep):
    """Writes log_dir/ckpt_<step>.pt whole or not at all, with save(file); size: about how many bytes it takes."""
    path = checkpoint_path(log_dir, step)
    t0, again = time.perf_counter(), saved_again(path)
    files.write_atomically(path, save, path + ".tmp", lambda: no_room_for_checkpoint(log_dir, size, keep))
    print(f"saved {path}{again} ({os.path.getsize(path) / 2**20:,.0f} MiB in {time.perf_counter() - t0:.1f} s)")


def saved_again(path):
    """What the line of a save adds where path is there already: its step was saved before its evaluations
    (Run.after_step), and is saved again with them."""
    return " again, with its step's evaluations" if os.path.exists(path) else ""


def write_run_file(log_dir, step, save, size, keep):
    """Writes the run.pt of log_dir/ckpt_<step>.dcp/ anew, whole or not at all, with save(file): the rest of the
    checkpoint saved again at its step, its slices as they were written."""
    path = checkpoint_path(log_dir, step, sharded=True)
    run_file, t0 = os.path.join(path, "run.pt"), time.perf_counter()
    files.write_atomically(run_file, save, run_file + ".tmp", lambda: no_room_for_checkpoint(log_dir, size, keep))
    print(f"saved {path}{saved_again(path)} (its run.pt alone, its slices as written: "
          f"{time.perf_counter() - t0:.1f} s)")


def write_sharded_checkpoint(log_dir, step, save, size, keep, rank):
    """Writes log_dir/ckpt_<step>.dcp/ whole or not at all: rank 0 makes ckpt_<step>.dcp.tmp/, save(directory) fills
    it, every rank writing its own part (torch.distributed.checkpoint, which rank 0 ends with the index of all parts),
    then rank 0 renames it; a save that fails leaves nothing. Every rank calls it, save being collective; size: about
    how many bytes all ranks write."""
    path = checkpoint_path(log_dir, step, sharded=True)
    temp, t0, again = path + ".tmp", time.perf_counter(), saved_again(path)
    if_no_room = functools.partial(no_room_for_checkpoint, log_dir, size, keep)
    try:
        make_shared_directory(temp, log_dir, path, if_no_room, rank)
        stop_if_a_rank_can_open_nothing(path, log_dir, rank)
        write_parts(save, temp, path, if_no_room, rank)
        if rank == 0:
            put_in_place(temp, path, log_dir)
    finally:
        if rank == 0 and os.path.exists(temp):  # the save failed, on this rank or another
            shutil.rmtree(temp, ignore_errors=True)
    if rank == 0:
        written = sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))
        print(f"saved {path}{again} ({written / 2**20:,.0f} MiB in {time.perf_counter() - t0:.1f} s)")


def make_shared_directory(temp, log_dir, path, if_no_room, rank):
    """Rank 0 makes the directory temp (ckpt_<step>.dcp.tmp/, of path's checkpoint), anew; every rank must see it."""
    with ranks.failing_together():  # also the barrier after which every rank looks for the directory
        if rank == 0:
            try:
                if os.path.exists(temp):  # a save cut short, in this very run
                    files.remove(temp)
                os.mkdir(temp)
            except OSError as e:
                files.raise_if_no_room(e, path, if_no_room)
                raise UsageError(f"--log-dir {log_dir}: cannot make the checkpoint directory {temp} ({e.strerror})")
    with ranks.failing_together():
        if not os.path.isdir(temp):
            raise UsageError(f"--log-dir {log_dir}: this node does not see the checkpoint directory "
                             f"{temp} that rank 0 made; put --log-dir on a file system that every node shares")


def stop_if_a_rank_can_open_nothing(path, log_dir, rank):
    """Stops every rank, in one line naming the checkpoint kept, if any rank cannot open a file now (at its open-file
    limit, with the descriptors kept for saving let go): it could not write its part of path, and a checkpoint needs
    every part."""
    why = files.cannot_open_a_file()
    stuck = ranks.first_error_of_any_rank(why and f"rank {rank} cannot write its part of {path}: {why}")
    if stuck is not None:
        with ranks.failing_together():  # rank 0's line: a rank at its limit could not list the directory
            if rank == 0:
                raise UsageError(f"{stuck}, then {resumes_from(log_dir)}")


def write_parts(save, temp, path, if_no_room, rank):
    """save(temp), on every rank; one that fails stops every rank, with one line where the disk is full."""
    failure = None
    try:
        save(temp)
        if rank == 0:  # torch.distributed.checkpoint syncs its own files; the rest of them too, before the rename
            for name in os.listdir(temp):
                files.sync_file(os.path.join(temp, name))
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is no Exception
        failure = e
    what = None if failure is None else f"{type(failure).__name__}: {files.first_line(failure)}"
    failed = None if failure is None else (files.no_room(failure), what)
    failed = ranks.first_error_of_any_rank(failed)  # on every rank, as of rank 0's part alone: none is left waiting
    if failed is None:
        return
    if rank == 0:
        shutil.rmtree(temp, ignore_errors=True)
    reason, what = failed
    if reason is None:  # not for lack of room: the rank it happened on shows its traceback
        if failure is not None:
            raise failure
        raise UsageError(f"another rank failed to write its part of {path} ({what})")
    with ranks.failing_together():  # rank 0's line, with the room there is once the partial directory is gone
        if rank == 0:
            raise UsageError(f"{reason} writing {path}: {if_no_room()}")


def put_in_place(temp, path, log_dir):
    """Renames the written directory temp to path, durably; an older one of the same step once no reader holds it."""
    replaced = path + ".tmp.old"
    if os.path.exists(path):  # one of this step already, of other slices: the new one takes its place
        with without_readers(path, wait=True):
            os.replace(path, replaced)
    os.replace(temp, path)
    files.sync_directory(log_dir)
    if os.path.exists(replaced):
        files.remove(replaced)


def prune_checkpoints(log_dir, keep):
    """Deletes all but the latest keep checkpoints; only once the newest is durably in place (write_checkpoint). One
    that a reader is loading stays until a later prune: the training never waits for a reader."""
    for old in checkpoint_paths(log_dir)[:-keep]:
        with without_readers(old, wait=False) as unheld:
            if unheld:
                files.remove(old)
