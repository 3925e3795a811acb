"""
Checkpoints and resuming: what a checkpoint holds, saving and pruning it, finding the one to resume from, restoring a
run from it.

A checkpoint is a file ckpt_<step>.pt; with --fsdp, a directory ckpt_<step>.dcp/ of each rank's slices
(sharded_checkpoints.py) with run.pt beside them, which holds their checksums. checkpoint_files.py writes either whole
or not at all. A process reading one holds it from choosing it until its tensors are loaded (load, release), so that
the training beside never prunes it under its reader, and reads it all back against its checksums before it uses any
of its tensors (damage), the ranks sharing the work. The run is handed over, and the model is built by the model_of
it passes (a checkpoint's model_config -> a new model).
"""

import contextlib
import os
from dataclasses import asdict
from types import SimpleNamespace

import torch
import torch.distributed as dist

from machinery import checkpoint_files, files, locks, log_directory, settings, sharded_checkpoints
from machinery.errors import UsageError
from machinery.ranks import every_rank, failing_together, first_error_of_any_rank

FORMAT = 2  # raised whenever what a checkpoint holds changes: a checkpoint of another format is refused


@contextlib.contextmanager
def holding_log_dir(cfg, env):
    """Rank 0 holds the log directory's lock (log_directory.lock_log_dir) while inside; every rank stops if it
    cannot."""
    with contextlib.ExitStack() as held:
        with failing_together():
            if env.rank == 0:
                held.enter_context(log_directory.lock_log_dir(cfg.log_dir, exclusive=not cfg.eval_only))
        yield


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
                checkpoint_files.write_checkpoint(cfg.log_dir, run.step, lambda f: torch.save(ckpt, f),
                                                  files.tensor_bytes(ckpt), cfg.keep_checkpoints)
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
    checkpoint_files.write_sharded_checkpoint(run.cfg.log_dir, run.step, save_into, size + files.tensor_bytes(ckpt),
                                              run.cfg.keep_checkpoints, run.env.rank)  # and rank 0's run.pt


def slices_saved(run):
    """Whether --log-dir's checkpoint of run.step holds the run's weights and optimizer state already: this launch
    saved it, or resumed from it, at this very step, and did its evaluations alone since (the end of a run is saved
    before them, and again after). Every rank gets rank 0's answer."""
    path = checkpoint_files.checkpoint_path(run.cfg.log_dir, run.step, sharded=True)
    return every_rank(run.master and run.saved_step == run.step and os.path.isdir(path))[0]


def save_run_file_again(run, ckpt):
    """Rank 0 writes the run.pt of the checkpoint of run.step anew, with ckpt and the checksums of the slices beside
    it, which stay as they were written: the weights and optimizer state are not written twice."""
    path = checkpoint_files.checkpoint_path(run.cfg.log_dir, run.step, sharded=True)
    kept = torch.load(os.path.join(path, "run.pt"), map_location="cpu", weights_only=True).get("checksums")
    checkpoint_files.write_run_file(run.cfg.log_dir, run.step, lambda f: torch.save({**ckpt, "checksums": kept}, f),
                                    files.tensor_bytes(ckpt), run.cfg.keep_checkpoints)


def ready_to_save(cfg):
    """What a save needs, taken at the start (Run.launch): a rank that reaches its open-file limit later could take
    none of it. A few file descriptors kept for the save (files.DescriptorReserve), and under --fsdp,
    torch.distributed.checkpoint imported (a second)."""
    if cfg.fsdp:
        sharded_checkpoints.checkpoint_modules()
    return files.DescriptorReserve()


def prune(run):
    """Rank 0 deletes the checkpoints past --keep-checkpoints: only once the newest one's weights trained to a finite
    loss, so that the last checkpoint that trains is never deleted."""
    if run.master:
        checkpoint_files.prune_checkpoints(run.cfg.log_dir, run.cfg.keep_checkpoints)


# -----------------------------------------------------------------------------
# Reading, and the resume policy


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


