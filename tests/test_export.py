"""--export-hf: a checkpoint as a Hugging Face model directory. transformers, the independent reference, loads it
offline: its logits, its generate and its tokenizer must agree with train_gpt2.py's, and our from_pretrained reads it
back to the same weights. Mistakes are refused in one line, and an export cut short leaves nothing at OUT_DIR."""
import contextlib
import fcntl
import functools
import io
import json
import os
import re
import shutil
from dataclasses import asdict

import pytest
import torch
from safetensors.torch import load_file

import checkpoints
import hf_export
import test_pretrained
import train_gpt2
from helpers import (
    REPO,
    TINY,
    check_usage_error,
    checkpoint_path,
    expect_usage_error,
    load_ckpt,
    run_main,
    run_script_on_tmpfs,
    run_source,
    write_shards,
)
from plumbing import EOT, GPT2_VOCAB, UsageError, gpt2_tokenizer
from train_gpt2 import GPT

transformers = pytest.importorskip("transformers")  # a test dependency: CI installs it, training never needs it

gpt2_server = test_pretrained.gpt2_server  # the fixture serving a tiny stand-in for OpenAI's weights
PADDED = train_gpt2.PADDED_VOCAB
FILES = ["README.md", "config.json", "generation_config.json", "merges.txt", "model.safetensors",
         "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json", "vocab.json"]


