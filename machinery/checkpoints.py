"""
A checkpoint: what it holds, its files in the run's log directory (their names; written whole or not at all, with
saving's progress line; pruned), and read back whole. A checkpoint is a file ckpt_<step>.pt; with --fsdp, a directory
ckpt_<step>.dcp/ of each rank's slices (sharded_checkpoints.py) with run.pt beside them, which holds their checksums.
A process reading one holds it from choosing it until its tensors are loaded (load, release: locks.ReadLock), so that
the training beside never prunes it under its reader, and reads it all back against its checksums before it uses any
of its tensors (damage), the ranks sharing the work. The run is handed over, and the model is built by the model_of
it passes (a checkpoint's model_config -> a new model). Which checkpoint a run resumes from, and how, is resume.py's.
"""

import functools
import os
import shutil
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from machinery import files, locks, sharded_checkpoints
from machinery.errors import UsageError
from machinery.ranks import every_rank, failing_together, first_error_of_any_rank

FORMAT = 2  # raised whenever what a checkpoint holds changes: a checkpoint of another format is refused
CHECKPOINT = r"ckpt_\d+\.(pt|dcp)"  # a checkpoint's name as a regex: a file ckpt_<step>.pt, or --fsdp's directory
PARTIAL = CHECKPOINT + r"\.tmp(\.old)?"  # a checkpoint being written, or one being replaced by its step's new one
ABANDONED = CHECKPOINT + r"\.abandoned(\.\d+)?"  # a checkpoint newer than the one a run resumed from, moved aside


# -----------------------------------------------------------------------------
# Names


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


def is_log_dir_of(path, log_dir):
    """Whether log_dir is the directory of the checkpoint at path, by whatever path (a link to it or to the
    directory, another mount)."""
    try:
        return os.path.samefile(os.path.dirname(os.path.realpath(path)), log_dir)
    except OSError:
        return False


# -----------------------------------------------------------------------------
# Saving


def contents(run, rng_per_rank):
    """All a checkpoint holds, but for FSDP's weights and optimizer state (sharded_checkpoints.sharded_contents),
    kept apart."""
    whole = {} if run.cfg.fsdp else {
        "model": run.model.state_dict(), "optimizers": [optimizer.state_dict() for optimizer in run.optimizers]}
    return {
        "format": FORMAT, "sharded": run.cfg.fsdp, **whole, "model_config": asdict(run.model.config),
        "scaler": run.scaler.state_dict(),
        "step": run.step, "micro_batch": run.micro_batch, "evaluated": run.evaluated, "val_loss": run.val_loss,
        "val_step": run.val_step,
        "stream": run.stream.state_dict(), "rng": rng_per_rank,
        "train_config": asdict(run.cfg), "wandb_id": run.log.wandb_id,
        "trained_seconds": run.seconds_trained(),  # of all its launches
    }


def save(run):
    """Rank 0 writes the checkpoint of run.step, with every rank's RNG states; under FSDP, every rank writes its
    slices of the weights and optimizer state beside it, in a directory, unless they are there already."""
    cfg, env = run.cfg, run.env
    rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if env.device_type == "cuda" else None}
    rng_per_rank = [rng]
    if env.world_size > 1:
        # to rank 0 alone, which writes them: unpickling a tensor may import a module, which a rank out of file
        # descriptors (its reads failed at its open-file limit) cannot
        rng_per_rank = [None] * env.world_size if run.master else None
        dist.gather_object(rng, rng_per_rank, dst=0)
    with failing_together():  # a full disk stops every rank; and none goes on before the checkpoint is written
        ckpt = contents(run, rng_per_rank) if run.master else None  # rank 0 alone writes it
        if not cfg.fsdp:
            if run.master:
                write_checkpoint(cfg.log_dir, run.step, lambda f: torch.save(ckpt, f), tensor_bytes(ckpt),
                                 cfg.keep_checkpoints)
        elif slices_saved(run):
            if run.master:
                save_run_file_again(run, ckpt)
        else:
            save_sharded(run, ckpt)


def save_sharded(run, ckpt):
    """Every rank writes its slices of the weights and optimizer state into the checkpoint's directory, and rank 0
    ckpt (its run.pt) beside them, with the checksums of the slices."""
    sharded = sharded_checkpoints.sharded_contents(run.model, run.optimizers)

    def save_into(directory):
        checksums = sharded_checkpoints.save(sharded, directory)
        if run.master:  # through a file object: given a path, torch.save's own stream fails with no errno
            with open(os.path.join(directory, "run.pt"), "wb") as f:
                torch.save({**ckpt, "checksums": checksums}, f)

    size = sharded_checkpoints.written_bytes(sharded, sharded_checkpoints.shards(run.model))
    write_sharded_checkpoint(run.cfg.log_dir, run.step, save_into, size + tensor_bytes(ckpt), run.cfg.keep_checkpoints,
                             run.env.rank)  # and rank 0's run.pt


