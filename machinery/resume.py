"""
A run resumed: which checkpoint (--resume's, or the latest readable one in --log-dir, checked whole on every rank),
whether it fits the run the flags describe, and the run put back where the checkpoint left it; and how a run that
stopped early goes on. The checkpoints themselves are checkpoints.py's.
"""

from dataclasses import asdict
from types import SimpleNamespace

import torch
import torch.distributed as dist

from machinery import checkpoints, settings, sharded_checkpoints
from machinery.errors import UsageError
from machinery.locks import Gone
from machinery.ranks import failing_together

# -----------------------------------------------------------------------------
# Which checkpoint


def choose_checkpoint(cfg, unreadable):
    """--resume's checkpoint and its path, or the latest readable one in --log-dir but those in unreadable ((None,
    None): there is none)."""
    if cfg.resume != "auto":
        try:
            return checkpoints.load(cfg.resume), cfg.resume
        except ValueError as e:
            raise UsageError(f"--resume {cfg.resume}: cannot load it ({e})")
    while True:
        paths = [path for path in checkpoints.checkpoint_paths(cfg.log_dir) if path not in unreadable]
        if not paths:
            return None, None
        try:
            return checkpoints.load(paths[-1]), paths[-1]
        except Gone:
            continue  # the training beside pruned it meanwhile, or saved its step again: look again
        except ValueError as e:
            skip_unreadable(paths[-1], e, unreadable)


def skip_unreadable(path, why, unreadable):
    print(f"warning: skipping unreadable checkpoint {path} ({why})")
    unreadable.append(path)


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
                    ckpt = checkpoints.load(path)
                except ValueError as e:
                    raise UsageError(f"rank {rank} cannot read {path}, which rank 0 resumes from ({e}); --log-dir "
                                     f"must be on a file system every node shares")
        damaged = checkpoints.damage(ckpt, path, rank, world_size)
        if damaged is None:
            return ckpt, path
        checkpoints.release(ckpt)
        if cfg.resume != "auto":
            raise UsageError(f"--resume {path}: cannot load it ({damaged})")
        if rank == 0:
            skip_unreadable(path, damaged, unreadable)


def how_to_resume(cfg):
    """What a run that stopped early keeps, and the command that goes on from it, in words."""
    latest = checkpoints.latest_checkpoint(cfg.log_dir)
    if latest is None:
        return "no checkpoint was written yet: run the same command again to start over"
    return f"the latest checkpoint, {latest}, is kept: run {settings.resume_command(cfg)} again to resume from it"


# -----------------------------------------------------------------------------
# Whether it fits, and the run put back


