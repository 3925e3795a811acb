"""
How the settings at the top of train_gpt2.py become a run's: the presets applied and named, the defaults that
depend on the data and the device filled in, then every check, each a one-line refusal that names the flag and what
to do. train_gpt2.py hands over its tables (the recipes, the model sizes, the presets): this module never imports it.

A preset changes the file's values for a kind of run (no FineWeb shards: tiny Shakespeare; --init-from: OpenAI's
shapes and a gentler rate; a recipe's own), but never a setting given as a flag, nor one the run's recipe does not
read, and never silently: the run's first lines name every setting whose value is not the file's (a preset's, the
device's, or one derived from the others), with the file's value it replaced.
"""

import dataclasses
import math
import os
import re
import socket
from typing import Callable, NamedTuple

import torch

from machinery import fsdp, hf_format, ranks, shard_files
from machinery.errors import UsageError
from machinery.tokenizer import GPT2_VOCAB

# -----------------------------------------------------------------------------
# Declaring settings: train_gpt2.py's TrainConfig, and a recipe's own (modern.py's Settings, which it inherits)


def setting(default, help, choices=None, model=False, memory=False):
    """A field of the settings: its default, its --help, its choices. model: the model's (GPTConfig has it, and
    checkpoints and exports carry it: a checkpoint or pretrained weights fix it, but for how it computes,
    COMPUTE_ONLY). memory: a speed-up that changes a step's memory, which an out-of-memory record names
    (microbatch.step_shape)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "model": model,
                                                        "memory": memory})


COMPUTE_ONLY = ("attn", "loss")  # model settings of how the model computes, not what it is: a checkpoint fixes neither


def in_order(config_class):
    """Its settings in the order a reader meets them: its own, top to bottom, then those it inherits (a recipe's)."""
    own = config_class.__dict__.get("__annotations__", {})
    return sorted(dataclasses.fields(config_class), key=lambda f: f.name not in own)


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
    named: str  # what the run's model line adds after the parameters: "" for GPT-2's, the default
    schedule: tuple = ()  # its own settings its get_lr reads, besides --max-steps, --warmup-steps, --min-lr-ratio

    def rate_flags(self):
        """The flags of its learning rates (its settings named *_lr): what to lower when a run diverges."""
        return [flag(name) for name in self.settings if name.endswith("_lr")]


def resume_command(cfg):
    """The command that resumes this run, in words: --no-resume or --resume PATH would start over, or go back."""
    return "the same command" if cfg.resume == "auto" else "the same command without --no-resume or --resume"


def flag(name):
    return "--" + name.replace("_", "-")


def shown(value):
    """A setting's value as it would be typed after its flag: quoted if it has to be."""
    return value if isinstance(value, str) and re.fullmatch(r"[\w./:+-]+", value) else repr(value)


def processes(environ=os.environ):
    """This process's rank, local rank and the number of processes, from torchrun's RANK, LOCAL_RANK and WORLD_SIZE
    (or one process where they are unset), refused in one line where no torchrun could have set them."""
    rank, local_rank, world_size = (whole_number_in(environ, name, default)
                                    for name, default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")))
    if rank >= world_size:
        raise UsageError(f"RANK={rank} in the environment is not below WORLD_SIZE={world_size}; unset both to run one "
                         f"process, or start the run with torchrun")
    if world_size > 1:
        check_meeting_place(environ, world_size)
    return rank, local_rank, world_size


def whole_number_in(environ, name, default):
    """The environment variable's value as torchrun writes a number, in the digits 0-9 alone: str.isdigit also takes
    "²", and int() " 1", "+1" and "1_0"."""
    value = environ.get(name, default)
    if not (value.isascii() and value.isdigit()):
        raise UsageError(f"{name}={value!r} in the environment is not a whole number; torchrun sets it for each "
                         f"process it starts: unset it to run one process")
    return int(value)


def check_meeting_place(environ, world_size):
    """Refuses, in one line, a MASTER_ADDR and MASTER_PORT where the processes cannot meet: unset, a port that is no
    number (a ValueError in torch's rendezvous), or an address this machine cannot resolve (which c10d would retry for
    the process group's hour, its warnings the only word)."""
    address, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if not (address and port):
        raise UsageError(f"WORLD_SIZE={world_size} says this is one of {world_size} processes, but MASTER_ADDR and "
                         f"MASTER_PORT, where they meet, are not set; start them with torchrun (torchrun --standalone "
                         f"--nproc_per_node={world_size} train_gpt2.py), or unset WORLD_SIZE to run one process")
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 2**16):
        raise UsageError(f"MASTER_PORT={port!r} in the environment is not a port number (1 to 65535); start the run "
                         f"with torchrun, which sets it (--master_port), or unset WORLD_SIZE to run one process")
    try:
        socket.getaddrinfo(address, int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:  # UnicodeError: a name that IDNA cannot encode
        reason = e.strerror if isinstance(e, OSError) else e
        raise UsageError(f"MASTER_ADDR={address!r} in the environment is no address this machine can resolve "
                         f"({reason}); set it to rank 0's host name or IP address (torchrun's --master_addr), or unset "
                         f"WORLD_SIZE to run one process") from None


def check_device(device, local_rank, world_size, fsdp):
    """Refuses a device that PyTorch does not see here, or that cannot hold this process or its process group."""
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but PyTorch sees no CUDA GPU; install a CUDA build of torch or use "
                         "--device cpu")
    if device == "cuda" and local_rank >= torch.cuda.device_count():
        raise UsageError(f"process LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPU(s) are visible "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); lower "
                         f"torchrun's --nproc_per_node")
    if device == "mps" and not torch.backends.mps.is_available():
        raise UsageError("--device mps, but this machine has no Apple GPU available to PyTorch; use --device cpu")
    if device == "mps" and (world_size > 1 or fsdp):
        raise UsageError("several processes need CUDA or the CPU; run one process on mps" if world_size > 1 else
                         "--fsdp needs CUDA or the CPU (its collectives have no mps backend); drop --fsdp")