def load_weights(model, ckpt, path):
    """The checkpoint's weights into the model, sharded by FSDP or not, whichever way the checkpoint was written."""
    if ckpt["sharded"]:
        sharded_checkpoints.load_weights(model, path)
    elif sharded_checkpoints.is_sharded(model):  # a DDP run's whole tensors, into FSDP's slices
        sharded_checkpoints.load_whole_weights(model, ckpt["model"])
    else:
        model.load_state_dict(ckpt["model"])


def model_from_checkpoint(ckpt, path, model_of):
    """The checkpoint's model, of the recipe and shapes it records: model_of(model_config) makes it."""
    try:
        model = model_of(ckpt["model_config"])
    except TypeError as e:  # a setting GPTConfig does not have
        raise UsageError(f"{path} has model settings this train_gpt2.py does not know ({e}); use the train_gpt2.py "
                         f"that wrote it") from None
    load_weights(model, ckpt, path)
    release(ckpt)
    return model


def val_loss_in_words(ckpt):
    """The validation loss of the checkpoint's weights, in words: a signal may have saved them before their
    evaluation."""
    step, val_step, val_loss = ckpt["step"], ckpt["val_step"], ckpt["val_loss"]
    if val_loss is None:
        return "not evaluated"
    if val_step == step:
        return f"val loss {val_loss:.4f}"
    return f"not evaluated; val loss {val_loss:.4f} at step {val_step}"


def choose_checkpoint(cfg, unreadable):
    """--resume's checkpoint and its path, or the latest readable one in --log-dir but those in unreadable ((None,
    None): there is none)."""
    if cfg.resume != "auto":
        try:
            return load(cfg.resume), cfg.resume
        except ValueError as e:
            raise UsageError(f"--resume {cfg.resume}: cannot load it ({e})")
    while True:
        paths = [path for path in checkpoint_files.checkpoint_paths(cfg.log_dir) if path not in unreadable]
        if not paths:
            return None, None
        try:
            return load(paths[-1]), paths[-1]
        except locks.Gone:
            continue  # the training beside pruned it meanwhile, or saved its step again: look again
        except ValueError as e:
            skip_unreadable(paths[-1], e, unreadable)


def skip_unreadable(path, why, unreadable):
    print(f"warning: skipping unreadable checkpoint {path} ({why})")
    unreadable.append(path)


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


def how_to_resume(cfg):
    """What a run that stopped early keeps, and the command that goes on from it, in words."""
    latest = checkpoint_files.latest_checkpoint(cfg.log_dir)
    if latest is None:
        return "no checkpoint was written yet: run the same command again to start over"
    return f"the latest checkpoint, {latest}, is kept: run {settings.resume_command(cfg)} again to resume from it"


def find_resume_checkpoint(cfg, rank, world_size):
    """The checkpoint to resume from and its path ((None, None): start fresh). Rank 0 picks it, falling back past
    unreadable ones, and every rank loads that same one; they check it whole together (damage) before any of its
    tensors is used, and fall back past a damaged one too."""
    if cfg.resume == "none" or (cfg.eval_only and cfg.resume == "auto" and cfg.init_from != "scratch"):
        return None, None  # --eval-only --init-from gpt2 evaluates OpenAI's weights, not the run's
    unreadable = []  # rank 0's
    while True:
        ckpt, chosen = None, [None]
        with failing_together():
            if rank == 0:
                ckpt, chosen[0] = choose_checkpoint(cfg, unreadable)
        if world_size > 1:
            dist.broadcast_object_list(chosen, src=0)
        path = chosen[0]
        if path is None:
            return None, None
        with failing_together():
            if rank != 0:
                try:
                    ckpt = load(path)
                except ValueError as e:
                    raise UsageError(f"rank {rank} cannot read {path}, which rank 0 resumes from ({e}); --log-dir "
                                     f"must be on a file system every node shares")
        damaged = damage(ckpt, path, rank, world_size)
        if damaged is None:
            return ckpt, path
        release(ckpt)
        if cfg.resume != "auto":
            raise UsageError(f"--resume {path}: cannot load it ({damaged})")
        if rank == 0:
            skip_unreadable(path, damaged, unreadable)