def slices_saved(run):
    """Whether --log-dir's checkpoint of run.step holds the run's weights and optimizer state already: this launch
    saved it, or resumed from it, at this very step, and did its evaluations alone since (the end of a run is saved
    before them, and again after). Every rank gets rank 0's answer."""
    path = checkpoint_path(run.cfg.log_dir, run.step, sharded=True)
    return every_rank(run.master and run.saved_step == run.step and os.path.isdir(path))[0]


def save_run_file_again(run, ckpt):
    """Rank 0 writes the run.pt of the checkpoint of run.step anew, with ckpt and the checksums of the slices beside
    it, which stay as they were written: the weights and optimizer state are not written twice."""
    path = checkpoint_path(run.cfg.log_dir, run.step, sharded=True)
    kept = torch.load(os.path.join(path, "run.pt"), map_location="cpu", weights_only=True).get("checksums")
    write_run_file(run.cfg.log_dir, run.step, lambda f: torch.save({**ckpt, "checksums": kept}, f), tensor_bytes(ckpt),
                   run.cfg.keep_checkpoints)


def ready_to_save(cfg):
    """What a save needs, taken at the start (Run.start_training): a rank that reaches its open-file limit later could
    take none of it. A few file descriptors kept for the save (files.DescriptorReserve), and under --fsdp,
    torch.distributed.checkpoint imported (a second)."""
    if cfg.fsdp:
        sharded_checkpoints.checkpoint_modules()
    return files.DescriptorReserve()


def prune(run):
    """Rank 0 deletes the checkpoints past --keep-checkpoints: only once the newest one's weights trained to a finite
    loss, so that the last checkpoint that trains is never deleted."""
    if run.master:
        prune_checkpoints(run.cfg.log_dir, run.cfg.keep_checkpoints)


# -----------------------------------------------------------------------------
# Its files, written whole or not at all, and pruned


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


def resumes_from(log_dir):
    """How to go on from log_dir's latest checkpoint, in words."""
    try:
        latest = latest_checkpoint(log_dir) or "the start"
    except OSError:  # at the open-file limit, the directory cannot be listed
        latest = f"the latest checkpoint in {log_dir}"
    return f"run the same command again: it resumes from {latest}"