def resolve_dtype(dtype, device_type):
    if dtype == "auto":
        if device_type != "cuda":
            return "fp32"
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"  # V100 and T4 lack bf16
    if dtype == "bf16" and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UsageError("--dtype bf16: this GPU has no bf16; use --dtype fp16")
    return dtype


# -----------------------------------------------------------------------------
# Presets

TOP = "at the top of train_gpt2.py"  # where its presets are, below the settings


def defined_in(recipe):
    """The file a recipe is written in (its model's): where its PRESETS are."""
    return os.path.basename(recipe.model.__init__.__code__.co_filename)


def presets_for(draft, shards_found, recipes, model_sizes, presets):
    """The run's recipe, its presets in the order they apply, [(name and where it is, {setting: value})], and what
    --init-from's weights fix, (name, {setting: value}) or None. presets: train_gpt2.py's named tables SHAKESPEARE,
    SHAKESPEARE_FINETUNE and OPENAI_SHAPES. The weights fix the recipe and the shapes, whatever a preset says; a flag
    that says otherwise is refused."""
    pretrained = pretrained_preset(draft, recipes, model_sizes, presets)
    recipe_name = pretrained[1].get("recipe", draft.recipe) if pretrained else draft.recipe
    recipe, where = recipes[recipe_name].presets, f"in {defined_in(recipes[recipe_name])}"
    chosen = []
    if small_model(draft, shards_found):  # on tiny Shakespeare, or with --preset shakespeare on the shards found
        shakespeare = {key: value for key, value in presets["SHAKESPEARE"].items() if key != "data" or not shards_found}
        asked = "--preset shakespeare, " if draft.preset == "shakespeare" else ""
        chosen.append((f"SHAKESPEARE ({asked}{TOP})", shakespeare))
        if pretrained:
            chosen.append((f"SHAKESPEARE_FINETUNE ({TOP})", presets["SHAKESPEARE_FINETUNE"]))
        if "shakespeare" in recipe:
            chosen.append((f"--recipe {recipe_name}'s PRESETS['shakespeare'] ({where})", recipe["shakespeare"]))
        if pretrained and "shakespeare_finetune" in recipe:
            chosen.append((f"--recipe {recipe_name}'s PRESETS['shakespeare_finetune'] ({where})",
                           recipe["shakespeare_finetune"]))
    elif "fineweb" in recipe:
        chosen.append((f"--recipe {recipe_name}'s PRESETS['fineweb'] ({where})", recipe["fineweb"]))
    if pretrained is None:
        return recipe_name, chosen, None
    fixed = {key: value for key, value in pretrained[1].items() if key not in not_read_by(recipe_name, recipes)}
    check_fixed(draft, fixed, model_sizes)
    return recipe_name, chosen, (pretrained[0], fixed)


