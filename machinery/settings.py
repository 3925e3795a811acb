"""
Declaring a setting: a field of train_gpt2.py's TrainConfig (or of the Settings of a recipe or of the speed-ups, which
it inherits), its --help, and what other modules read of it (the model's, a path, a benchmark's, ...); the model's
settings as a class of their own (GPTConfig); what a recipe is made of (Recipe); and a flag and a value in words.

How the settings become a run's: resolution.py, with the presets (presets.py), the checks (checks.py) and where the
process runs (environment.py). This module imports none of them, so that any module may read a setting's words.
"""

import argparse
import dataclasses
import os
import re
from typing import Callable, NamedTuple, Optional

# -----------------------------------------------------------------------------
# Declaring settings: train_gpt2.py's TrainConfig, and a recipe's own (modern.py's Settings, which it inherits)


def setting(default, help, choices=None, model=False, memory=False, path=False, benchmark=None, full_loss=False):
    """A field of the settings: its default, its --help, its choices. model: the model's (GPTConfig has it, and
    checkpoints and exports carry it: a checkpoint or pretrained weights fix it, but for how it computes,
    COMPUTE_ONLY). memory: a speed-up that changes a step's memory, which an out-of-memory record names
    (microbatch.step_shape). path: a file or directory, which a flag may not give empty (checks.check_paths).
    benchmark: the name of the benchmark whose evaluations it spaces, which a run turns off unless given where it
    cannot run (without CUDA, too slow; with a vocabulary short of GPT-2's, which its text needs). full_loss: a
    speed-up that computes the full loss its own way, so that --loss auto is full where it is on."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "model": model,
                                                        "memory": memory, "path": path, "benchmark": benchmark,
                                                        "full_loss": full_loss})


def declared_with(config, key):
    """{setting: its metadata[key]} of config's settings declared with key (path, benchmark, full_loss), in order."""
    return {f.name: f.metadata[key] for f in dataclasses.fields(config) if f.metadata[key]}


COMPUTE_ONLY = ("attn", "loss")  # model settings of how the model computes, not what it is: a checkpoint fixes neither


def in_order(config_class):
    """Its settings in the order a reader meets them: its own, top to bottom, then those it inherits (a recipe's)."""
    own = config_class.__dict__.get("__annotations__", {})
    return sorted(dataclasses.fields(config_class), key=lambda f: f.name not in own)