def no_room_for_checkpoint(log_dir, size, keep):
    """What to do when a checkpoint of about size bytes does not fit, in words."""
    free = shutil.disk_usage(log_dir).free
    return (f"a checkpoint needs about {size / 2**20:,.1f} MiB, {free / 2**20:,.1f} MiB are free "
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
    with failing_together():  # also the barrier after which every rank looks for the directory
        if rank == 0:
            try:
                if os.path.exists(temp):  # a save cut short, in this very run
                    files.remove(temp)
                os.mkdir(temp)
            except OSError as e:
                files.raise_if_no_room(e, path, if_no_room)
                raise UsageError(f"--log-dir {log_dir}: cannot make the checkpoint directory {temp} ({e.strerror})")
    with failing_together():
        if not os.path.isdir(temp):
            raise UsageError(f"--log-dir {log_dir}: this node does not see the checkpoint directory "
                             f"{temp} that rank 0 made; put --log-dir on a file system that every node shares")


def stop_if_a_rank_can_open_nothing(path, log_dir, rank):
    """Stops every rank, in one line naming the checkpoint kept, if any rank cannot open a file now (at its open-file
    limit, with the descriptors kept for saving let go): it could not write its part of path, and a checkpoint needs
    every part."""
    why = files.cannot_open_a_file()
    stuck = first_error_of_any_rank(why and f"rank {rank} cannot write its part of {path}: {why}")
    if stuck is not None:
        with failing_together():  # rank 0's line: a rank at its limit could not list the directory
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
    failed = first_error_of_any_rank(failed)  # on every rank, as of rank 0's part alone: none is left waiting
    if failed is None:
        return
    if rank == 0:
        shutil.rmtree(temp, ignore_errors=True)
    reason, what = failed
    if reason is None:  # not for lack of room: the rank it happened on shows its traceback
        if failure is not None:
            raise failure
        raise UsageError(f"another rank failed to write its part of {path} ({what})")
    with failing_together():  # rank 0's line, with the room there is once the partial directory is gone
        if rank == 0:
            raise UsageError(f"{reason} writing {path}: {if_no_room()}")


def put_in_place(temp, path, log_dir):
    """Renames the written directory temp to path, durably; an older one of the same step once no reader holds it."""
    replaced = path + ".tmp.old"
    if os.path.exists(path):  # one of this step already, of other slices: the new one takes its place
        with locks.without_readers(path, wait=True):
            os.replace(path, replaced)
    os.replace(temp, path)
    files.sync_directory(log_dir)
    if os.path.exists(replaced):
        files.remove(replaced)


def prune_checkpoints(log_dir, keep):
    """Deletes all but the latest keep checkpoints; only once the newest is durably in place (write_checkpoint). One
    that a reader is loading stays until a later prune: the training never waits for a reader."""
    for old in checkpoint_paths(log_dir)[:-keep]:
        with locks.without_readers(old, wait=False) as unheld:
            if unheld:
                files.remove(old)


# -----------------------------------------------------------------------------
# Reading


def load(path):
    """A checkpoint of this train_gpt2.py, whole, and held (locks.ReadLock) until release(ckpt), once its tensors are
    loaded: the training prunes no checkpoint while it is read. Raises ValueError if it cannot be read (locks.Gone if
    it is no more), UsageError if it is of another format or a file inside one."""
    inside = os.path.dirname(path) or os.getcwd()
    if not os.path.isdir(path) and os.path.isfile(os.path.join(inside, "run.pt")):
        raise UsageError(f"{path} is a file inside the sharded checkpoint {inside}: pass the directory {inside}")
    try:
        held = locks.ReadLock(path)
    except OSError as e:
        raise ValueError(f"{type(e).__name__}: {e}") from None
    try:
        ckpt = read_checkpoint(path)
    except BaseException:
        held.release()  # now, not once collected: this very run may move it aside, which waits for its readers
        raise
    ckpt["held"] = held
    return ckpt


def read_checkpoint(path):
    """What load returns, but for the lock."""
    try:  # --fsdp's is a directory: all but the sharded tensors are in its run.pt (save)
        # weights_only: a checkpoint is data, and loading one can never run code
        ckpt = torch.load(os.path.join(path, "run.pt") if os.path.isdir(path) else path, map_location="cpu",
                          weights_only=True, mmap=True)  # mmap: no private copy per rank
    except Exception as e:  # torch's messages can run over many lines: keep the first, for one-line errors
        raise ValueError(f"{type(e).__name__}: {files.first_line(e)}") from None
    if not isinstance(ckpt, dict) or not ("model" in ckpt or ckpt.get("sharded")) or "model_config" not in ckpt:
        raise ValueError("not a train_gpt2.py checkpoint")
    ckpt.setdefault("sharded", False)  # written before --fsdp was
    if ckpt.get("format") != FORMAT:
        raise UsageError(f"{path} is a checkpoint of format {ckpt.get('format', 1)}, and this train_gpt2.py reads "
                         f"format {FORMAT} only; use the train_gpt2.py that wrote it")
    if ckpt["sharded"]:
        sharded_checkpoints.check_complete(path)
    return ckpt


def release(ckpt):
    """Lets the training prune or replace the checkpoint again (load): what is read of it is loaded."""
    held = ckpt.pop("held", None)
    if held is not None:
        held.release()


def damage(ckpt, path, rank=0, world_size=1):
    """What is damaged in the checkpoint at path (load's ckpt), in words, or None, on every rank: each reads its share
    of it whole (by bytes), against the checksums written with it, so that no rank reads all of it. torch.save's
    CRC-32 of each record of a .pt, or of --fsdp's run.pt, which holds those of the slice files beside it. All ranks
    must call it."""
    run_pt = os.path.join(path, "run.pt") if ckpt["sharded"] else path
    parts = files.zip_record_checks(run_pt)
    if ckpt["sharded"]:
        parts += sharded_checkpoints.file_checks(path, ckpt.get("checksums"))
    share = sorted(parts, key=lambda part: part[0], reverse=True)[rank::world_size]  # the largest spread over ranks
    return first_error_of_any_rank(next(filter(None, (check() for _, check in share)), None))


def load_weights(model, ckpt, path):
    """The checkpoint's weights into the model, sharded by FSDP or not, whichever way the checkpoint was written."""
    if ckpt["sharded"]:
        sharded_checkpoints.load_weights(model, path)
    elif sharded_checkpoints.is_sharded(model):  # a DDP run's whole tensors, into FSDP's slices
        sharded_checkpoints.load_whole_weights(model, ckpt["model"])
    else:
        model.load_state_dict(ckpt["model"])


def unknown_model_settings(path, error):
    """The one-line refusal of a checkpoint whose model settings GPTConfig does not know (its TypeError, error)."""
    return UsageError(f"{path} has model settings this train_gpt2.py does not know ({error}); use the train_gpt2.py "
                      f"that wrote it")


def model_from_checkpoint(ckpt, path, model_of):
    """The checkpoint's model, of the recipe and shapes it records: model_of(model_config) makes it."""
    try:
        model = model_of(ckpt["model_config"])
    except TypeError as e:  # a setting GPTConfig does not have
        raise unknown_model_settings(path, e) from None
    load_weights(model, ckpt, path)
    release(ckpt)
    return model


def saved_model_config(ckpt, config_class, path):
    """The checkpoint's model settings as config_class (GPTConfig) holds them: one it lacks, being older, means its
    default; one config_class does not know is refused."""
    try:
        return config_class(**ckpt["model_config"])
    except TypeError as e:
        raise unknown_model_settings(path, e) from None


def val_loss_in_words(ckpt):
    """The validation loss of the checkpoint's weights, in words: a signal may have saved them before their
    evaluation."""
    step, val_step, val_loss = ckpt["step"], ckpt["val_step"], ckpt["val_loss"]
    if val_loss is None:
        return "not evaluated"
    if val_step == step:
        return f"val loss {val_loss:.4f}"
    return f"not evaluated; val loss {val_loss:.4f} at step {val_step}"
