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
from typing import Callable, NamedTuple

import torch

import hf_export
import plumbing
import run_files
from plumbing import GPT2_VOCAB, UsageError

# -----------------------------------------------------------------------------
# Declaring settings: train_gpt2.py's TrainConfig, and a recipe's own (modern.py's Settings, which it inherits)


def setting(default, help, choices=None, model=False):
    """A field of the settings: its default, its --help, its choices. model: the model's (GPTConfig has it, and
    checkpoints and exports carry it: a checkpoint or pretrained weights fix it, but for how it computes,
    COMPUTE_ONLY)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "model": model})


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
    hf_format: tuple  # hf_export.Format: the class of transformers its model is, and its files (--export-hf)
    from_pretrained: Callable  # (--init-from's name or directory, GPTConfig, cache_dir) -> its model, with its weights
    named: str  # what the run's model line adds after the parameters: "" for GPT-2's, the default

    def rate_flags(self):
        """The flags of its learning rates (its settings named *_lr): what to lower when a run diverges."""
        return [flag(name) for name in self.settings if name.endswith("_lr")]


def flag(name):
    return "--" + name.replace("_", "-")


def shown(value):
    """A setting's value as it would be typed after its flag: quoted if it has to be."""
    return value if isinstance(value, str) and re.fullmatch(r"[\w./:+-]+", value) else repr(value)


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


def presets_for(cfg, given, shards_found, recipes, model_sizes, presets):
    """The run's recipe, and its presets in the order they apply: [(name and where it is, {setting: value})]. presets:
    train_gpt2.py's named tables SHAKESPEARE, SHAKESPEARE_FINETUNE and OPENAI_SHAPES. --init-from's weights fix the
    recipe and the shapes, whatever a preset said; a flag that says otherwise is refused."""
    pretrained = pretrained_preset(cfg, recipes, model_sizes, presets)
    recipe_name = pretrained[1].get("recipe", cfg.recipe) if pretrained else cfg.recipe
    recipe, where = recipes[recipe_name].presets, f"in {defined_in(recipes[recipe_name])}"
    chosen = []
    if not shards_found:
        chosen.append((f"SHAKESPEARE ({TOP})", presets["SHAKESPEARE"]))
        if pretrained:
            chosen.append((f"SHAKESPEARE_FINETUNE ({TOP})", presets["SHAKESPEARE_FINETUNE"]))
        if "shakespeare" in recipe:
            chosen.append((f"--recipe {recipe_name}'s PRESETS['shakespeare'] ({where})", recipe["shakespeare"]))
    elif "fineweb" in recipe:
        chosen.append((f"--recipe {recipe_name}'s PRESETS['fineweb'] ({where})", recipe["fineweb"]))
    if pretrained:
        fixed = {key: value for key, value in pretrained[1].items() if key not in not_read_by(recipe_name, recipes)}
        sizes = model_sizes[cfg.model]
        if "model" in given and any(fixed[key] != value for key, value in sizes.items()):  # a name for three flags
            fixes, says = (", ".join(f"{flag(k)} {v[k]}" for k in sizes) for v in (fixed, sizes))
            raise UsageError(f"--init-from {cfg.init_from} fixes {fixes}, and --model {cfg.model} says {says}; drop "
                             f"--model")
        clash = [key for key, value in fixed.items() if key in given and key != "model" and getattr(cfg, key) != value]
        if clash:
            fixes = ", ".join(f"{flag(k)} {shown(fixed[k])}" for k in clash)
            says = ", ".join(f"{flag(k)} {shown(getattr(cfg, k))}" for k in clash)
            raise UsageError(f"--init-from {cfg.init_from} fixes {fixes}, and the flags say {says}; drop "
                             f"{'it' if len(clash) == 1 else 'them'}")
        chosen.append((pretrained[0], fixed))
    return recipe_name, chosen


def not_read_by(recipe, recipes):
    """The settings the recipe does not read: the other recipes' own."""
    return {name for other, settings in recipes.items() if other != recipe for name in settings.settings}