def saved_model_config(ckpt, config_class, path):
    """The checkpoint's model settings as config_class (GPTConfig) holds them: one it lacks, being older, means its
    default; one config_class does not know is refused."""
    try:
        return config_class(**ckpt["model_config"])
    except TypeError as e:
        raise UsageError(f"{path} has model settings this train_gpt2.py does not know ({e}); use the train_gpt2.py "
                         f"that wrote it") from None


def check_same_model(ckpt, model, path):
    """Refuses a checkpoint of another model than the flags describe, naming the settings that differ (one it does not
    hold, being older, means its default). Only how the model computes (COMPUTE_ONLY) may change."""
    flags, saved = asdict(model.config), asdict(saved_model_config(ckpt, type(model.config), path))
    differ = [f"{k}: checkpoint {saved[k]}, flags {flags[k]}" for k in flags
              if k not in settings.COMPUTE_ONLY and saved[k] != flags[k]]
    if differ:
        raise UsageError(f"{path} (step {ckpt['step']}) does not fit the model the flags describe "
                         f"({'; '.join(differ)}); pass matching flags, or another --log-dir to keep that run where it "
                         f"is, or --no-resume to start fresh there (its files are moved aside)")


def check_same_training(ckpt, cfg, stream, path):
    """Refuses to train on from a checkpoint whose steps or data position mean something else with these settings."""
    saved = ckpt["train_config"]["total_batch_size"]
    if saved != cfg.total_batch_size:
        raise UsageError(f"{path} was trained with --total-batch-size {saved}, not {cfg.total_batch_size}: its "
                         f"{ckpt['step']} steps stand for {ckpt['step'] * saved:,} tokens, and the schedule and the "
                         f"log count steps; pass --total-batch-size {saved}, or --no-resume to start over")
    position, now = ckpt["stream"], stream.state_dict()
    if position["seed"] != now["seed"]:
        raise UsageError(f"the checkpoint's data position is for --seed {position['seed']}, not --seed {now['seed']}: "
                         f"the shard order depends on it; pass --seed {position['seed']}, or --no-resume to start "
                         f"over")
    change = shards_changed(position["shards"], now["shards"])
    if change:
        raise UsageError(f"the checkpoint's data position is in other training shards than those of --data: "
                         f"{change}; pass the --data it was trained on, or --no-resume to start over")


def shards_changed(saved, now):
    """What differs between the shards a checkpoint was trained on and these, in words ("" if nothing)."""
    before, after = dict(saved), dict(now)
    changes = [f"{name} is gone" if name not in after else f"{name} had {tokens:,} tokens, now {after[name]:,}"
               for name, tokens in before.items() if after.get(name) != tokens]
    changes += [f"{name} is new" for name in after if name not in before]
    return "; ".join(changes) or ("the shards are in another order" if saved != now else "")


