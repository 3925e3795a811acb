"""
Every check of the settings, each a one-line refusal (UsageError) that names the flag and what to do: the paths,
before any command reads one; then, on the settings resolved, each one's range, those that cannot run together, and
the recipe's own refusals. What a module alone knows it checks itself (fsdp.check_settings, speedups.check, a
benchmark's check, ...), and final_settings runs those after these.
"""

import math
import os

import torch

from machinery.errors import UsageError
from machinery.settings import declared_with, flag
from machinery.tokenizer import GPT2_VOCAB


def require(cfg, names, ok, what):
    """Refuses the first of the settings names whose value is not ok, saying what it must be."""
    for name in names:
        if not ok(getattr(cfg, name)):  # written so that NaN fails too
            raise UsageError(f"{flag(name)} must be {what}, not {getattr(cfg, name)}")


def check_paths(cfg, given, model_sizes):
    """Refuses a path flag given an empty value, as an unset shell variable gives: to some, an empty path means "off"
    or "the default" (--export-hf "" trained instead, resuming the run in --log-dir or moving its files aside); and an
    --init-from that is no OpenAI model (model_sizes) nor a directory, before any command downloads it."""
    for name in declared_with(cfg, "path"):
        if name in given and getattr(cfg, name) == "":
            raise UsageError(f"{flag(name)} is empty; pass a path (an unset shell variable?), or drop the flag")
    if cfg.init_from not in ("scratch", *model_sizes) and not os.path.isdir(cfg.init_from):
        raise UsageError(f"--init-from {cfg.init_from}: no such directory, nor an OpenAI model name; pass scratch, one "
                         f"of {', '.join(model_sizes)}, or a directory that --export-hf wrote")


def check_config(cfg, world_size):
    """Refuses each setting out of its range, and the settings that cannot run together, in one line each."""
    benchmarks = declared_with(cfg, "benchmark")  # their text needs every GPT-2 token
    require(cfg, [name for name, value in vars(cfg).items() if isinstance(value, float)], math.isfinite,
            "a finite number")  # --max-lr inf trained with lr nan, --logit-softcap inf gave NaN at every step
    require(cfg, ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "batch_size", "seq_len",
                  "total_batch_size", "val_tokens", "keep_checkpoints", "max_bad_steps", "grad_clip"),
            lambda v: v > 0, "positive")
    require(cfg, ("max_steps", "warmup_steps", "eval_every", *benchmarks, "checkpoint_every", "num_samples",
                  "max_new_tokens"), lambda v: v >= 0, "zero or more")
    # a setting named *_lr is a learning rate, wherever it is declared (a recipe's optimizers bring their own). Adam
    # divides its rate by 1 - beta1 (10 or 5 times it at the first step), Muon multiplies its own by up to 2: near
    # float32's largest number, the optimizer's step overflows (a traceback inside torch)
    most = torch.finfo(torch.float32).max / 100
    rates = [name for name in vars(cfg) if name.endswith("_lr")]
    require(cfg, rates, lambda v: v > 0, "positive")
    require(cfg, rates, lambda v: v <= most, f"at most {most:.2g} (a larger rate can overflow float32 in the "
                                             f"optimizer's step)")
    require(cfg, ("min_lr_ratio",), lambda v: 0 <= v <= 1, "between 0 and 1")
    require(cfg, ("seed",), lambda v: 0 <= v < 2**32, "from 0 to 2**32 - 1")
    if cfg.n_embd % cfg.n_head:
        raise UsageError(f"--n-embd {cfg.n_embd} must be a multiple of --n-head {cfg.n_head}")
    if cfg.wandb_run_name and not cfg.wandb_project:
        raise UsageError(f"--wandb-run-name {cfg.wandb_run_name} names a W&B run, but W&B is off; pass "
                         f"--wandb-project too")
    for key in benchmarks:
        if getattr(cfg, key) > 0 and cfg.vocab_size < GPT2_VOCAB:
            raise UsageError(f"{flag(key)} {getattr(cfg, key)} needs GPT-2's whole vocabulary, but --vocab-size is "
                             f"{cfg.vocab_size}; pass {flag(key)} 0")
    if cfg.loss == "chunked" and cfg.dtype == "fp16":  # its gradients exist before the loss is scaled
        raise UsageError("--loss chunked cannot run with --dtype fp16: it computes its gradients in fp16 before the "
                         "gradient scaler sees them, where they can underflow or overflow; use --dtype bf16 or fp32, "
                         "or --loss full")
    if cfg.grow_batch_size and not cfg.fit_batch_size:
        raise UsageError("--grow-batch-size searches for a larger micro-batch, and --no-fit-batch-size trains "
                         "--batch-size as given; drop one of them")
    if cfg.compile_mode != "default" and not cfg.compile:
        raise UsageError(f"--compile-mode {cfg.compile_mode} needs --compile (off by default without CUDA); pass "
                         f"--compile or drop it")
    tokens_per_pass = cfg.batch_size * cfg.seq_len * world_size
    if cfg.total_batch_size % tokens_per_pass and not cfg.eval_only:  # an evaluation takes no optimizer step
        raise UsageError(f"--total-batch-size {cfg.total_batch_size} is not a multiple of --batch-size x --seq-len x "
                         f"processes = {cfg.batch_size} x {cfg.seq_len} x {world_size} = {tokens_per_pass}; change "
                         f"one of them")


def check_recipe(cfg, given, recipes):
    """The recipe's own refusals of the settings resolved (check_config's passed), and the settings of another
    recipe, which this one would ignore."""
    recipes[cfg.recipe].check_settings(cfg, given)
    for other_recipe, recipe in recipes.items():
        other = [flag(name) for name in recipe.settings if name in given and other_recipe != cfg.recipe]
        if other:
            what = f"{other[0]} is a setting" if len(other) == 1 else f"{', '.join(other)} are settings"
            raise UsageError(f"{what} of --recipe {other_recipe} only, and this run is --recipe {cfg.recipe}; drop "
                             f"{'it' if len(other) == 1 else 'them'}, or pass --recipe {other_recipe}")