def pretrained_preset(cfg, recipes, model_sizes, presets):
    """What --init-from's weights fix, (the preset's name, {setting: value}): every model setting but how it computes;
    None from scratch. OpenAI's GPT-2 `name`: model_sizes[name] and OPENAI_SHAPES (GPT-2's model settings at their
    defaults). An export directory (a directory of that name first, as GPT.from_pretrained and --export-hf take it: a
    clone of the Hub's gpt2 is one): its recipe and shapes (export_settings), GPT-2's whole vocabulary padded as
    OpenAI's is, and OPENAI_SHAPES' defaults for the model settings its config.json does not hold."""
    if cfg.init_from == "scratch":
        return None
    if not os.path.isdir(cfg.init_from):
        shapes = dict(model_sizes[cfg.init_from], **presets["OPENAI_SHAPES"], model=cfg.init_from)
        return f"--init-from {cfg.init_from} (OpenAI's shapes, OPENAI_SHAPES {TOP})", shapes
    fixed = export_settings(cfg.init_from, recipes)
    fixed.update({key: value for key, value in presets["OPENAI_SHAPES"].items() if key not in fixed})
    if fixed["vocab_size"] == GPT2_VOCAB:
        fixed["vocab_size"] = presets["OPENAI_SHAPES"]["vocab_size"]
    return f"--init-from {cfg.init_from} (its recipe and shapes)", fixed


def export_settings(directory, recipes):
    """The model settings of an export directory (--init-from DIR: ours, or one of that format from the Hub): the
    recipe whose hf_format is the class its config.json names, and the shapes that says."""
    for name in ("config.json", "model.safetensors"):
        if not os.path.isfile(os.path.join(directory, name)):
            raise UsageError(f"--init-from {directory}: it holds no {name}; pass a directory that --export-hf wrote, "
                             f"or one of that format (config.json and model.safetensors, not sharded)")
    config, path = hf_export.read_config(directory, "a model of train_gpt2.py's recipes")
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
             "  SHAKESPEARE, when --data (not given) does not exist: python train_gpt2.py with no FineWeb shards",
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


class Draft:
    """The settings while resolve decides them: the flags' config, and each change made to it since (by a preset, the
    device, the checkpoint resumed), with what made it. Only set changes a setting; done() makes the run's config."""

    def __init__(self, flags):
        self.flags, self.changes = flags, {}  # {setting: (what made it, or None for no line of its own; value)}

    def __getattr__(self, key):  # a setting's value so far
        if key in ("flags", "changes"):  # not set yet (a copy being made): no setting has these names
            raise AttributeError(key)
        if key in self.changes:
            return self.changes[key][1]
        return getattr(self.flags, key)

    def set(self, key, value, why=None):
        """Sets key to value, for the reason why (None: not worth a line, as a checkpoint's own value); a value
        already set stays what set it."""
        if getattr(self, key) != value:
            self.changes.pop(key, None)  # the lines list the settings in the order they were last changed
            self.changes[key] = (why, value)

    def named(self):
        """[(what changed it, setting, its default, its value)] of the settings a reason changed from the flags'."""
        return [(why, key, getattr(self.flags, key), value) for key, (why, value) in self.changes.items()
                if why is not None and value != getattr(self.flags, key)]

    def done(self):
        return dataclasses.replace(self.flags, **{key: value for key, (_, value) in self.changes.items()})


def apply_presets(draft, given, chosen, model_sizes, unread):
    """Sets each preset's settings but those given as flags (with --model, its sizes too) and those the run's recipe
    does not read (unread: another recipe's, which it refuses as flags), the later presets over the earlier."""
    keep = set(given) | (set(model_sizes[draft.model]) if "model" in given else set())
    final = {}
    for name, preset in chosen:
        for key, value in preset.items():
            if key not in unread and (key not in keep or name.startswith("--init-from")):
                final[key] = (name, value)
    for key, (name, value) in final.items():
        draft.set(key, value, f"preset {name}")