def small_model(draft, shards_found):
    """Whether the run takes the quick start's presets: --preset shakespeare, or no shards in --data."""
    return draft.preset == "shakespeare" or not shards_found


def check_fixed(draft, fixed, model_sizes):
    """Refuses the flags that say otherwise than --init-from's weights fix (fixed), naming both."""
    sizes, given = model_sizes[draft.model], draft.given
    if "model" in given and any(fixed[key] != value for key, value in sizes.items()):  # a name for three flags
        fixes, says = (", ".join(f"{flag(k)} {v[k]}" for k in sizes) for v in (fixed, sizes))
        raise UsageError(f"--init-from {draft.init_from} fixes {fixes}, and --model {draft.model} says {says}; drop "
                         f"--model")
    clash = [key for key, value in fixed.items() if key in given and key != "model" and getattr(draft, key) != value]
    if clash:
        fixes = ", ".join(f"{flag(k)} {shown(fixed[k])}{padded_in_words(draft.init_from, k, fixed[k])}" for k in clash)
        says = ", ".join(f"{flag(k)} {shown(getattr(draft, k))}" for k in clash)
        raise UsageError(f"--init-from {draft.init_from} fixes {fixes}, and the flags say {says}; drop "
                         f"{'it' if len(clash) == 1 else 'them'}")


def padded_in_words(init_from, key, value):
    """Why --init-from's weights fix a --vocab-size above GPT-2's, in words ("" for any other setting)."""
    if key != "vocab_size" or value <= GPT2_VOCAB:
        return ""
    whose = "its config.json's" if os.path.isdir(init_from) else "OpenAI's"
    return f" ({whose} {GPT2_VOCAB} tokens, padded with rows that are never predicted: such matmuls run faster)"


def not_read_by(recipe, recipes):
    """The settings the recipe does not read: the other recipes' own."""
    return {name for other, settings in recipes.items() if other != recipe for name in settings.settings}


def pretrained_preset(cfg, recipes, model_sizes, presets):
    """The model settings that --init-from's weights fix, as (the preset's name, {setting: value}), or None from
    scratch. They are every model setting but how the model computes. For OpenAI's weights (--init-from gpt2) they
    are its sizes and OPENAI_SHAPES. For an export directory (a directory of that name wins, as a clone of the Hub's
    gpt2 is one) they are its config.json's recipe and shapes, with the vocabulary padded as OpenAI's is and
    OPENAI_SHAPES for what config.json does not say."""
    if cfg.init_from == "scratch":
        return None
    if not os.path.isdir(cfg.init_from):
        shapes = dict(model_sizes[cfg.init_from], **presets["OPENAI_SHAPES"], model=cfg.init_from)
        return f"--init-from {cfg.init_from} (OpenAI's shapes, OPENAI_SHAPES {TOP})", shapes
    fixed = export_settings(cfg.init_from, recipes)
    fixed.update({key: value for key, value in presets["OPENAI_SHAPES"].items() if key not in fixed})
    if fixed["vocab_size"] == GPT2_VOCAB:
        fixed["vocab_size"] = presets["OPENAI_SHAPES"]["vocab_size"]
    return f"--init-from {cfg.init_from} (its config.json's recipe and shapes)", fixed


def export_settings(directory, recipes):
    """The model settings of an export directory (--init-from DIR: ours, or one of that format from the Hub): the
    recipe whose hf_format is the class its config.json names, and the shapes that says."""
    for name in ("config.json", "model.safetensors"):
        if not os.path.isfile(os.path.join(directory, name)):
            raise UsageError(f"--init-from {directory}: it holds no {name}; pass a directory that --export-hf wrote, "
                             f"or one of that format (config.json and model.safetensors, not sharded)")
    config, path = hf_format.read_config(directory, "a model of train_gpt2.py's recipes")
    recipe = {recipe.hf_format.model_type: name for name, recipe in recipes.items()}.get(config.get("model_type"))
    if recipe is None:
        known = ", ".join(f"{r.hf_format.model_type} (--recipe {name})" for name, r in recipes.items())
        raise UsageError(f"{path}: model_type {config.get('model_type')!r}, a model no recipe of train_gpt2.py "
                         f"computes; it loads {known}")
    return dict(recipe=recipe, **recipes[recipe].hf_format.model_settings(config, path))


