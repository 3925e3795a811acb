"""
The settings resolved, once: a Draft of them goes through its layers in the order they apply, each a call with a name,
and comes out a frozen TrainConfig. The layers come in two halves, with the log directory's lock between them:
draft_settings applies the flags, the presets and the device, which say where the run's log directory and checkpoint
are; final_settings applies what that checkpoint keeps and the values fitted to the others, then every check. Every
change goes through Draft.set, which records what made it, so that the run's first lines name each value that is not
the file's. Each rank resolves its own settings, and the ranks agree on what each decided before any collective reads
them. train_gpt2.py hands over its tables (the recipes, the model sizes, the presets): this module never imports it.
"""

import dataclasses
from typing import NamedTuple

from machinery import fsdp, presets, ranks
from machinery.checks import check_config, check_recipe
from machinery.environment import resolve_dtype
from machinery.errors import UsageError
from machinery.settings import COMPUTE_ONLY, as_typed, declared_with, flag, in_order, shown
from machinery.tokenizer import GPT2_VOCAB

# -----------------------------------------------------------------------------
# The settings while they are decided, and the lines that say what made each


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

    def changes_to_say(self):
        """The changes the run's first lines name, from the flags' values (or what they stand for), as Named."""
        named = []
        for key, change in self.changes.items():
            default, words = self.meanings.get(key, (getattr(self.flags, key), shown(getattr(self.flags, key))))
            if change.said and change.value != default:
                named.append(Named(change.why, key, words, change.value))
        return named

    def done(self):
        return dataclasses.replace(self.flags, **{key: change.value for key, change in self.changes.items()})


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


def say_given(draft):
    """The line (or lines) that name the flags given, as they would be typed: the settings the other lines leave out."""
    flags = draft.flags
    given = [as_typed(f.name, getattr(flags, f.name)) for f in in_order(type(flags)) if f.name in draft.given]
    return in_lines("flags given:", given, "") if given else []


# -----------------------------------------------------------------------------
# The layers in the order they apply, then every check


def draft_settings(flags, given, env, recipes, model_sizes, preset_tables):
    """The settings as the layers before the checkpoint's make them, in the order they apply: the file's defaults and
    the flags given (flags), the presets (which the data decides; preset_tables: train_gpt2.py's PRESETS), the model
    preset, the device. A Draft: it says where the run's log directory and checkpoint are, and final_settings finishes
    it."""
    if flags.eval_only and flags.resume == "none":
        raise UsageError("--eval-only evaluates a checkpoint (the latest in --log-dir, or --resume PATH's) or OpenAI's "
                         "weights (--init-from), and --no-resume asks for none; drop --no-resume")
    draft = Draft(flags, given)
    draft.shards_found = presets.look_for_shards(draft)
    # recipe: the run's, the weights' where --init-from's fix it
    recipe, chosen, fixed = presets.presets_for(draft, draft.shards_found, recipes, model_sizes, preset_tables)
    presets.apply_presets(draft, chosen, fixed, model_sizes, presets.not_read_by(recipe, recipes))
    draft.fixed_by = fixed and fixed[0]
    presets.apply_model_preset(draft, model_sizes)
    apply_device(draft, env)
    return draft


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
    if draft.flags.loss == "auto":  # fp16 scales the loss after the chunks' gradients exist
        full = any(getattr(draft, key) for key in declared_with(draft.flags, "full_loss"))  # a speed-up that needs it
        loss = "chunked" if cuda and draft.dtype != "fp16" and not full else "full"
        draft.stand_in("loss", loss, f"{env.device_type}'s {loss}")
    benchmarks = declared_with(draft.flags, "benchmark")
    off = [key for key in benchmarks if key not in draft.given and getattr(draft, key) != 0]
    if off and (env.device_type != "cuda" or draft.vocab_size < GPT2_VOCAB):
        why = (f"on {env.device_type} (too slow without CUDA)" if env.device_type != "cuda" else
               f"with --vocab-size {draft.vocab_size} (their text needs every GPT-2 token)")
        for key in off:
            draft.set(key, 0, f"no {' or '.join(benchmarks[key] for key in off)} {why}")