def say_changes(changes, model, sizes, width=120):
    """The lines that name each setting changed from its default (the file's value), under what changed it, a setting
    never split over two. sizes: those of --model (its name), which a default of 0 stands for."""
    shown_changes = [change for change in changes if not (change[1] in sizes and change[2] == 0
                                                           and change[3] == sizes[change[1]])]  # what 0 meant anyway
    lines = []
    for why in dict.fromkeys(change[0] for change in shown_changes):
        lines.append(f"{why} sets:")
        for made_by, key, before, value in shown_changes:
            if made_by != why:
                continue
            default = f"--model {model}'s {sizes[key]}" if key in sizes and before == 0 else shown(before)
            item = f"{flag(key)} {shown(value)} (default: {default})"
            if len(lines[-1]) + len(item) + 2 > width:
                lines.append("   ")
            lines[-1] += f" {item},"
        lines[-1] = lines[-1].removesuffix(",")
    if lines:
        fixed = any(change[0].startswith("preset --init-from") for change in shown_changes)  # a flag for those: refused
        lines.append(f"    (a flag overrides any of these{' but what --init-from fixes' if fixed else ''})")
    return lines


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
                  "total_batch_size", "val_tokens", "keep_checkpoints", "max_bad_steps", "max_lr", "grad_clip",
                  "muon_lr", "embed_lr", "head_lr", "logit_softcap"),
            lambda v: v > 0, "positive")
    require(cfg, ("max_steps", "warmup_steps", "eval_every", *BENCHMARKS, "core_max_per_task", "checkpoint_every",
                  "num_samples", "max_new_tokens", "weight_decay"), lambda v: v >= 0, "zero or more")
    # Adam divides its rate by 1 - beta1 (10 or 5 times it at the first step), Muon multiplies its own by up to 2:
    # near float32's largest number, the optimizer's step overflows (a traceback inside torch)
    most = torch.finfo(torch.float32).max / 100
    require(cfg, [name for name in vars(cfg) if name.endswith("_lr")], lambda v: v <= most,
            f"at most {most:.2g} (a larger rate can overflow float32 in the optimizer's step)")
    require(cfg, ("min_lr_ratio",), lambda v: 0 <= v <= 1, "between 0 and 1")
    require(cfg, ("cooldown_frac",), lambda v: 0 < v <= 1, "above 0 and at most 1")
    require(cfg, ("seed",), lambda v: 0 <= v < 2**32, "from 0 to 2**32 - 1")
    if cfg.n_embd % cfg.n_head:
        raise UsageError(f"--n-embd {cfg.n_embd} must be a multiple of --n-head {cfg.n_head}")
    if cfg.wandb_run_name and not cfg.wandb_project:
        raise UsageError(f"--wandb-run-name {cfg.wandb_run_name} names a W&B run, but W&B is off; pass "
                         f"--wandb-project too")
    if cfg.wandb_project:
        run_files.import_wandb(cfg.wandb_project)  # now rather than after the set-up: a missing package costs no time
    for key in BENCHMARKS:
        if getattr(cfg, key) > 0 and cfg.vocab_size < GPT2_VOCAB:
            raise UsageError(f"{flag(key)} {getattr(cfg, key)} needs GPT-2's whole vocabulary, but --vocab-size is "
                             f"{cfg.vocab_size}; pass {flag(key)} 0")
    if cfg.loss == "chunked" and cfg.dtype == "fp16":  # its gradients exist before the loss is scaled
        raise UsageError("--loss chunked cannot run with --dtype fp16: it computes its gradients in fp16 before the "
                         "gradient scaler sees them, where they can underflow or overflow; use --dtype bf16 or fp32, "
                         "or --loss full")
    if cfg.seq_len > cfg.block_size:
        raise UsageError(f"--seq-len {cfg.seq_len} is longer than the model's --block-size {cfg.block_size}; "
                         f"shorten it")
    tokens_per_pass = cfg.batch_size * cfg.seq_len * world_size
    if cfg.total_batch_size % tokens_per_pass:
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


def fit_warmup(draft, given, resumed):
    """A run no longer than its warmup never reaches its peak learning rate, nor decays: a preset's warmup (715 steps
    for FineWeb) is cut to a tenth of a shorter run, and a --warmup-steps given that long is warned about. A resumed
    run (resumed: its checkpoint's settings) keeps its own warmup, not the file's again: raising --max-steps would put
    its rate back into a warmup. Its new schedule is said once restored (checkpoints.say_schedule_change). Returns the
    lines to say."""
    if resumed is not None and "warmup_steps" not in given:
        draft.set("warmup_steps", resumed["warmup_steps"])
    if draft.max_steps == 0 or draft.warmup_steps < draft.max_steps:
        return []
    if "warmup_steps" in given:
        return [f"warning: --warmup-steps {draft.warmup_steps} is not shorter than --max-steps {draft.max_steps}: the "
                f"learning rate rises for the whole run and never decays"]
    warmup = draft.max_steps // 10
    line = (f"--max-steps {draft.max_steps} is no longer than the {draft.warmup_steps} warmup steps: warming up for "
            f"{warmup} step{'' if warmup == 1 else 's'} instead, a tenth of the run (--warmup-steps sets it)")
    draft.set("warmup_steps", warmup)
    return [line] if resumed is None else []


def take_model_settings(draft, given, train_config, model_config, path):
    """--eval-only evaluates a checkpoint's model as it was trained: its recipe and shapes (model_config), not those
    the flags and presets say, as --sample does, and its steps stand for the tokens of its batch (train_config). A flag
    given that says otherwise is refused."""
    taken = {k: v for k, v in model_config.items() if k not in COMPUTE_ONLY}
    clash = [f"{k}: checkpoint {v}, flags {getattr(draft, k)}" for k, v in taken.items()
             if k in given and getattr(draft, k) != v]
    if clash:
        raise UsageError(f"--eval-only evaluates {path} as it was trained, and flags say otherwise "
                         f"({'; '.join(clash)}); drop them")
    for key, value in {**taken, "total_batch_size": train_config["total_batch_size"]}.items():
        draft.set(key, value)
    if draft.seq_len > draft.block_size:
        raise UsageError(f"--seq-len {draft.seq_len} is longer than {path}'s block of {draft.block_size} tokens; pass "
                         f"--seq-len {draft.block_size}")
    for key in BENCHMARKS:
        if getattr(draft, key) > 0 and draft.vocab_size < GPT2_VOCAB:
            if key in given:
                raise UsageError(f"{flag(key)} needs GPT-2's whole vocabulary, and {path} has {draft.vocab_size} "
                                 f"tokens; drop it")
            draft.set(key, 0)