def pretrained_in_words(init_from, shown=str):
    """--init-from's weights, in words: OpenAI's gpt2, or the weights in hf/run1 (an export directory, its path as
    shown gives it)."""
    if os.sep in init_from or os.path.isdir(init_from):
        return f"the weights in {shown(init_from)}"
    return f"OpenAI's {init_from}"


def presets_help(presets, recipes):
    """What each preset changes, for --help: the tables themselves, as flags."""
    def as_flags(preset, indent="    "):
        lines = [indent]
        for key, value in preset.items():
            if len(lines[-1]) + len(flag(key)) + len(shown(value)) + 2 > 118:
                lines.append(indent)
            lines[-1] += f" {flag(key)} {shown(value)}"
        return lines

    lines = ["presets: what a kind of run changes in the defaults above. A flag overrides any preset, and a run's "
             "first", "lines name every setting a preset changed, with its default.",
             "  SHAKESPEARE, when --data (not given) does not exist (python train_gpt2.py with no FineWeb shards), and",
             "  all of it but --data with --preset shakespeare, on any --data",
             *as_flags(presets["SHAKESPEARE"]),
             "  SHAKESPEARE_FINETUNE, over it with --init-from (fine-tuning OpenAI's GPT-2 on tiny Shakespeare)",
             *as_flags(presets["SHAKESPEARE_FINETUNE"]),
             "  OPENAI_SHAPES, with --init-from NAME on any data: NAME's --n-layer, --n-head and --n-embd, and",
             *as_flags({key: value for key, value in presets["OPENAI_SHAPES"].items()
                        if key not in not_read_by("gpt2", recipes)})]
    for name, recipe in recipes.items():
        for key, when in (("fineweb", "with FineWeb shards"), ("shakespeare", "over SHAKESPEARE")):
            if key in recipe.presets:
                lines += [f"  --recipe {name}'s PRESETS['{key}'] (in {defined_in(recipe)}), {when}",
                          *as_flags(recipe.presets[key])]
    return "\n".join(lines)


class Change(NamedTuple):
    """A setting's value, what made it (a preset, the device, the checkpoint, ...), and whether the run's first lines
    name it (a checkpoint's own value, or what a file's 0 stands for, is no news)."""
    value: object
    why: str
    said: bool


class Named(NamedTuple):
    """A change the run's first lines name: what made it, the setting, its default in words (the file's value, or
    what it stands for), its value."""
    why: str
    key: str
    default: str
    value: object


class Draft:
    """The settings while they are decided: the flags' config (the file's defaults and the flags given), and each
    change made to it since, with what made it. Only set changes a setting; done() makes the run's config."""

    def __init__(self, flags, given):
        self.flags, self.given, self.changes = flags, set(given), {}
        self.meanings = {}  # {setting: (value, in words)} where the file's value stands for another (stand_in)
        self.notes = []  # lines to say before the changes: why a preset applies
        self.shards_found = True  # whether --data is there, or tiny Shakespeare trains instead
        self.fixed_by = None  # the preset of what --init-from's weights fix, which no flag overrides

    def __getattr__(self, key):  # a setting's value so far
        if "flags" not in self.__dict__:  # not set yet (a copy being made)
            raise AttributeError(key)
        if key in self.changes:
            return self.changes[key].value
        return getattr(self.flags, key)

    def set(self, key, value, why, said=True):
        """Sets key to value, for the reason why; setting the value it already has changes nothing, its reason
        included."""
        if getattr(self, key) != value:
            self.changes.pop(key, None)  # the lines list the settings in the order they were last changed
            self.changes[key] = Change(value, why, said)

    def stand_in(self, key, value, words):
        """The file's value of key (0, None, "auto") stands for value, whose it is in words ("--model gpt2's 12"): set
        it if no layer changed it, and the lines name it as key's default."""
        self.meanings[key] = value, words
        if getattr(self, key) == getattr(self.flags, key):
            self.set(key, value, words, said=False)

    def source(self, key):
        """Where the setting's value comes from, in words."""
        if key in self.changes:
            return self.changes[key].why
        return f"{flag(key)} given" if key in self.given else "the file's default"

    def named(self):
        """The changes to say, from the flags' values (or what they stand for), as Named."""
        named = []
        for key, change in self.changes.items():
            default, words = self.meanings.get(key, (getattr(self.flags, key), shown(getattr(self.flags, key))))
            if change.said and change.value != default:
                named.append(Named(change.why, key, words, change.value))
        return named

    def done(self):
        return dataclasses.replace(self.flags, **{key: change.value for key, change in self.changes.items()})


