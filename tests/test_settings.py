"""The settings at the top of train_gpt2.py against the presets: a constant edited in the file takes effect, and
whatever changes it (a preset for a kind of run: no shards, --recipe modern, --init-from; the device; the other
settings) says so in the run's first lines, with its default (the file's value) and where the preset is, and says
once that a flag overrides them. And --help lists what each preset changes."""
import dataclasses
import importlib.util
import json
import os
import sys

import pytest

import train_gpt2
import variations
from helpers import (
    REPO,
    TINY,
    check_usage_error,
    checkpoint_path,
    expect_usage_error,
    load_ckpt,
    needs_muon,
    read_log,
    resolved,
    run_command,
    run_main,
    script_command,
    script_env,
    write_shards,
)
from machinery import settings

# a user's edits to the defaults at the top of the files (each must match its file, or the test stops): train_gpt2.py's,
# and the modern recipe's own in modern.py
EDITS = {
    "train_gpt2.py": {
        'n_layer: int = setting(0, "transformer': 'n_layer: int = setting(2, "transformer',
        'n_head: int = setting(0, "attention': 'n_head: int = setting(4, "attention',
        'n_embd: int = setting(0, "embedding': 'n_embd: int = setting(64, "embedding',
        'max_steps: int = setting(19073,': 'max_steps: int = setting(3,',
        'max_lr: float = setting(6e-4,': 'max_lr: float = setting(1e-5,',
        'hellaswag_every: int = setting(250,': 'hellaswag_every: int = setting(100,',
        'batch_size: int = setting(64,': 'batch_size: int = setting(8,',
    },
    "variations/modern.py": {'muon_lr: float = setting(0.02,': 'muon_lr: float = setting(0.05,'},
}


# what an export of the modern recipe's Shakespeare model says of it (--export-hf's config.json, NanoChatForCausalLM's)
NANOCHAT_CONFIG = {
    "architectures": ["NanoChatForCausalLM"], "model_type": "nanochat", "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_size": 128, "intermediate_size": 512,
    "max_position_embeddings": 256, "vocab_size": 50257, "hidden_act": "relu2", "rms_norm_eps": 1.1920928955078125e-07,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "final_logit_softcapping": 15.0,
    "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False, "bos_token_id": 50256,
    "eos_token_id": 50256, "pad_token_id": None, "dtype": "float32",
}


@pytest.fixture(scope="module")
def edited(tmp_path_factory):
    """Copies of train_gpt2.py and variations/modern.py with EDITS made to their defaults, the first imported as a
    module of its own that imports the second (as variations.modern, for the time of its import)."""
    directory = tmp_path_factory.mktemp("edited")
    for name, edits in EDITS.items():
        text = open(os.path.join(REPO, name)).read()
        for old, new in edits.items():
            assert text.count(old) == 1, old
            text = text.replace(old, new)
        (directory / os.path.basename(name)).write_text(text)
    modern = import_as("edited_modern", directory / "modern.py")
    real_modern = sys.modules["variations.modern"]
    sys.modules["variations.modern"] = variations.modern = modern
    try:
        return import_as("edited_train_gpt2", directory / "train_gpt2.py")
    finally:
        sys.modules["variations.modern"] = variations.modern = real_modern


def import_as(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def resolve(edited, flags, capsys):
    """The settings a run of the edited file resolves with flags, and the lines it prints first."""
    capsys.readouterr()
    cfg = resolved(flags, trainer=edited)
    return cfg, capsys.readouterr().out


def test_with_shards_the_edited_file_is_what_runs(edited, tmp_path, capsys):
    cfg, out = resolve(edited, ["--data", str(tmp_path)], capsys)  # a directory that exists: no Shakespeare preset
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.max_steps, cfg.max_lr) == (2, 4, 64, 3, 1e-5)
    assert "preset" not in out
    # but HellaSwag, too slow on a CPU, is off: said so, with the file's value (it was forced to 0 without a word)
    assert cfg.hellaswag_every == 0
    assert "no HellaSwag or CORE on cpu (too slow without CUDA) sets: --hellaswag-every 0 (default: 100)" in out
    cfg, out = resolve(edited, ["--data", str(tmp_path), "--hellaswag-every", "100"], capsys)
    assert cfg.hellaswag_every == 100 and "sets: --hellaswag-every" not in out