def check_same_model(ckpt, model, path):
    """Refuses a checkpoint of another model than the flags describe, naming the settings that differ (one it does not
    hold, being older, means its default). Only how the model computes (COMPUTE_ONLY) may change."""
    flags, saved = asdict(model.config), asdict(checkpoints.saved_model_config(ckpt, type(model.config), path))
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
    flags = [[{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
             for optimizer in optimizers]
    if ckpt["sharded"]:  # by name: split anew for this run's mesh, or whole for DDP's
        sharded_checkpoints.load_optimizers(model, optimizers, path)
    else:
        if len(ckpt["optimizers"]) != len(optimizers):
            raise UsageError(f"{path} holds the state of {len(ckpt['optimizers'])} optimizer(s), and this run has "
                             f"{len(optimizers)}; pass the settings it was trained with, or --no-resume to start over")
        for optimizer, state in zip(optimizers, ckpt["optimizers"]):
            optimizer.load_state_dict(state)
    for optimizer, flags_of_groups in zip(optimizers, flags):  # the flags win
        for group, flags in zip(optimizer.param_groups, flags_of_groups):
            group.update(flags)


def restore(run, ckpt, path):
    """Puts the run back where the checkpoint at path left it: weights and step, and to train on, the optimizers,
    the data position and the RNGs, saying how its schedule (its recipe's) changes, if it does. Evaluating needs the
    weights alone, on any --data."""
    cfg = run.cfg
    check_same_model(ckpt, run.model, path)
    checkpoints.load_weights(run.model, ckpt, path)
    run.step, run.resumed_from = ckpt["step"], path
    run.val_loss, run.val_step = ckpt["val_loss"], ckpt["val_step"]
    if cfg.eval_only:  # its settings are the checkpoint's (resolution.take_model_settings)
        checkpoints.release(ckpt)
        return
    # The checkpoint's evaluations count for this run too, unless its step is now this run's end (a smaller
    # --max-steps) and it was not validated there: the end always has a validation loss.
    run.evaluated = ckpt["evaluated"] and (run.step < cfg.max_steps or run.val_step == run.step)
    if run.step > cfg.max_steps:
        raise UsageError(f"{path} is at step {run.step}, past --max-steps {cfg.max_steps}; pass a larger --max-steps "
                         f"to train on, --resume an earlier checkpoint, or --no-resume to start over")
    check_same_training(ckpt, cfg, run.stream, path)
    run.micro_batch = ckpt.get("micro_batch") or 0  # trained with (not kept before it was chosen): chosen anew
    if run.master:
        say_schedule_change(ckpt["train_config"], cfg, run.step, run.recipe)
    run.stream.load_state_dict(ckpt["stream"])
    load_optimizers(run.optimizers, run.model, ckpt, path, cfg.fsdp)
    checkpoints.release(ckpt)
    if ckpt["scaler"]:  # empty unless the run used fp16
        run.scaler.load_state_dict(ckpt["scaler"])
    rank = run.env.rank
    if rank < len(ckpt["rng"]):
        torch.set_rng_state(ckpt["rng"][rank]["cpu"])
        if run.env.device_type == "cuda" and ckpt["rng"][rank]["cuda"] is not None:
            torch.cuda.set_rng_state(ckpt["rng"][rank]["cuda"])
    # the same W&B run as the checkpoint's, unless this run branches it into another directory (log_directory's
    # move_aside_old_files): W&B's step is the record's line in log.jsonl, which begins again there
    run.log.wandb_id = ckpt["wandb_id"] if checkpoints.is_log_dir_of(path, cfg.log_dir) else None
    run.seconds_before = ckpt.get("trained_seconds", 0.0)  # not kept before the training time was


def say_schedule_change(saved, cfg, step, recipe):
    """One line, if the learning rate of the steps from step on differs from what the schedule of the checkpoint's
    settings (saved) gives them, as with a larger --max-steps: the settings that make it, and what the rate does next,
    as a share of each parameter group's peak (the recipes' get_lr scale with it)."""
    before, get_lr = SimpleNamespace(**{**asdict(cfg), **saved}), recipe.get_lr  # a setting it lacks is this run's

    def share(s, schedule):
        return f"{100 * get_lr(s, 1.0, schedule):.3g}%"

    steps = range(step, cfg.max_steps)
    if all(get_lr(s, 1.0, before) == get_lr(s, 1.0, cfg) for s in steps):
        return
    changes = []
    for key in ("max_steps", "warmup_steps", "min_lr_ratio", *recipe.schedule):
        old, new = getattr(before, key), getattr(cfg, key)
        if old != new or key in ("max_steps", "warmup_steps"):
            changes.append(f"{settings.flag(key)} {new} ({'as before' if old == new else f'was {old}'})")
    peak = max(steps, key=lambda s: get_lr(s, 1.0, cfg))
    rise = f", up to {share(peak, cfg)} at step {peak}" if peak not in (step, steps[-1]) else ""
    print(f"the schedule changes on resuming: {', '.join(changes)}; the learning rate goes from "
          f"{share(step - 1, before)} of its peak at step {step - 1} to {share(step, cfg)} at step {step}{rise}, then "
          f"to {share(steps[-1], cfg)} at step {steps[-1]}")


def nothing_left(run):
    """Whether the resumed checkpoint is the end of this run, evaluated: then there is nothing left to do."""
    done = run.step == run.cfg.max_steps and run.evaluated and not run.cfg.eval_only
    if done and run.master:
        print(f"{run.resumed_from} is the end of this run (step {run.step}, val loss {run.val_loss:.4f}): nothing left "
              f"to do; pass a larger --max-steps to train on, or --no-resume to start over")
    return done