@pytest.fixture(scope="module", autouse=True)
def tokenizer_files_made_once():
    """Recovering GPT-2's merges from its ranks takes seconds, and the tokenizer's files of a context length are the
    same for every export of these tests."""
    made = hf_export.tokenizer_files
    hf_export.tokenizer_files = functools.cache(made)
    yield
    hf_export.tokenizer_files = made


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Two tiny models trained 3 steps and exported, {vocab: (checkpoint path, export directory, what it printed)}:
    GPT-2's ids cut to 128 (the tests' vocabulary), and the padded 50304 (exported into an empty directory)."""
    root = tmp_path_factory.mktemp("export")
    shards = write_shards(root / "data")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    made = {}
    try:
        for vocab in (128, PADDED):
            log_dir, out = root / f"log{vocab}", root / f"hf{vocab}"
            train = TINY + ["--data", shards, "--log-dir", log_dir, "--vocab-size", vocab, "--max-steps", 3,
                            "--checkpoint-every", 2, "--eval-every", 3]
            train_gpt2.main([str(arg) for arg in train])
            if vocab == PADDED:
                out.mkdir()
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                train_gpt2.main(["--export-hf", str(out), "--log-dir", str(log_dir)])
            made[vocab] = checkpoint_path(log_dir, 3), str(out), printed.getvalue()
    finally:
        torch.set_num_threads(threads)
    return made


def ours(ckpt_path):
    return checkpoints.model_from_checkpoint(load_ckpt(ckpt_path), ckpt_path, train_gpt2.model_of).eval()


def theirs(out):
    return transformers.GPT2LMHeadModel.from_pretrained(out).eval()


@pytest.mark.parametrize("vocab", [128, PADDED])
def test_transformers_computes_our_logits(exports, vocab):
    ckpt, out, _ = exports[vocab]
    model, hf = ours(ckpt), theirs(out)
    n_tokens = min(vocab, GPT2_VOCAB)
    assert hf.config.vocab_size == n_tokens and hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    idx = torch.randint(0, n_tokens, (3, 32), generator=torch.Generator().manual_seed(0))  # the whole block
    with torch.no_grad():
        expected, got = model(idx)[0][..., :n_tokens], hf(idx).logits
    assert got.shape == (3, 32, n_tokens)
    assert (got - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("vocab", [128, PADDED])
def test_the_exported_files(exports, vocab):
    ckpt_path, out, printed = exports[vocab]
    ckpt = load_ckpt(ckpt_path)
    n_tokens = min(vocab, GPT2_VOCAB)
    assert sorted(os.listdir(out)) == FILES
    assert not [name for name in os.listdir(os.path.dirname(out)) if name.endswith(".tmp")]
    weights = load_file(os.path.join(out, "model.safetensors"))
    assert "lm_head.weight" not in weights  # tied to the token embedding
    assert weights["transformer.wte.weight"].shape == (n_tokens, 64)  # the padding rows dropped
    assert weights["transformer.h.1.attn.c_attn.weight"].shape == (64, 192)  # Conv1D's (in, out)
    assert weights["transformer.h.1.mlp.c_proj.weight"].shape == (256, 64)
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["model_type"] == "gpt2"
    assert (config["n_layer"], config["n_head"], config["n_embd"], config["n_positions"], config["vocab_size"]) == (
        2, 4, 64, 32, n_tokens)
    assert config["eos_token_id"] == (EOT if vocab == PADDED else None)  # a vocabulary of 128 has no <|endoftext|>
    generation = json.load(open(os.path.join(out, "generation_config.json")))
    assert generation["max_length"] == config["n_positions"]  # transformers never samples past the context
    mode = os.stat(os.path.join(out, "config.json")).st_mode
    assert os.stat(os.path.join(out, "model.safetensors")).st_mode == mode  # not safetensors' private file
    card = open(os.path.join(out, "README.md")).read()
    n_params = sum(t.numel() for t in weights.values())
    assert f"{n_params:,} parameters" in card and "2 layers, 4 heads, width 64" in card
    assert "768 tokens (3 steps of 256)" in card  # step x total_batch_size
    assert f"validation: {checkpoints.val_loss_in_words(ckpt)}" in card and "val loss" in card
    assert "HellaSwag: not recorded with these weights" in card
    assert f"`python train_gpt2.py --export-hf {out} --log-dir {os.path.dirname(ckpt_path)}`" in card
    assert (f"GPT-2's first {n_tokens} token ids" in card) == (vocab == 128)
    assert printed.startswith(f"exported {ckpt_path} to {out}")


@pytest.mark.parametrize("vocab", [128, PADDED])
def test_our_from_pretrained_reads_the_export_back(exports, vocab):
    ckpt, out, _ = exports[vocab]
    expected, loaded = ours(ckpt).state_dict(), GPT.from_pretrained(out).state_dict()
    assert set(loaded) == set(expected)
    for key, tensor in expected.items():
        if key in ("transformer.wte.weight", "lm_head.weight"):
            tensor = tensor[:GPT2_VOCAB]  # the padding rows, never scored, are not exported
        assert torch.equal(loaded[key], tensor), key


def test_openai_weights_export_as_they_were_published(gpt2_server, tmp_path, capsys):
    """--init-from gpt2 (a tiny stand-in, served): transformers computes what GPT-2's raw tensors do, in float64."""
    weights, _, _ = gpt2_server
    out = tmp_path / "hf"
    argv = ["--export-hf", out, "--init-from", "gpt2", "--cache-dir", tmp_path / "cache"]
    code, printed, err = run_main(argv, capsys)
    assert code == 0, err
    assert printed.splitlines()[-1].startswith(f"exported OpenAI's gpt2 to {out}")
    assert "- weights: OpenAI's gpt2, as published" in (out / "README.md").read_text()
    idx = torch.randint(0, GPT2_VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = theirs(out)(idx).logits
    torch.testing.assert_close(logits.double(), test_pretrained.reference_logits(weights, idx), rtol=1e-4, atol=1e-4)


def test_our_from_pretrained_needs_the_config(exports, tmp_path):
    copy = tmp_path / "no_config"
    shutil.copytree(exports[128][1], copy)
    os.remove(copy / "config.json")
    with pytest.raises(UsageError, match=f"^{copy / 'config.json'}: not the config.json of a Hugging Face GPT-2"):
        GPT.from_pretrained(str(copy))


def test_transformers_generates_from_the_export(exports):
    """Greedy decoding through transformers' KV cache gives our model's greedy tokens; sampling runs, as does the
    README's pipeline on GPT-2's whole vocabulary."""
    ckpt, out, _ = exports[128]
    model, hf = ours(ckpt), theirs(out)
    prompt = torch.tensor([[39, 72, 0, 5]])  # "Hi!&": ids below 128
    tokens = prompt
    with torch.no_grad():
        for _ in range(12):  # the prompt and 12 tokens: 16 of the block's 32
            tokens = torch.cat([tokens, model(tokens)[0][:, -1:].argmax(-1)], dim=1)
        assert hf.generate(prompt, max_new_tokens=12, do_sample=False).tolist() == tokens.tolist()
        sampled = hf.generate(prompt, max_new_tokens=12, do_sample=True)
    assert sampled.shape == (1, 16) and sampled.max() < 128
    generator = transformers.pipeline("text-generation", model=exports[PADDED][1], device="cpu")
    text = generator("Hello, I'm a language model,", max_new_tokens=8)[0]["generated_text"]
    assert text.startswith("Hello, I'm a language model,") and len(text) > len("Hello, I'm a language model,")


@pytest.fixture(scope="module")
def quick_start_export(tmp_path_factory):
    """An export of a model of the shapes the README's quick start trains (`python train_gpt2.py` without shards: the
    SHAKESPEARE preset, whose context of 256 tokens is shorter than the 256 new tokens transformers' pipeline adds),
    its weights random."""
    shapes = {key: train_gpt2.SHAKESPEARE[key] for key in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")}
    assert shapes == dict(n_layer=8, n_head=4, n_embd=128, block_size=256, vocab_size=GPT2_VOCAB)
    torch.manual_seed(0)
    model = train_gpt2.model_of(train_gpt2.GPTConfig(**shapes))
    out = str(tmp_path_factory.mktemp("quick_start") / "hf")
    about = dict(hf_export.published_facts("random weights"), command="python train_gpt2.py --export-hf hf/run1")
    hf_export.export(out, model.state_dict(), asdict(model.config), model.n_tokens, about)
    return out


def one_liner(text):
    """The Python of the transformers one-liner in a README: a `python -c '...'` line, or a ```python block."""
    python_c, block = r"python -c '(.*pipeline\(.*)'", r"```python\n(.*?pipeline\(.*?)```"
    return (re.search(python_c, text) or re.search(block, text, re.S)).group(1)


@pytest.mark.parametrize("readme, model_path", [("README.md", "hf/run1"), ("the model card", "path/to/this/directory")])
def test_the_readmes_pipeline_runs_as_written(quick_start_export, capsys, readme, model_path):
    """The one-liner of README.md and of the exported model card, with the export's path for the model's: it samples
    to the end of the model's context, not past it (transformers' pipeline would add 256 tokens to the prompt)."""
    text = open(os.path.join(REPO, "README.md") if readme == "README.md" else
                os.path.join(quick_start_export, "README.md")).read()
    code = one_liner(text)
    assert code.count(f'model="{model_path}"') == 1, code
    torch.manual_seed(0)  # the sampling
    exec(code.replace(model_path, quick_start_export), {})
    printed = capsys.readouterr().out
    assert "Hello, I" in printed and len(printed) > 500, printed  # 250 new tokens or so


MIXED_TEXT = (
    "Hello, world! It's 2024; we'll see. They're here, I'd say, you've got it, I'm sure.\n"
    "  Indented\tline\t\twith tabs,   runs of spaces    and trailing spaces   \n\n\n"
    "Numbers: 3.14159, 1,000,000, 007, 12345678901234567890, ½ ¾ ²³, ١٢٣٤.\n"
    "Accents: café, naïve, résumé, Ångström, São Paulo, Zürich, façade, jalapeño, crème brûlée.\n"
    "CJK: 你好，世界！日本語のテキスト、漢字とかな。한국어 텍스트입니다.\n"
    "Emoji: 🤖🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ (with ZWJ sequences and flags)\n"
    "Greek λόγος, Russian Привет мир, Hebrew שלום, Arabic مرحبا, Hindi नमस्ते, Thai สวัสดี.\n"
    "Code: def f(x):\n    return x**2 + 1  # comment\r\n}{][)(<>=!==/\\|&&||~`^%$#@\n"
    "end of one document.<|endoftext|>The next one starts here.<|endoftext|><|endoftext|> and  <|endoftext|>  spaced\n"
    "Odd: \u00a0non-breaking\u2009thin\u200bzero-width\ufeffbom, 'quotes' \"double\" “curly” ‘single’ — dash – en…\n"
)


def test_the_exported_tokenizer_encodes_as_ours(exports):
    """GPT-2's ids, <|endoftext|> included, from tokenizer.json (AutoTokenizer) and from vocab.json and merges.txt
    alone (the merges recovered from the ranks), on a few thousand characters; decoding gives the text back."""
    out = exports[PADDED][1]
    text = MIXED_TEXT + open(os.path.join(REPO, "input.txt")).read()[:3000] + MIXED_TEXT
    assert len(text) > 4000
    expected = gpt2_tokenizer().encode(text, allowed_special="all")
    assert expected.count(EOT) == 8
    bpe_only = os.path.join(os.path.dirname(out), "bpe_only")
    os.makedirs(bpe_only, exist_ok=True)
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(out, name), bpe_only)
    tokenizers = [transformers.AutoTokenizer.from_pretrained(out),
                  transformers.GPT2Tokenizer.from_pretrained(bpe_only)]  # transformers 5's GPT2Tokenizer is fast
    if int(transformers.__version__.split(".")[0]) < 5:  # transformers 4 still has the slow, pure-Python one
        tokenizers.append(transformers.AutoTokenizer.from_pretrained(out, use_fast=False))
    for tokenizer in tokenizers:
        ids = tokenizer(text)["input_ids"]
        assert ids == expected, type(tokenizer)
        assert tokenizer.decode(ids) == text, type(tokenizer)
        assert tokenizer.eos_token_id == EOT


def test_merges_are_recovered_from_the_ranks():
    """GPT-2's merges.txt opens with these, in this order."""
    merges = hf_export.tokenizer_files(1024)["merges.txt"].splitlines()
    assert merges[:8] == ["#version: 0.2", "Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "Ġt he"]
    assert len(merges) == 1 + 50000


# -----------------------------------------------------------------------------
# refusals, and an export cut short


def test_an_existing_directory_is_never_written_into(exports, tmp_path, capsys):
    ckpt, _, _ = exports[128]
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    expect_usage_error(["--export-hf", out, "--resume", ckpt], capsys, f"--export-hf {out}", "not an empty directory")
    assert os.listdir(out) == ["notes.txt"]
    (tmp_path / "a_file").write_text("")
    expect_usage_error(["--export-hf", tmp_path / "a_file", "--resume", ckpt], capsys, "--export-hf")


def test_an_unreadable_checkpoint_is_refused(tmp_path, capsys):
    bad = tmp_path / "ckpt_000002.pt"
    bad.write_bytes(os.urandom(4096))
    out = tmp_path / "hf"
    expect_usage_error(["--export-hf", out, "--resume", bad], capsys, "--resume", str(bad), "cannot load it")
    # in --log-dir, it is skipped with a warning, as a resumed run would, and then there is none left
    line = expect_usage_error(["--export-hf", out, "--log-dir", tmp_path], capsys, f"--log-dir {tmp_path}",
                              "no checkpoint")
    assert "--resume PATH" in line
    assert not os.path.exists(out) and sorted(os.listdir(tmp_path)) == ["ckpt_000002.pt"]


def test_no_checkpoint_in_the_log_dir(tmp_path, capsys):
    expect_usage_error(["--export-hf", tmp_path / "hf", "--log-dir", tmp_path / "nothing"], capsys,
                       f"--log-dir {tmp_path / 'nothing'}", "no checkpoint")
    assert not os.path.exists(tmp_path / "hf")


def test_a_model_gpt2s_format_cannot_hold_is_refused(tmp_path, capsys):
    """The modern recipe's model (rotary positions, RMSNorm, ReLU², an untied head): transformers would load the file
    as a GPT-2 that computes something else."""
    shards = write_shards(tmp_path / "data")
    code, _, err = run_main(TINY + ["--data", shards, "--log-dir", tmp_path / "log", "--max-steps", "1",
                                    "--recipe", "modern"], capsys)
    assert code == 0, err
    path = checkpoint_path(tmp_path / "log", 1)
    expect_usage_error(["--export-hf", tmp_path / "hf", "--log-dir", tmp_path / "log"], capsys, str(path),
                       "recipe modern", "GPT-2's Hugging Face format cannot hold")
    assert not os.path.exists(tmp_path / "hf")


def test_an_interrupted_export_leaves_nothing(exports, tmp_path, capsys, monkeypatch):
    """Ctrl-C after the weights are written: no OUT_DIR, and no temporary directory beside it."""
    def interrupted(block_size):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_export, "tokenizer_files", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_main(["--export-hf", tmp_path / "hf", "--resume", exports[128][0]], capsys)
    assert os.listdir(tmp_path) == []


def test_a_full_disk_stops_the_export_in_one_line(exports, tmp_path):
    """A real file system that fills up halfway (after the weights, in the tokenizer's files): one line, and the
    disk holds nothing afterwards."""
    mount = tmp_path / "disk"
    out = mount / "hf"
    result = run_script_on_tmpfs(["--export-hf", out, "--resume", exports[128][0]], tmp_path, mount, "size=1m")
    stdout, _, listing = result.stdout.rstrip("\n").rpartition("\n")
    line = check_usage_error(result.returncode, stdout, result.stderr, f"disk full writing {out}: ", "run the same")
    assert listing == "", line


SIGTERM_MIDWAY = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import hf_export, train_gpt2

def terminated(block_size):  # once the weights are written, as `kill PID` would
    os.kill(os.getpid(), signal.SIGTERM)
    raise AssertionError("the export went on after SIGTERM")

hf_export.tokenizer_files = terminated
train_gpt2.main(sys.argv[2:])
"""


def test_sigterm_stops_an_export_as_ctrl_c_does(exports, tmp_path):
    """`kill PID` midway: no OUT_DIR, no temporary directory beside it, and the exit code a shell gives a process that
    SIGTERM killed (143), without a traceback."""
    result = run_source(SIGTERM_MIDWAY, tmp_path, ["--export-hf", tmp_path / "hf", "--resume", exports[128][0]])
    assert result.returncode == 128 + 15, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    assert os.listdir(tmp_path) == ["script.py"]


def test_a_killed_exports_directory_is_removed_by_the_next(exports, tmp_path, capsys):
    """What `kill -9` leaves beside OUT_DIR, a temporary directory with files in it that no process locks, is deleted
    by the next export to OUT_DIR; the directory of an export still running (locked, as it locks its own) stays, as
    does an empty one (an export starting, which has yet to lock it) and what is not an export's to OUT_DIR."""
    names = {"killed": "hf.0123abcd.tmp", "running": "hf.4567cdef.tmp", "starting": "hf.89abcdef.tmp",
             "another OUT_DIR's": "hf2.0123abcd.tmp", "not an export's": "hf.notes.tmp"}
    for what, name in names.items():
        (tmp_path / name).mkdir()
        if what != "starting":
            (tmp_path / name / "model.safetensors").write_bytes(b"half")
    running = os.open(tmp_path / names["running"], os.O_RDONLY)
    try:
        fcntl.flock(running, fcntl.LOCK_EX)
        code, printed, err = run_main(["--export-hf", tmp_path / "hf", "--resume", exports[128][0]], capsys)
    finally:
        os.close(running)
    assert code == 0, err
    assert sorted(os.listdir(tmp_path)) == sorted(["hf"] + [name for what, name in names.items() if what != "killed"])
    assert sorted(os.listdir(tmp_path / "hf")) == FILES
    assert printed.startswith(f"removed {tmp_path / names['killed']}, left by an export to {tmp_path / 'hf'}")


def test_an_export_that_finishes_first_wins(exports, tmp_path, capsys, monkeypatch):
    """Two exports to one OUT_DIR at once: the one that renames its directory second is refused in one line, and
    leaves the other's whole."""
    out, tokenizer_files = tmp_path / "hf", hf_export.tokenizer_files

    def another_export_finishes(block_size):
        out.mkdir()
        (out / "config.json").write_text("the other export's")
        return tokenizer_files(block_size)

    monkeypatch.setattr(hf_export, "tokenizer_files", another_export_finishes)
    expect_usage_error(["--export-hf", out, "--resume", exports[128][0]], capsys, f"--export-hf {out}",
                       "not an empty directory")
    assert os.listdir(tmp_path) == ["hf"] and (out / "config.json").read_text() == "the other export's"


def test_under_torchrun_rank_0_alone_exports(exports, tmp_path, capsys, monkeypatch):
    """Each rank of `torchrun train_gpt2.py --export-hf OUT_DIR` (RANK is what torchrun sets): rank 1 writes nothing
    and exits 0, whether it starts before rank 0 or after; rank 0 writes OUT_DIR."""
    argv = ["--export-hf", tmp_path / "hf", "--resume", exports[128][0]]
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, listing in (("1", []), ("0", ["hf"]), ("1", ["hf"])):
        monkeypatch.setenv("RANK", rank)
        code, printed, err = run_main(argv, capsys)
        assert (code, err) == (0, ""), (rank, err)
        assert (printed.startswith("exported") if rank == "0" else printed == "") and os.listdir(tmp_path) == listing
    assert sorted(os.listdir(tmp_path / "hf")) == FILES