def apply_presets(draft, chosen, fixed, model_sizes, unread):
    """Sets each preset's settings but those given as flags (with --model, its sizes too) and those the run's recipe
    does not read (unread: another recipe's, which it refuses as flags), the later presets over the earlier; then what
    --init-from's weights fix (fixed: a flag that says otherwise was refused)."""
    keep = draft.given | (set(model_sizes[draft.model]) if "model" in draft.given else set())
    final = {key: (name, value) for name, preset in chosen for key, value in preset.items()
             if key not in unread and key not in keep}
    if fixed is not None:
        final.update({key: (fixed[0], value) for key, value in fixed[1].items()})
    for key, (name, value) in final.items():
        draft.set(key, value, f"preset {name}")


def in_lines(head, items, separator, width=120):
    """head, then the items with separator between them, in lines of at most width, an item never split."""
    lines, started = [head], False  # an item longer than a line stays beside the head, not below it alone
    for i, item in enumerate(items):
        if started and len(lines[-1]) + len(item) + len(separator) + 1 > width:
            lines.append("   ")
        started = True
        lines[-1] += f" {item}{separator if i < len(items) - 1 else ''}"
    return lines


def say_changes(changes, fixed):
    """The lines that name each change (Named) under what made it; fixed: whether --init-from's weights fix some,
    which no flag overrides."""
    lines = []
    for why in dict.fromkeys(change.why for change in changes):
        lines += in_lines(f"{why} sets:", [f"{flag(change.key)} {shown(change.value)} (default: {change.default})"
                                           for change in changes if change.why == why], ",")
    if lines:
        lines.append(f"    (a flag overrides any of these{' but what --init-from fixes' if fixed else ''})")
    return lines


def as_typed(key, value):
    """A setting as its flag is typed: --max-steps 50, --compile, --no-compile, --no-resume."""
    if isinstance(value, bool):
        return flag(key) if value else f"--no-{flag(key)[2:]}"
    return "--no-resume" if (key, value) == ("resume", "none") else f"{flag(key)} {shown(value)}"


def say_given(draft):
    """The line (or lines) that name the flags given, as they would be typed: the settings the other lines leave out."""
    flags = draft.flags
    given = [as_typed(f.name, getattr(flags, f.name)) for f in in_order(type(flags)) if f.name in draft.given]
    return in_lines("flags given:", given, "") if given else []


# -----------------------------------------------------------------------------
# Checks


def require(cfg, names, ok, what):
    for name in names:
        if not ok(getattr(cfg, name)):  # written so that NaN fails too
            raise UsageError(f"{flag(name)} must be {what}, not {getattr(cfg, name)}")


PATH_SETTINGS = ("data", "log_dir", "hellaswag_file", "core_data", "cache_dir", "sample", "export_hf", "resume",
                 "init_from")
BENCHMARKS = {"hellaswag_every": "HellaSwag", "core_every": "CORE"}  # their text needs every GPT-2 token


def check_paths(cfg, given, model_sizes):
    """Refuses a path flag given an empty value, as an unset shell variable gives: to some, an empty path means "off"
    or "the default" (--export-hf "" trained instead, resuming the run in --log-dir or moving its files aside); and an
    --init-from that is no OpenAI model (model_sizes) nor a directory, before any command downloads it."""
    for name in PATH_SETTINGS:
        if name in given and getattr(cfg, name) == "":
            raise UsageError(f"{flag(name)} is empty; pass a path (an unset shell variable?), or drop the flag")
    if cfg.init_from not in ("scratch", *model_sizes) and not os.path.isdir(cfg.init_from):
        raise UsageError(f"--init-from {cfg.init_from}: no such directory, nor an OpenAI model name; pass scratch, one "
                         f"of {', '.join(model_sizes)}, or a directory that --export-hf wrote")