def final_settings(draft, env, recipes, checks, resumed=None):
    """The run's settings, frozen: draft's layers (draft_settings), then what the checkpoint resumed keeps (resumed:
    its train_config, model_config and path; None for a new run), then the values fitted to the others, then every
    check. Also the lines for rank 0 to print first: what made each value that is not the file's. It prints and
    writes nothing. checks: the refusals of the modules that import this one (fsdp.py's, speedups.py's, a
    benchmark's, ...), each check(cfg, env), so that a setting that cannot run here is refused before anything is read
    or downloaded; one may return a line to say too (fsdp.py's mesh). Each rank resolves its own, from what its node
    has (its files, devices and processes): all of them compare theirs before any collective reads them, and where
    they differ, every rank ends with one line that says how (decided_apart), not waiting for the others in
    collectives of its own."""
    with ranks.failing_together(decided=lambda: decided(draft), apart=decided_apart):
        cfg, lines = resolved_here(draft, env, recipes, checks, resumed)
    return cfg, lines


def resolved_here(draft, env, recipes, checks, resumed):
    """final_settings' settings and lines, as this rank decides them."""
    if draft.eval_only and resumed is not None:  # the model as it was trained, whatever the flags' recipe
        take_model_settings(draft, *resumed)
    apply_processes(draft, env)
    fit_seq_len(draft)
    small_model = presets.uses_shakespeare_preset(draft, draft.shards_found)
    if small_model and not (draft.eval_only or "batch_size" in draft.given) and draft.seq_len > 0:
        draft.set("batch_size", max(1, draft.total_batch_size // (draft.seq_len * env.world_size)),
                  "one micro-batch a step of the small model (--total-batch-size / --seq-len / processes)")
    later = [] if draft.eval_only else fit_warmup(draft, None if resumed is None else resumed[0])
    unread = training_only(draft.flags, recipes) if draft.eval_only else ()
    changes = [change for change in draft.changes_to_say() if change.key not in unread]
    lines = draft.notes + say_changes(changes, draft.fixed_by is not None) + later
    cfg = draft.done()
    check_config(cfg, env.world_size)
    check_recipe(cfg, draft.given, recipes)  # once the shapes are whole: --model's, --init-from's, the checkpoint's
    lines += [line for line in (check(cfg, env) for check in checks) if line] + say_given(draft)
    return cfg, lines


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
    for key in declared_with(draft.flags, "benchmark"):
        if getattr(draft, key) > 0 and draft.vocab_size < GPT2_VOCAB:
            if key in draft.given:
                raise UsageError(f"{flag(key)} needs GPT-2's whole vocabulary, and {path} has {draft.vocab_size} "
                                 f"tokens; drop it")
            draft.set(key, 0, f"the checkpoint {path}", said=False)


def apply_processes(draft, env):
    """What the processes decide: --fsdp's shard group where --fsdp-shards is not given (fsdp.default_shards: a
    node's processes, or all of them where a node has one). Each rank sees only its own node's, so it is applied
    inside final_settings, whose ranks then compare what they decided."""
    if draft.fsdp and draft.flags.fsdp_shards is None:
        draft.stand_in("fsdp_shards", *fsdp.default_shards(env.world_size))


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


def training_only(cfg, recipes):
    """The settings that only training reads (--eval-only's first lines leave them out): the batch, the schedule, the
    checkpoints, and each recipe's own that are not the model's (its learning rates)."""
    model = {f.name for f in dataclasses.fields(cfg) if f.metadata["model"]}
    rates = {name for recipe in recipes.values() for name in recipe.settings} - model
    return rates | {"total_batch_size", "max_steps", "warmup_steps", "min_lr_ratio", "grad_clip", "eval_every",
                    "checkpoint_every", "keep_checkpoints", "max_bad_steps"}


# -----------------------------------------------------------------------------
# The ranks' agreement: each resolves its own settings, from what its node has


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