def test_a_batch_size_derived_from_the_others_is_named(edited, tmp_path, capsys, monkeypatch):
    """Without shards a step is one micro-batch: --seq-len 64 makes the file's 8 sequences 16, and says so."""
    monkeypatch.chdir(tmp_path)
    cfg, out = resolve(edited, ["--seq-len", "64"], capsys)
    assert (cfg.batch_size, cfg.seq_len, cfg.total_batch_size) == (16, 64, 1024)
    assert "--batch-size 16 (default: 8)" in out


@pytest.mark.parametrize("flags", [[], ["--seq-len", "64"], ["--data", "."], ["--recipe", "modern"],
                                   ["--recipe", "modern", "--data", "."], ["--init-from", "gpt2"],
                                   ["--init-from", "gpt2", "--data", "."], ["--model", "gpt2-medium"]])
def test_every_setting_that_differs_from_the_file_is_named_with_the_files_value(edited, tmp_path, capsys,
                                                                               monkeypatch, flags):
    """For whatever reason: a preset, the device, a value derived from others. (What the file's values mean is no
    change: a 0 for --model's size, None and auto for what the device decides; fit_warmup says its own line.)"""
    monkeypatch.chdir(tmp_path)
    cfg, out = resolve(edited, flags, capsys)
    file, given = edited.TrainConfig(), edited.parse_args(flags)[1]
    for name, before in vars(file).items():
        value = getattr(cfg, name)
        if value != before and name not in given and before not in (None, "auto", 0) and name != "warmup_steps":
            assert f"{settings.flag(name)} {settings.shown(value)} (default: {settings.shown(before)})" in out, name


def test_the_preset_lines_say_where_each_preset_is_and_never_name_a_flag_the_recipe_refuses(edited, tmp_path, capsys,
                                                                                            monkeypatch):
    """An edited max_steps = 3 shown as --max-steps 900 (default: 3) said nothing of where the 900 is; the modern
    recipe's lines named --max-lr 0.002, a flag it refuses."""
    monkeypatch.chdir(tmp_path)
    _, out = resolve(edited, [], capsys)
    assert "preset SHAKESPEARE (at the top of train_gpt2.py) sets:" in out
    cfg, out = resolve(edited, ["--recipe", "modern"], capsys)
    assert "preset SHAKESPEARE (at the top of train_gpt2.py) sets" in out
    assert "preset --recipe modern's PRESETS['shakespeare'] (in modern.py) sets" in out
    assert "--max-lr" not in out and cfg.max_lr == 1e-5  # the file's, which this recipe does not read
    _, out = resolve(edited, ["--recipe", "modern", "--data", str(tmp_path)], capsys)
    assert "preset --recipe modern's PRESETS['fineweb'] (in modern.py) sets" in out
    _, out = resolve(edited, ["--init-from", "gpt2", "--data", str(tmp_path)], capsys)
    assert "preset --init-from gpt2 (OpenAI's shapes, OPENAI_SHAPES at the top of train_gpt2.py) sets" in out