def flag_parser(config_class, description, epilog):
    """An argparse parser with a flag for each of config_class's settings (n_layer -> --n-layer, a bool -> --x and
    --no-x), its help ending in its default; a flag not given is left out of what it parses, so that the names of the
    settings given are what it returns."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=epilog, argument_default=argparse.SUPPRESS)
    for f in in_order(config_class):
        help = f.metadata["help"] + ("" if f.default is None else f" (default: {f.default})")
        if f.type in (bool, Optional[bool]):
            parser.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, help=help)
        else:
            parser.add_argument(flag(f.name), type=int if f.type == Optional[int] else f.type,
                                choices=f.metadata["choices"], help=help)
    return parser


def model_config_class(config_class):
    """The model's settings (those marked model=True) as a frozen dataclass of their own, GPTConfig: what a model is
    built from and a checkpoint keeps (a checkpoint older than one of them means its default)."""
    model = [(f.name, f.type, dataclasses.field(default=f.default)) for f in in_order(config_class)
             if f.metadata["model"]]
    home = {"__module__": config_class.__module__}  # where it is defined, as for a class written there
    return dataclasses.make_dataclass("GPTConfig", model, frozen=True, namespace=home)


# -----------------------------------------------------------------------------
# Recipes


class Recipe(NamedTuple):
    """What a recipe is made of (train_gpt2.py's RECIPES: GPT-2's, and modern.py's RECIPE)."""
    model: type  # GPTConfig -> model; logits, loss = model(idx, targets)
    optimizers: Callable  # (model, cfg, fused) -> a list: a recipe may give each kind of parameter an optimizer
    get_lr: Callable  # (step, max_lr, cfg) -> the learning rate of a parameter group whose peak is max_lr
    presets: dict  # what it changes over train_gpt2.py's presets: {"fineweb": {...}, "shakespeare": {...}}
    settings: tuple  # the settings only it reads: refused with the other recipe
    check_settings: Callable  # (cfg, given) -> None, or raises UsageError for what it cannot honour
    hf_format: tuple  # hf_format.Format: the class of transformers its model is, and its files (--export-hf)
    from_pretrained: Callable  # (--init-from's name or directory, GPTConfig, cache_dir) -> its model, with its weights
    named: str  # its name on the run's model line, after the parameters: "" for GPT-2's, the default
    memory: tuple  # StepMemory: what its training step holds, for the memory model (step_memory.py)
    schedule: tuple = ()  # its own settings its get_lr reads, besides --max-steps, --warmup-steps, --min-lr-ratio

    def rate_flags(self):
        """The flags of its learning rates (its settings named *_lr): what to lower when a run diverges."""
        return [flag(name) for name in self.settings if name.endswith("_lr")]


class StepMemory(NamedTuple):
    """A recipe's figures for the memory model (step_memory.py): what its step keeps per parameter and per token.
    They are its model's and its optimizers', so they live with the recipe, counted or measured (docs/memory.md)."""
    optimizer_bytes: tuple  # the optimizers' state per parameter: (of a block, of the rest)
    # The bytes per token that the compiled bf16 step's forward pass keeps for its backward, as
    # benchmarks/memory.py's saved_per_token counts them (torch 2.13): in units of the width C, per layer and outside
    # the layers (the embedding's output, the final norm's input), and in units of the vocabulary V (the bf16 logits).
    # GPT-2's block keeps 36*C; Korthikanti et al. 2022 count 34*C with flash attention
    saved_per_token: tuple
    # The same of the eager fp32 step, a CPU's default: more than with bf16 autocast or compiled, so a bound for them
    saved_per_token_eager: tuple
    # {--loss: the logits' bytes per token, in units of V, at the eager fp32 step's peak}: those saved and the
    # backward's fp32 gradients beside them. Measured on a CPU as the address space's growth with freed memory given
    # back (docs/LOG.md, 2026-11-29); --loss chunked's chunk holds its logits, their exponentials and gradient at
    # once: a bound at any number of rows
    logits_peak_eager: dict
    ddp_logits_copies: int  # the bf16 logits the compiled DDP step holds: 2 where its loss keeps their gradient apart


# -----------------------------------------------------------------------------
# A setting in words: its flag, its value as typed, the command that resumes a run, the weights it starts from


def resume_command(cfg):
    """The command that resumes this run, in words: --no-resume or --resume PATH would start over, or go back."""
    return "the same command" if cfg.resume == "auto" else "the same command without --no-resume or --resume"


def flag(name):
    return "--" + name.replace("_", "-")


def shown(value):
    """A setting's value as it would be typed after its flag: quoted if it has to be."""
    return value if isinstance(value, str) and re.fullmatch(r"[\w./:+-]+", value) else repr(value)


def as_typed(key, value):
    """A setting as its flag is typed: --max-steps 50, --compile, --no-compile, --no-resume."""
    if isinstance(value, bool):
        return flag(key) if value else f"--no-{flag(key)[2:]}"
    return "--no-resume" if (key, value) == ("resume", "none") else f"{flag(key)} {shown(value)}"


def pretrained_in_words(init_from, shown=str):
    """--init-from's weights, in words: OpenAI's gpt2, or the weights in hf/run1 (an export directory, its path as
    shown gives it)."""
    if os.sep in init_from or os.path.isdir(init_from):
        return f"the weights in {shown(init_from)}"
    return f"OpenAI's {init_from}"