def check_config(cfg, world_size):
    require(cfg, [name for name, value in vars(cfg).items() if isinstance(value, float)], math.isfinite,
            "a finite number")  # --max-lr inf trained with lr nan, --logit-softcap inf gave NaN at every step
    require(cfg, ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "batch_size", "seq_len",
                  "total_batch_size", "val_tokens", "keep_checkpoints", "max_bad_steps", "grad_clip"),
            lambda v: v > 0, "positive")
    require(cfg, ("max_steps", "warmup_steps", "eval_every", *BENCHMARKS, "core_max_per_task", "checkpoint_every",
                  "num_samples", "max_new_tokens", "weight_decay"), lambda v: v >= 0, "zero or more")
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
    for key in BENCHMARKS:
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


def fit_warmup(draft, resumed):
    """A run no longer than its warmup never reaches its peak learning rate, nor decays: a preset's warmup (715 steps
    for FineWeb) is cut to a tenth of a shorter run, and a --warmup-steps given that long is warned about. A resumed
    run (resumed: its checkpoint's settings) keeps its own warmup, not the file's again: raising --max-steps would put
    its rate back into a warmup; its new schedule is said once restored (resume.say_schedule_change). Returns the
    lines to say."""
    if resumed is not None and "warmup_steps" not in draft.given:
        draft.set("warmup_steps", resumed["warmup_steps"], "the checkpoint", said=False)
    if draft.max_steps == 0 or draft.warmup_steps < draft.max_steps:
        return []
    if "warmup_steps" in draft.given:
        return [f"warning: --warmup-steps {draft.warmup_steps} is not shorter than --max-steps {draft.max_steps}: the "
                f"learning rate rises for the whole run and never decays"]
    warmup = draft.max_steps // 10
    instead = (f"warming up for {warmup} step{'' if warmup == 1 else 's'} instead, a tenth of the run" if warmup else
               "no warmup instead, as a tenth of the run is under a step")
    line = (f"--max-steps {draft.max_steps} is no longer than the {draft.warmup_steps} warmup steps: {instead} "
            f"(--warmup-steps sets it)")
    draft.set("warmup_steps", warmup, "the warmup fitted to the run", said=False)
    return [line] if resumed is None else []


def take_model_settings(draft, train_config, model_config, path):
    """--eval-only evaluates a checkpoint's model as it was trained: its recipe and shapes (model_config), not those
    the flags and presets say, as --sample does, on sequences of its length, and its steps stand for the tokens of
    its batch (train_config). A flag given that says otherwise is refused."""
    taken = {k: v for k, v in model_config.items() if k not in COMPUTE_ONLY}
    clash = [f"{k}: checkpoint {v}, flags {getattr(draft, k)}" for k, v in taken.items()
             if k in draft.given and getattr(draft, k) != v]
    if clash:
        raise UsageError(f"--eval-only evaluates {path} as it was trained, and flags say otherwise "
                         f"({'; '.join(clash)}); drop them")
    taken["total_batch_size"] = train_config["total_batch_size"]
    if "seq_len" not in draft.given:
        taken["seq_len"] = train_config["seq_len"]
    for key, value in taken.items():
        draft.set(key, value, f"the checkpoint {path}", said=False)
    for key in BENCHMARKS:
        if getattr(draft, key) > 0 and draft.vocab_size < GPT2_VOCAB:
            if key in draft.given:
                raise UsageError(f"{flag(key)} needs GPT-2's whole vocabulary, and {path} has {draft.vocab_size} "
                                 f"tokens; drop it")
            draft.set(key, 0, f"the checkpoint {path}", said=False)


def fit_seq_len(draft):
    """A --seq-len no flag gave that is longer than the model's block (a preset's, say, for an export with fewer
    positions) is cut to the block, and said; one given is refused, naming where the block's size comes from."""
    if draft.seq_len <= draft.block_size:
        return
    block = f"{draft.block_size} tokens (--block-size {draft.block_size}, from {draft.source('block_size')})"
    if "seq_len" in draft.given:
        raise UsageError(f"--seq-len {draft.seq_len} is longer than the model's block of {block}; pass --seq-len "
                         f"{draft.block_size} or less")
    draft.set("seq_len", draft.block_size, f"the model's block of {block}")