def test_the_shakespeare_preset_names_each_edit_it_replaces(edited, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no edu_fineweb10B here
    cfg, out = resolve(edited, [], capsys)
    assert (cfg.n_layer, cfg.n_embd, cfg.max_steps, cfg.max_lr) == (8, 128, 900, 2e-3)
    assert "preset SHAKESPEARE (at the top of train_gpt2.py) sets:" in out
    for named in ("--n-layer 8 (default: 2)", "--n-embd 128 (default: 64)", "--max-steps 900 (default: 3)",
                  "--max-lr 0.002 (default: 1e-05)", "input.txt (default: edu_fineweb10B)"):
        assert named in out, named
    assert out.count("a flag overrides any of these") == 1
    cfg, out = resolve(edited, ["--n-layer", "2", "--max-steps", "3"], capsys)  # the way the line gives
    assert (cfg.n_layer, cfg.max_steps) == (2, 3)
    assert "--n-layer 8" not in out and "--max-steps 900" not in out and "--n-embd 128 (default: 64)" in out


def test_preset_shakespeare_is_the_quick_starts_settings_on_any_data(tmp_path, capsys, monkeypatch):
    """Training the quick start's small model on shards of one's own took about 20 flags. `--preset shakespeare`
    resolves every setting as `python train_gpt2.py` without shards does, but --data, with either recipe and on 1 or
    2 processes; the first lines name the preset and the flag. A flag still overrides it."""
    monkeypatch.chdir(tmp_path)  # no edu_fineweb10B here: the quick start's presets
    for flags, processes in (([], 1), ([], 2), (["--recipe", "modern"], 1)):
        env = train_gpt2.Env(0, 0, processes, "cpu", "cpu")
        quick_start = vars(resolved(flags, env))
        capsys.readouterr()
        cfg = resolved(flags + ["--data", "mine", "--preset", "shakespeare"], env)
        out = capsys.readouterr().out
        assert {key for key, value in quick_start.items() if getattr(cfg, key) != value} == {"data", "preset"}, flags
        assert "preset SHAKESPEARE (--preset shakespeare, at the top of train_gpt2.py) sets:" in out
        assert out.splitlines()[-1] == " ".join(["flags given: --data mine --preset shakespeare", *flags])
    cfg = resolved(["--preset", "shakespeare"])  # and no shards: tiny Shakespeare, as without the flag
    assert os.path.basename(cfg.data) == "input.txt" and cfg.n_embd == 128
    write_shards(tmp_path / "edu_fineweb10B")  # the default --data, with shards: the small model on them
    cfg = resolved(["--preset", "shakespeare", "--n-layer", "4"])
    assert (cfg.data, cfg.n_layer, cfg.n_embd, cfg.max_steps) == ("edu_fineweb10B", 4, 128, 900)


def test_the_first_lines_end_with_the_flags_given_as_typed(tmp_path, capsys, monkeypatch):
    """The first lines named every setting a preset, the device or another setting changed, but not the flags typed,
    though the README said they name every setting that is not its default. They end with the flags given, as they
    would be typed (booleans both ways, --no-resume, a value that needs quotes), in lines of at most 120 characters;
    with none given, no such line."""
    monkeypatch.chdir(tmp_path)
    _, out = resolve(train_gpt2, [], capsys)
    assert "flags given" not in out
    flags = ["--data", ".", "--max-steps", "50", "--no-compile", "--fused-adamw", "--no-resume", "--prompt", "a b\n",
             "--log-dir", "a/run", "--wandb-project", "p", "--grad-clip", "0.5", "--seed", "7", "--val-tokens", "4096"]
    _, out = resolve(train_gpt2, flags, capsys)
    lines = out.splitlines()
    given = lines[next(i for i, line in enumerate(lines) if line.startswith("flags given: ")):]
    assert " ".join(" ".join(given).split()) == (
        "flags given: --data . --log-dir a/run --max-steps 50 --grad-clip 0.5 --seed 7 --val-tokens 4096 "
        "--prompt 'a b\\n' --no-resume --wandb-project p --no-compile --fused-adamw")
    assert len(given) == 1 or all(len(line) <= 120 for line in given)


def test_a_file_value_of_0_is_named_with_the_size_it_stands_for(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the file as it ships: --n-layer 0, taken from --model gpt2
    _, out = resolve(train_gpt2, [], capsys)
    assert "--n-layer 8 (default: --model gpt2's 12)" in out
    assert "--n-embd 128 (default: --model gpt2's 768)" in out
    assert "--block-size 256 (default: 1024)" in out


def test_the_modern_recipes_presets_name_each_edit_they_replace(edited, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, out = resolve(edited, ["--recipe", "modern", "--data", str(tmp_path)], capsys)  # FineWeb: fewer steps
    assert (cfg.max_steps, cfg.muon_lr, cfg.n_layer) == (3815, 0.05, 2)
    assert "preset --recipe modern's PRESETS['fineweb'] (in modern.py) sets" in out
    assert "--max-steps 3815 (default: 3)" in out
    cfg, out = resolve(edited, ["--recipe", "modern"], capsys)  # tiny Shakespeare: its searched rates
    assert cfg.muon_lr == 0.02 and "--muon-lr 0.02 (default: 0.05)" in out


def test_the_modern_recipe_runs_in_a_log_dir_of_its_own(tmp_path, capsys, monkeypatch):
    """`python train_gpt2.py --recipe modern` right after the quick start: log/ holds GPT-2's run, which the modern
    recipe's model would not fit; by default it goes to log_modern/ instead, with or without shards."""
    monkeypatch.chdir(tmp_path)
    for flags in (["--recipe", "modern"], ["--recipe", "modern", "--data", str(tmp_path)]):
        cfg, out = resolve(train_gpt2, flags, capsys)
        assert cfg.log_dir == "log_modern" and "--log-dir log_modern (default: log)" in out
    cfg, out = resolve(train_gpt2, ["--recipe", "modern", "--log-dir", "log"], capsys)  # a flag still says where
    assert cfg.log_dir == "log"


def test_init_from_names_the_shapes_and_the_fine_tuning_it_sets(edited, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, out = resolve(edited, ["--init-from", "gpt2", "--data", str(tmp_path)], capsys)
    assert (cfg.n_layer, cfg.n_embd, cfg.max_steps, cfg.max_lr) == (12, 768, 3, 1e-5)  # the rest: the file's
    assert "preset --init-from gpt2 (OpenAI's shapes, OPENAI_SHAPES at the top of train_gpt2.py) sets" in out
    assert "--n-layer 12 (default: 2)" in out and "--n-embd 768 (default: 64)" in out
    cfg, out = resolve(edited, ["--init-from", "gpt2"], capsys)  # fine-tuning on tiny Shakespeare
    assert (cfg.n_layer, cfg.max_steps, cfg.max_lr) == (12, 100, 3e-5)
    assert "preset SHAKESPEARE_FINETUNE (at the top of train_gpt2.py) sets" in out
    assert "--max-lr 3e-05 (default: 1e-05)" in out
    assert "--max-steps 100 (default: 3)" in out


def said_by(out):
    """The run's first lines as {what changed the settings: the settings it names}, continuation lines included."""
    groups, last = {}, None
    for line in out.splitlines():
        if " sets:" in line and not line.startswith(" "):
            last, _, line = line.partition(" sets:")
            groups[last] = ""
        if last is not None and not line.startswith("    ("):
            groups[last] += line
    return groups


@needs_muon
def test_a_modern_fine_tune_names_each_setting_under_the_preset_that_set_it(tmp_path, capsys, monkeypatch):
    """A fine-tune of the modern recipe's export on tiny Shakespeare: SHAKESPEARE_FINETUNE's warmup and rate are not
    what it runs at (the modern recipe's fine-tuning preset replaces the one and refuses the other), so they must not
    appear under it; and the one line for flags says that a flag overrides any of them, naming no arbitrary
    setting."""
    monkeypatch.chdir(tmp_path)
    export = tmp_path / "hf_modern"
    export.mkdir()
    (export / "config.json").write_text(json.dumps(NANOCHAT_CONFIG))
    (export / "model.safetensors").touch()  # the settings never read the weights
    cfg, out = resolve(train_gpt2, ["--init-from", str(export), "--log-dir", "log_finetune"], capsys)
    # the modern recipe's own fine-tuning rates, over its from-scratch ones: a sixtieth of them
    assert (cfg.recipe, cfg.warmup_steps, cfg.max_steps) == ("modern", 10, 100)
    assert (cfg.muon_lr, cfg.embed_lr, cfg.head_lr) == (0.0003, 0.005, 0.00007)
    groups = said_by(out)
    finetune = groups["preset SHAKESPEARE_FINETUNE (at the top of train_gpt2.py)"]
    modern_finetune = groups["preset --recipe modern's PRESETS['shakespeare_finetune'] (in modern.py)"]
    assert "--max-steps 100 (default: 19073)" in finetune and "--eval-every 25" in finetune
    assert "--warmup-steps" not in finetune and "-lr" not in finetune
    # the recipe's from-scratch preset is named under nothing: the fine-tune's replaces all it would change here
    assert "preset --recipe modern's PRESETS['shakespeare'] (in modern.py)" not in groups
    assert "--warmup-steps 10 (default: 715)" in modern_finetune and "--muon-lr 0.0003 (default: 0.02)" in \
        modern_finetune and "--embed-lr 0.005 (default: 0.2)" in modern_finetune
    lines = out.splitlines()
    given = next(i for i, line in enumerate(lines) if line.startswith("flags given: "))  # it wraps at a long path
    assert lines[given - 1] == "    (a flag overrides any of these but what --init-from fixes)"
    typed = " ".join(line.strip() for line in lines[given:])  # its continuation lines, if a long path wrapped it
    assert typed.startswith("flags given: --log-dir log_finetune --init-from ")
    assert "instead:" not in out


def test_a_default_that_means_the_value_set_is_no_change(tmp_path, capsys, monkeypatch):
    """--init-from gpt2 listed --n-layer 12 (file: 0, meaning --model gpt2's 12): a change to the value it had."""
    monkeypatch.chdir(tmp_path)
    cfg, out = resolve(train_gpt2, ["--init-from", "gpt2", "--data", str(tmp_path)], capsys)
    assert (cfg.n_layer, cfg.n_embd) == (12, 768) and "--n-layer" not in out and "--n-embd" not in out
    cfg, out = resolve(train_gpt2, ["--init-from", "gpt2-medium", "--data", str(tmp_path)], capsys)
    assert cfg.n_layer == 24 and "--model gpt2-medium (default: gpt2)" in out and "--n-layer" not in out


def test_help_lists_what_each_preset_changes(capsys):
    with pytest.raises(SystemExit) as exit:
        train_gpt2.parse_args(["--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    presets = out[out.index("presets:"):]
    for name, flags in [("SHAKESPEARE,", "--n-layer 8 --n-head 4 --n-embd 128"),
                        ("SHAKESPEARE_FINETUNE,", "--max-steps 100 --warmup-steps 10 --max-lr 3e-05"),
                        ("OPENAI_SHAPES,", "--block-size 1024 --vocab-size 50304"),
                        ("--recipe modern's PRESETS['fineweb']", "--max-steps 3815 --warmup-steps 0"),
                        ("--recipe modern's PRESETS['shakespeare']", "--muon-lr 0.02 --embed-lr 0.3 --head-lr 0.004")]:
        assert name in presets and flags in presets, (name, flags)


@pytest.mark.parametrize("leftovers", [[".lock"], [".lock", "downloads", "manifest.json"], []])
def test_an_unfinished_preparation_is_no_shards(tmp_path, capsys, monkeypatch, leftovers):
    """`python fineweb.py` stopped early (offline, say, or killed) leaves edu_fineweb10B/ with only its own files:
    `python train_gpt2.py` refused it ("no train shards") until the user found and deleted it. It falls back to
    tiny Shakespeare as if the directory were not there, and its first line says what is there and what to do."""
    monkeypatch.chdir(tmp_path)
    output = tmp_path / "edu_fineweb10B"
    output.mkdir()
    for name in leftovers:
        (output / name).mkdir() if name == "downloads" else (output / name).touch()
    cfg, out = resolve(train_gpt2, [], capsys)
    assert os.path.basename(cfg.data) == "input.txt" and "preset SHAKESPEARE (at the top of train_gpt2.py) sets" in out
    found = (f"only {', '.join(leftovers)}, left by an unfinished `python fineweb.py`: rerun it to finish them"
             if leftovers else "it is empty: make them with `python fineweb.py`")
    assert out.splitlines()[0] == (f"no FineWeb shards in edu_fineweb10B/ ({found}, or delete edu_fineweb10B/): "
                                   "training a small model on tiny Shakespeare instead")
    cfg, out = resolve(train_gpt2, ["--data", "edu_fineweb10B"], capsys)  # named: the loader's refusal, as before
    assert cfg.data == "edu_fineweb10B" and "SHAKESPEARE" not in out


def test_a_directory_with_shards_or_other_files_is_data(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_shards(tmp_path / "edu_fineweb10B", train_lengths=(3000,))
    (tmp_path / "edu_fineweb10B" / ".lock").touch()
    cfg, out = resolve(train_gpt2, [], capsys)
    assert cfg.data == "edu_fineweb10B" and "SHAKESPEARE" not in out
    for name in os.listdir(tmp_path / "edu_fineweb10B"):
        os.remove(tmp_path / "edu_fineweb10B" / name)
    (tmp_path / "edu_fineweb10B" / "notes.txt").touch()  # not fineweb.py's: the loader says what is missing
    cfg, out = resolve(train_gpt2, [], capsys)
    assert cfg.data == "edu_fineweb10B" and "SHAKESPEARE" not in out


# -----------------------------------------------------------------------------
# Decided once: the settings frozen once resolved, and a model setting declared in one place


def test_a_setting_assigned_once_the_settings_are_resolved_raises(shards, capsys):
    """final_settings decides every setting; after it nothing may change one (it would be a silent change)."""
    cfg = resolved(["--data", shards], train_gpt2.Env(0, 0, 1, "cpu", "cpu"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_lr = 1e-3
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.muon_lr = 1e-3  # the modern recipe's own settings too, declared in modern.py
    with pytest.raises(dataclasses.FrozenInstanceError):
        train_gpt2.GPTConfig(n_layer=2, n_head=2, n_embd=32).n_layer = 3


@pytest.fixture(scope="module")
def with_a_model_setting(tmp_path_factory):
    """A copy of train_gpt2.py with a model setting added in one line of TrainConfig, as a new one is (a positional
    encoding's, say, which the model would then read in two more lines), and nothing else."""
    text = open(os.path.join(REPO, "train_gpt2.py")).read()
    anchor = '    attn: str = setting("sdpa",'
    assert text.count(anchor) == 1
    text = text.replace(anchor, '    dummy: int = setting(0, "a model setting of this test", model=True)\n' + anchor)
    path = tmp_path_factory.mktemp("with_a_model_setting") / "train_gpt2.py"
    path.write_text(text)
    return import_as("train_gpt2_with_a_model_setting", path)


def test_a_model_setting_declared_in_one_line_is_checkpointed_resumed_and_fixed_by_pretrained_weights(
        with_a_model_setting, shards, tmp_path, capsys):
    main = with_a_model_setting.main
    args = TINY + ["--data", shards, "--max-steps", "2"]
    log = tmp_path / "log"
    code, _, err = run_main(args + ["--log-dir", log, "--dummy", "3"], capsys, main)
    assert code == 0, err
    assert load_ckpt(checkpoint_path(log, 2))["model_config"]["dummy"] == 3
    # resumed with another value: refused, naming it, as any other model setting is
    longer = args + ["--log-dir", log, "--max-steps", "3"]
    check_usage_error(*run_main(longer + ["--dummy", "4"], capsys, main), "dummy: checkpoint 3, flags 4")
    code, _, err = run_main(longer + ["--dummy", "3"], capsys, main)
    assert code == 0, err
    assert load_ckpt(checkpoint_path(log, 3))["model_config"]["dummy"] == 3
    # a trainer without the setting cannot know what the checkpoint's model computes: refused, not dropped
    check_usage_error(*run_main(args + ["--log-dir", log, "--max-steps", "4"], capsys),
                      "has model settings this train_gpt2.py does not know")
    # an export holds the model settings of its format only: the weights it holds are those of the new setting's
    # default, which --init-from DIR fixes, as OpenAI's weights do
    code, _, err = run_main(args + ["--log-dir", tmp_path / "plain"], capsys, main)
    assert code == 0, err
    export = tmp_path / "hf"
    code, _, err = run_main(["--log-dir", tmp_path / "plain", "--export-hf", export], capsys, main)
    assert code == 0, err
    for source, shapes in ((export, TINY), ("gpt2", [])):  # their own shapes
        tune = shapes + ["--data", shards, "--log-dir", tmp_path / "tuned", "--init-from", source, "--dummy", "3"]
        check_usage_error(*run_main(tune, capsys, main), f"--init-from {source} fixes --dummy 0, and the flags say "
                                                         f"--dummy 3; drop it")


# -----------------------------------------------------------------------------
# Values and errors that say where they come from


def test_model_given_as_a_flag_is_applied_whole_over_an_edited_size(edited, tmp_path, capsys, monkeypatch):
    """With n_layer edited to 2 in the file, --model gpt2-medium built 2 layers 1024 wide, and said nothing: the flag
    was half applied. Its sizes replace the file's, and say so; a size flag still wins."""
    monkeypatch.chdir(tmp_path)
    cfg, out = resolve(edited, ["--model", "gpt2-medium"], capsys)
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd) == (24, 16, 1024)
    assert ("--model gpt2-medium sets: --n-layer 24 (default: 2), --n-head 16 (default: 4), --n-embd 1024 (default: "
            "64)") in out
    cfg, out = resolve(edited, ["--model", "gpt2-medium", "--n-layer", "3"], capsys)
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd) == (3, 16, 1024) and "--n-layer 24" not in out
    cfg, out = resolve(edited, [], capsys)  # no --model: the file's edit is the choice
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd) == (8, 4, 128)  # the Shakespeare preset's, over it, as named


def test_eval_only_takes_the_checkpoints_batch_block_and_length_and_names_no_training_setting(tmp_path, capsys,
                                                                                              monkeypatch):
    """--eval-only of a finished run was refused for its --total-batch-size 128, not a multiple of the Shakespeare
    preset's micro-batch x --seq-len (8 x 128), none of which the user passed; with --seq-len 512 on a checkpoint
    of --block-size 512 it said `longer than the model's --block-size 256`, the preset's; and its first lines named
    the preset's training settings (--max-steps 900, --max-lr 0.002), which an evaluation does not read."""
    monkeypatch.chdir(tmp_path)  # no shards: the Shakespeare preset, as in the review
    train = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "512", "--seq-len", "32",
             "--batch-size", "4", "--total-batch-size", "128", "--val-tokens", "256", "--num-samples", "0",
             "--device", "cpu", "--max-steps", "1", "--log-dir", "l1"]
    code, _, err = run_main(train, capsys)
    assert code == 0, err
    evaluate = ["--eval-only", "--log-dir", "l1", "--device", "cpu", "--num-samples", "0", "--val-tokens", "2048"]
    for flags, seq_len in (([], 32), (["--seq-len", "512"], 512)):
        code, out, err = run_main(evaluate + flags, capsys)
        assert code == 0, err
        assert "| val loss" in out and f"validation tokens | micro-batch 8 x {seq_len}\n" in out, out
        for training in ("--max-steps", "--max-lr", "--warmup-steps", "--total-batch-size", "--eval-every"):
            assert training not in out, training
    # the step trained 128 tokens, not the Shakespeare preset's --total-batch-size
    assert [r["tokens"] for r in read_log(tmp_path / "l1") if r.get("eval_only")] == [128, 128]
    line = expect_usage_error(evaluate + ["--seq-len", "1024"], capsys)
    assert line == ("error: --seq-len 1024 is longer than the model's block of 512 tokens (--block-size 512, from the "
                    "checkpoint l1/ckpt_000001.pt); pass --seq-len 512 or less")


MEETING = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # torchrun's, by hand


@pytest.mark.parametrize("environment, fragments", [
    ({"WORLD_SIZE": "2"}, ["WORLD_SIZE=2 says this is one of 2 processes, but MASTER_ADDR and MASTER_PORT",
                           "start them with torchrun", "or unset WORLD_SIZE to run one process"]),
    ({"LOCAL_RANK": "x"}, ["LOCAL_RANK='x' in the environment is not a whole number", "unset it"]),
    ({"RANK": "²"}, ["RANK='²' in the environment is not a whole number"]),  # a digit to str.isdigit
    ({"RANK": " 0"}, ["RANK=' 0' in the environment is not a whole number"]),
    ({"RANK": "3", "WORLD_SIZE": "2"}, ["RANK=3 in the environment is not below WORLD_SIZE=2"]),
    ({"RANK": "1", "WORLD_SIZE": "1"}, ["RANK=1 in the environment is not below WORLD_SIZE=1"]),
    (dict(MEETING, MASTER_PORT="notaport"), ["MASTER_PORT='notaport' in the environment is not a port number (1 to "
                                             "65535)", "or unset WORLD_SIZE to run one process"]),
])
@pytest.mark.parametrize("command", [[], ["--export-hf", "hf"]])
def test_torchruns_variables_set_by_hand_are_refused_in_one_line(shards, tmp_path, capsys, monkeypatch, environment,
                                                                  fragments, command):
    """`WORLD_SIZE=2 python train_gpt2.py`, without torchrun, or LOCAL_RANK=x, RANK=² or MASTER_PORT=notaport,
    ended in a ValueError traceback; the line of RANK=' 0' read `RANK= 0`. An export (only rank 0 writes it) read RANK
    alone: RANK=² ended it in the same traceback, and the others went unchecked."""
    monkeypatch.chdir(tmp_path)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    expect_usage_error(TINY + ["--data", shards, "--log-dir", tmp_path / "log", *command], capsys, *fragments)
    assert not (tmp_path / "log").exists() and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("port", ["0", "65536", "70000"])
def test_a_master_port_out_of_range_is_refused_in_one_line(tmp_path, port):
    """MASTER_PORT=70000 or 65536 ended in torch's ValueError traceback, and MASTER_PORT=0 left rank 0 waiting the
    process group's hour, on a port of the system's choosing, for ranks that cannot know it. (A process: an in-process
    run would hang the tests where the check is missing.)"""
    env = dict(script_env(), **dict(MEETING, MASTER_PORT=port))
    result = run_command(script_command(TINY + ["--data", tmp_path, "--log-dir", tmp_path / "log"]), tmp_path, env,
                         timeout=60)
    check_usage_error(result.returncode, result.stdout, result.stderr,
                      f"MASTER_PORT='{port}' in the environment is not a port number (1 to 65535)",
                      "start the run with torchrun, which sets it (--master_port), or unset WORLD_SIZE")


def test_a_master_addr_that_does_not_resolve_is_refused_in_one_line(tmp_path):
    """Before, c10d retried it for the process group's hour, with its warnings and no line of the trainer's own."""
    env = dict(script_env(), **MEETING)
    env["MASTER_ADDR"] = "no-such-host.invalid"  # .invalid: a name reserved never to resolve
    result = run_command(script_command(TINY + ["--data", tmp_path, "--log-dir", tmp_path / "log"]), tmp_path, env,
                         timeout=60)
    check_usage_error(result.returncode, result.stdout, result.stderr,
                      "MASTER_ADDR='no-such-host.invalid' in the environment is no address this machine can resolve (",
                      "set it to rank 0's host name or IP address", "or unset WORLD_SIZE to run one process")