def load_optimizers(optimizers, model, ckpt, path, sharded):
    """The optimizers' state from the checkpoint, under the settings of this run's flags (--weight-decay, ...)."""
    if sharded and not ckpt["sharded"]:  # the state of whole tensors, by position, cannot be split into FSDP's slices
        raise UsageError(f"{path} was written without --fsdp, and only a run without it can train on from it; pass "
                         f"--no-fsdp, or --no-resume to start over (--eval-only, --sample and --export-hf read either)")
    settings = [[{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
                for optimizer in optimizers]
    if ckpt["sharded"]:  # by name: split anew for this run's mesh, or whole for DDP's
        sharded_checkpoints.load_optimizers(model, optimizers, path)
    else:
        if len(ckpt["optimizers"]) != len(optimizers):
            raise UsageError(f"{path} holds the state of {len(ckpt['optimizers'])} optimizer(s), and this run has "
                             f"{len(optimizers)}; pass the settings it was trained with, or --no-resume to start over")
        for optimizer, state in zip(optimizers, ckpt["optimizers"]):
            optimizer.load_state_dict(state)
    for optimizer, flags_of_groups in zip(optimizers, settings):  # the flags win
        for group, flags in zip(optimizer.param_groups, flags_of_groups):
            group.update(flags)


def restore(run, ckpt, path):
    """Puts the run back where the checkpoint at path left it: weights and step, and to train on, the optimizers,
    the data position and the RNGs, saying how its schedule (its recipe's) changes, if it does. Evaluating needs the
    weights alone, on any --data."""
    cfg = run.cfg
    check_same_model(ckpt, run.model, path)
    load_weights(run.model, ckpt, path)
    run.step, run.resumed_from = ckpt["step"], path
    run.val_loss, run.val_step = ckpt["val_loss"], ckpt["val_step"]
    if cfg.eval_only:  # its settings are the checkpoint's (settings.take_model_settings)
        release(ckpt)
        return
    # The checkpoint's evaluations count for this run too, unless its step is now this run's end (a smaller
    # --max-steps) and it was not validated there: the end always has a validation loss.
    run.evaluated = ckpt["evaluated"] and (run.step < cfg.max_steps or run.val_step == run.step)
    if run.step > cfg.max_steps:
        raise UsageError(f"{path} is at step {run.step}, past --max-steps {cfg.max_steps}; pass a larger --max-steps "
                         f"to train on, --resume an earlier checkpoint, or --no-resume to start over")
    check_same_training(ckpt, cfg, run.stream, path)
    if run.master:
        say_schedule_change(ckpt["train_config"], cfg, run.step, run.recipe.get_lr)
    run.stream.load_state_dict(ckpt["stream"])
    load_optimizers(run.optimizers, run.model, ckpt, path, cfg.fsdp)
    release(ckpt)
    if ckpt["scaler"]:  # empty unless the run used fp16
        run.scaler.load_state_dict(ckpt["scaler"])
    rank = run.env.rank
    if rank < len(ckpt["rng"]):
        torch.set_rng_state(ckpt["rng"][rank]["cpu"])
        if run.env.device_type == "cuda" and ckpt["rng"][rank]["cuda"] is not None:
            torch.cuda.set_rng_state(ckpt["rng"][rank]["cuda"])
    # the same W&B run as the checkpoint's, unless this run branches it into another directory (log_dir.py's
    # prepare_log_dir): W&B's step is the record's line in log.jsonl, which begins again there
    run.log.wandb_id = ckpt["wandb_id"] if log_directory.is_log_dir_of(path, cfg.log_dir) else None
    run.seconds_before = ckpt.get("trained_seconds", 0.0)  # not kept before the training time was


def say_schedule_change(saved, cfg, step, get_lr):
    """One line, if the learning rate of the steps from step on differs from what the schedule of the checkpoint's
    settings (saved) gives them, as with a larger --max-steps: the settings that make it, and what the rate does next,
    as a share of each parameter group's peak (the recipes' get_lr scale with it)."""
    before = SimpleNamespace(**{**asdict(cfg), **saved})  # a setting the checkpoint lacks is this run's

    def share(s, schedule):
        return f"{100 * get_lr(s, 1.0, schedule):.3g}%"

    steps = range(step, cfg.max_steps)
    if all(get_lr(s, 1.0, before) == get_lr(s, 1.0, cfg) for s in steps):
        return
    changes = []
    for key in ("max_steps", "warmup_steps", "min_lr_ratio", "cooldown_frac"):
        old, new = getattr(before, key), getattr(cfg, key)
        if old != new or key in ("max_steps", "warmup_steps"):
            changes.append(f"{settings.flag(key)} {new} ({'as before' if old == new else f'was {old}'})")
    peak = max(steps, key=lambda s: get_lr(s, 1.0, cfg))
    rise = f", up to {share(peak, cfg)} at step {peak}" if peak not in (step, steps[-1]) else ""
    print(f"the schedule changes on resuming: {', '.join(changes)}; the learning rate goes from "
          f"{share(step - 1, before)} of its peak at step {step - 1} to {share(step, cfg)} at step {step}{rise}, then "
          f"to {share(steps[-1], cfg)} at step {steps[-1]}")


def finished(run):
    """Whether the resumed checkpoint is the end of this run, evaluated: then there is nothing left to do."""
    done = run.step == run.cfg.max_steps and run.evaluated and not run.cfg.eval_only
    if done and run.master:
        print(f"{run.resumed_from} is the end of this run (step {run.step}, val loss {run.val_loss:.4f}): nothing left "
              f"to do; pass a larger --max-steps to train on, or --no-resume to start over")
    return done