def training_only(cfg, recipes):
    """The settings that only training reads (--eval-only's first lines leave them out): the batch, the schedule, the
    checkpoints, and each recipe's own that are not the model's (its learning rates)."""
    model = {f.name for f in dataclasses.fields(cfg) if f.metadata["model"]}
    rates = {name for recipe in recipes.values() for name in recipe.settings} - model
    return rates | {"total_batch_size", "max_steps", "warmup_steps", "min_lr_ratio", "grad_clip", "eval_every",
                    "checkpoint_every", "keep_checkpoints", "max_bad_steps"}


# -----------------------------------------------------------------------------
# The settings resolved: the layers in the order they apply, then every check


def layered(flags, given, env, recipes, model_sizes, presets):
    """The settings as the layers before the checkpoint's make them, in the order they apply: the file's defaults and
    the flags given (flags), the presets (which the data decides), the model preset, the device. A Draft: it says
    where the run's log directory and checkpoint are, and resolve finishes it."""
    if flags.eval_only and flags.resume == "none":
        raise UsageError("--eval-only evaluates a checkpoint (the latest in --log-dir, or --resume PATH's) or OpenAI's "
                         "weights (--init-from), and --no-resume asks for none; drop --no-resume")
    draft = Draft(flags, given)
    draft.shards_found = look_for_shards(draft)
    recipe, chosen, fixed = presets_for(draft, draft.shards_found, recipes, model_sizes, presets)  # the weights' recipe
    apply_presets(draft, chosen, fixed, model_sizes, not_read_by(recipe, recipes))
    draft.fixed_by = fixed and fixed[0]
    apply_model_preset(draft, model_sizes)
    apply_device(draft, env)
    return draft


def look_for_shards(draft):
    """Whether --data is there to train on; if not, the note that says why tiny Shakespeare is, and what to do."""
    flags = draft.flags
    # the default --data holding only what a stopped `python fineweb.py` left is as good as missing
    leftovers = None if "data" in draft.given else shard_files.unfinished_preparation(flags.data)
    if "data" in draft.given or (os.path.exists(flags.data) and leftovers is None):
        return True
    doing = ("evaluating" if flags.eval_only else "training a small model" if flags.init_from == "scratch"
             else f"fine-tuning {pretrained_in_words(flags.init_from)}")
    advice = "make them with `python fineweb.py`"
    if leftovers:
        advice = (f"only {', '.join(leftovers)}, left by an unfinished `python fineweb.py`: rerun it to finish "
                  f"them, or delete {flags.data}/")
    elif leftovers == []:
        advice = f"it is empty: {advice}, or delete {flags.data}/"
    draft.notes.append(f"no FineWeb shards in {flags.data}/ ({advice}): {doing} on tiny Shakespeare instead")
    return False


def apply_model_preset(draft, model_sizes):
    """--model's sizes, for the file's sizes of 0, which stand for them; and, given as a flag, over the file's edited
    sizes too (but not over the size flags)."""
    for key, value in model_sizes[draft.model].items():
        if getattr(draft.flags, key) == 0:
            draft.stand_in(key, value, f"--model {draft.model}'s {value}")
        elif "model" in draft.given and key not in draft.given:
            draft.set(key, value, f"--model {draft.model}")


def apply_device(draft, env):
    """What the device decides: compiling, growing the micro-batch and the chunked loss (on CUDA, where a GPU measured
    them faster or leaner), the precision, and no benchmarks where they are too slow."""
    cuda = env.device_type == "cuda"
    if draft.flags.compile is None:
        draft.stand_in("compile", cuda, f"{env.device_type}'s {cuda}")
    if draft.flags.grow_batch_size is None:  # the search that goes up is part of the one that fits
        draft.stand_in("grow_batch_size", cuda and draft.fit_batch_size, f"{env.device_type}'s {cuda}")
    dtype = resolve_dtype(draft.dtype, env.device_type)
    if draft.flags.dtype == "auto":
        draft.stand_in("dtype", dtype, f"{env.device_type}'s {dtype}")
    if draft.flags.loss == "auto":  # fp16 scales the loss after the chunks' gradients exist; --fp8-head is the full one
        loss = "chunked" if cuda and draft.dtype != "fp16" and not draft.fp8_head else "full"
        draft.stand_in("loss", loss, f"{env.device_type}'s {loss}")
    off = [key for key in BENCHMARKS if key not in draft.given and getattr(draft, key) != 0]
    if off and (env.device_type != "cuda" or draft.vocab_size < GPT2_VOCAB):
        why = (f"on {env.device_type} (too slow without CUDA)" if env.device_type != "cuda" else
               f"with --vocab-size {draft.vocab_size} (their text needs every GPT-2 token)")
        for key in off:
            draft.set(key, 0, f"no {' or '.join(BENCHMARKS[key] for key in off)} {why}")


