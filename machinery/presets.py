"""
The presets: what a kind of run changes in the file's settings, in the order they apply (no FineWeb shards, or
--preset shakespeare: tiny Shakespeare's small model; --init-from: a gentler rate; a recipe's own PRESETS), then what
--init-from's weights fix (OpenAI's shapes, or an export's config.json), which a flag may not contradict, then
--model's sizes. train_gpt2.py hands over its tables (the recipes, the model sizes, the presets): this module never
imports it.

A preset changes the file's values for a kind of run, but never a setting given as a flag, nor one the run's recipe
does not read, and never silently: the run's first lines name every setting whose value is not the file's, with the
file's value it replaced (resolution.say_changes).
"""

import os

from machinery import hf_format, shard_files
from machinery.errors import UsageError
from machinery.settings import flag, pretrained_in_words, shown
from machinery.tokenizer import GPT2_VOCAB

TOP = "at the top of train_gpt2.py"  # where its presets are, below the settings


def defined_in(recipe):
    """The file a recipe is written in (its model's): where its PRESETS are."""
    return os.path.basename(recipe.model.__init__.__code__.co_filename)


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


def presets_for(draft, shards_found, recipes, model_sizes, presets):
    """The run's recipe, its presets in the order they apply, [(name and where it is, {setting: value})], and what
    --init-from's weights fix, (name, {setting: value}) or None. presets: train_gpt2.py's named tables SHAKESPEARE,
    SHAKESPEARE_FINETUNE and OPENAI_SHAPES. The weights fix the recipe and the shapes, whatever a preset says; a flag
    that says otherwise is refused."""
    pretrained = pretrained_preset(draft, recipes, model_sizes, presets)
    recipe_name = pretrained[1].get("recipe", draft.recipe) if pretrained else draft.recipe
    recipe, where = recipes[recipe_name].presets, f"in {defined_in(recipes[recipe_name])}"
    chosen = []
    if uses_shakespeare_preset(draft, shards_found):  # no shards, or --preset shakespeare on the shards found
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
    check_flags_against_weights(draft, fixed, model_sizes)
    return recipe_name, chosen, (pretrained[0], fixed)


def uses_shakespeare_preset(draft, shards_found):
    """Whether the run takes the quick start's presets: --preset shakespeare, or no shards in --data."""
    return draft.preset == "shakespeare" or not shards_found


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
    fixed = settings_of_export(cfg.init_from, recipes)
    fixed.update({key: value for key, value in presets["OPENAI_SHAPES"].items() if key not in fixed})
    if fixed["vocab_size"] == GPT2_VOCAB:
        fixed["vocab_size"] = presets["OPENAI_SHAPES"]["vocab_size"]
    return f"--init-from {cfg.init_from} (its config.json's recipe and shapes)", fixed


def settings_of_export(directory, recipes):
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


def check_flags_against_weights(draft, fixed, model_sizes):
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


def apply_model_preset(draft, model_sizes):
    """--model's sizes, for the file's sizes of 0, which stand for them; and, given as a flag, over the file's edited
    sizes too (but not over the size flags)."""
    for key, value in model_sizes[draft.model].items():
        if getattr(draft.flags, key) == 0:
            draft.stand_in(key, value, f"--model {draft.model}'s {value}")
        elif "model" in draft.given and key not in draft.given:
            draft.set(key, value, f"--model {draft.model}")


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
                        if key not in not_read_by(presets["OPENAI_SHAPES"]["recipe"], recipes)})]
    for name, recipe in recipes.items():
        for key, when in (("fineweb", "with FineWeb shards"), ("shakespeare", "over SHAKESPEARE")):
            if key in recipe.presets:
                lines += [f"  --recipe {name}'s PRESETS['{key}'] (in {defined_in(recipe)}), {when}",
                          *as_flags(recipe.presets[key])]
    return "\n".join(lines)