# -----------------------------------------------------------------------------
# The settings resolved


def resolve(flags, given, env, recipes, model_sizes, presets, fsdp_check, resumed=None):
    """The run's settings, decided here alone, in this order: the file's defaults and the flags given (flags), the
    presets, the defaults that depend on the model preset and the device, then what the checkpoint resumed keeps
    (resumed: its train_config, model_config and path; None for a new run), all checked. Returns them, frozen, and
    the lines that name each value that is not its default (a preset's, the device's, one derived from the others),
    for rank 0 to print. It prints and writes nothing: train_gpt2.start asks it once to find the run's log directory
    and checkpoint, then again with that checkpoint. fsdp_check: fsdp.py's refusals, for --fsdp."""
    draft, lines = Draft(flags), []
    if flags.eval_only and flags.resume == "none":
        raise UsageError("--eval-only evaluates a checkpoint (the latest in --log-dir, or --resume PATH's) or OpenAI's "
                         "weights (--init-from), and --no-resume asks for none; drop --no-resume")
    # the default --data holding only what a stopped `python fineweb.py` left is as good as missing
    leftovers = None if "data" in given else plumbing.unfinished_preparation(flags.data)
    shards_found = "data" in given or (os.path.exists(flags.data) and leftovers is None)
    if not shards_found:
        doing = ("evaluating" if flags.eval_only else "training a small model" if flags.init_from == "scratch"
                 else f"fine-tuning {pretrained_in_words(flags.init_from)}")
        advice = "make them with `python fineweb.py`"
        if leftovers:
            advice = (f"only {', '.join(leftovers)}, left by an unfinished `python fineweb.py`: rerun it to finish "
                      f"them, or delete {flags.data}/")
        elif leftovers == []:
            advice = f"it is empty: {advice}, or delete {flags.data}/"
        lines.append(f"no FineWeb shards in {flags.data}/ ({advice}): {doing} on tiny Shakespeare instead")
    recipe, chosen = presets_for(draft, given, shards_found, recipes, model_sizes, presets)  # --init-from's recipe
    apply_presets(draft, given, chosen, model_sizes, not_read_by(recipe, recipes))
    if not shards_found and "batch_size" not in given and draft.seq_len > 0:
        draft.set("batch_size", max(1, draft.total_batch_size // (draft.seq_len * env.world_size)),
                  "one micro-batch a step without shards (--total-batch-size / --seq-len / processes)")
    for key, value in model_sizes[draft.model].items():
        if getattr(draft, key) == 0:
            draft.set(key, value)
    if draft.compile is None:
        draft.set("compile", env.device_type == "cuda")
    if draft.compile_mode != "default" and not draft.compile:
        raise UsageError(f"--compile-mode {draft.compile_mode} needs --compile (off by default without CUDA); pass "
                         f"--compile or drop it")
    off = [key for key in BENCHMARKS if key not in given and getattr(draft, key) != 0]
    if off and (env.device_type != "cuda" or draft.vocab_size < GPT2_VOCAB):
        why = (f"on {env.device_type} (too slow without CUDA)" if env.device_type != "cuda" else
               f"with --vocab-size {draft.vocab_size} (their text needs every GPT-2 token)")
        for key in off:
            draft.set(key, 0, f"no {' or '.join(BENCHMARKS[key] for key in off)} {why}")
    lines += say_changes(draft.named(), draft.model, model_sizes[draft.model])
    draft.set("dtype", resolve_dtype(draft.dtype, env.device_type))
    if draft.eval_only and resumed is not None:  # the model as it was trained, whatever the flags' recipe
        take_model_settings(draft, given, *resumed)
    elif not draft.eval_only:
        lines += fit_warmup(draft, given, None if resumed is None else resumed[0])
    cfg = draft.done()
    check_config(cfg, env.world_size)
    check_recipe(cfg, given, recipes)  # once the shapes are whole: --model's, --init-from's, the checkpoint's
    if cfg.fsdp:
        fsdp_check(cfg)
    return cfg, lines