def resolve(draft, env, recipes, checks, resumed=None):
    """The run's settings, frozen: draft's layers (layered), then what the checkpoint resumed keeps (resumed: its
    train_config, model_config and path; None for a new run), then the values fitted to the others, then every
    check. Also the lines for rank 0 to print first: what made each value that is not the file's. It prints and
    writes nothing. checks: the refusals of the modules that import this one (fsdp.py's, speedups.py's, run_log.py's),
    each check(cfg, env), so that a setting that cannot run here is refused before anything is read or downloaded; one
    may return a line to say too (fsdp.py's mesh). Each rank resolves its own, from what its node has (its files,
    devices and processes): all of them compare theirs before any collective reads them, and where they differ, every
    rank ends with one line that says how (decided_apart), not waiting for the others in collectives of its own."""
    with ranks.failing_together(decided=lambda: decided(draft), apart=decided_apart):
        cfg, lines = resolved_here(draft, env, recipes, checks, resumed)
    return cfg, lines


def resolved_here(draft, env, recipes, checks, resumed):
    """resolve's settings and lines, as this rank decides them."""
    if draft.eval_only and resumed is not None:  # the model as it was trained, whatever the flags' recipe
        take_model_settings(draft, *resumed)
    apply_processes(draft, env)
    fit_seq_len(draft)
    if small_model(draft, draft.shards_found) and not (draft.eval_only or "batch_size" in draft.given) \
            and draft.seq_len > 0:
        draft.set("batch_size", max(1, draft.total_batch_size // (draft.seq_len * env.world_size)),
                  "one micro-batch a step of the small model (--total-batch-size / --seq-len / processes)")
    later = [] if draft.eval_only else fit_warmup(draft, None if resumed is None else resumed[0])
    unread = training_only(draft.flags, recipes) if draft.eval_only else ()
    changes = [change for change in draft.named() if change.key not in unread]
    lines = draft.notes + say_changes(changes, draft.fixed_by is not None) + later
    cfg = draft.done()
    check_config(cfg, env.world_size)
    check_recipe(cfg, draft.given, recipes)  # once the shapes are whole: --model's, --init-from's, the checkpoint's
    lines += [line for line in (check(cfg, env) for check in checks) if line] + say_given(draft)
    return cfg, lines


def apply_processes(draft, env):
    """What the processes decide: --fsdp's shard group where --fsdp-shards is not given (fsdp.default_shards: a
    node's processes, or all of them where a node has one). Each rank sees only its own node's, so it is applied
    inside resolve, whose ranks then compare what they decided."""
    if draft.fsdp and draft.flags.fsdp_shards is None:
        draft.stand_in("fsdp_shards", *fsdp.default_shards(env.world_size))


def decided(draft):
    """What this rank decided of every setting: {setting: (its value in words, what made it)}."""
    return {field.name: (str(shown(getattr(draft, field.name))), draft.source(field.name))
            for field in dataclasses.fields(draft.flags)}


def decided_apart(every_rank):
    """The line that names the settings the ranks decided apart (every_rank: each one's decided), each rank's value
    and what made it, and what to do; None where they agree."""
    apart = [key for key in every_rank[0] if len({mine[key][0] for mine in every_rank}) > 1]
    if not apart:
        return None
    said = []
    for key in apart[:3]:
        holders = {}
        for rank, mine in enumerate(every_rank):
            holders.setdefault(mine[key], []).append(rank)
        said.append(f"{flag(key)} " + ", ".join(f"{value} on {ranks.in_words(which)} ({why})"
                                                for (value, why), which in holders.items()))
    more = f" (and {len(apart) - 3} more)" if len(apart) > 3 else ""
    return (f"the ranks decided their settings apart, each from what its own node has (its files, devices and "
            f"processes): {'; '.join(said)}{more}; pass {', '.join(flag(key) for key in apart[:3])} with one value "
            f"on every node, or start every node alike (the same --nproc_per_node, GPUs and --data)")
