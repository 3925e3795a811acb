"""--export-hf: a checkpoint of either recipe as a Hugging Face model directory, GPT-2's as GPT2LMHeadModel and the
modern recipe's as NanoChatForCausalLM. transformers, the independent reference, loads it offline as its own class:
its probabilities, its greedy decoding, its tokenizer and lm-evaluation-harness's scores must agree with
train_gpt2.py's, and --init-from DIR (and our from_pretrained) reads it back to the same weights and validation loss.
Mistakes are refused in one line, and an export cut short leaves nothing at OUT_DIR."""
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
import torch.nn.functional as F
from safetensors.torch import load_file

import test_pretrained
import train_gpt2
from evaluation import hellaswag
from helpers import (
    HARNESS_TASK,
    REPO,
    TINY,
    check_usage_error,
    checkpoint_path,
    expect_usage_error,
    load_ckpt,
    needs_muon,
    read_log,
    resolved,
    run_main,
    run_script_on_tmpfs,
    run_source,
    synthetic_examples,
    train_records,
    val_records,
    write_harness_task,
    write_jsonl,
    write_shards,
)
from machinery import checkpoint_commands, checkpoints, hf_format, model_card, presets, tokenizer
from machinery.errors import UsageError
from machinery.tokenizer import EOT, GPT2_VOCAB, gpt2_tokenizer
from train_gpt2 import GPT
from variations import modern

transformers = pytest.importorskip("transformers")  # a test dependency: CI installs it, training never needs it

gpt2_server = test_pretrained.gpt2_server  # the fixture serving a tiny stand-in for OpenAI's weights
PADDED = train_gpt2.PADDED_VOCAB
FILES = ["README.md", "config.json", "generation_config.json", "merges.txt", "model.safetensors",
         "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json", "vocab.json"]
INPUT = os.path.join(REPO, "input.txt")
STEPS = 6
# the tiny models trained on input.txt, with a padded vocabulary: GPT-2's 50257 real ids and 47 of padding
ON_INPUT = ["--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--block-size", "128", "--vocab-size", str(PADDED)]
BLOCK = 128  # the Shakespeare preset's --seq-len, which the README's --init-from lines take
RUN = ["--data", INPUT, "--batch-size", "4", "--seq-len", "32", "--total-batch-size", "256", "--val-tokens", "512",
       "--num-samples", "0", "--device", "cpu"]
CLASSES = {128: "GPT2LMHeadModel", "gpt2": "GPT2LMHeadModel", "modern": "NanoChatForCausalLM"}
ALL = [128, "gpt2", pytest.param("modern", marks=needs_muon)]
ON_INPUT_ONLY = ["gpt2", pytest.param("modern", marks=needs_muon)]
HELLASWAG_LABELS = [0, 1, 2, 3, 0, 1, 2]  # the 7 synthetic examples, every one shorter than the block


@pytest.fixture(scope="module")
def hellaswag_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("hellaswag") / "hellaswag_val.jsonl"
    write_jsonl(path, synthetic_examples(HELLASWAG_LABELS))
    return path


@pytest.fixture(scope="module")
def exports(tmp_path_factory, hellaswag_file):
    """Tiny models trained and exported, {name: (checkpoint path, export directory, what the export printed)}: 128,
    GPT-2's recipe on random ids below 128 for 3 steps, its directories typed with a trailing slash (as a shell
    completes them); "gpt2" and "modern", each recipe with a padded vocabulary trained for STEPS steps on input.txt
    (GPT-2's exported into an empty directory; the modern recipe's HellaSwag logged at its last step)."""
    root = tmp_path_factory.mktemp("export")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runs = {128: TINY + ["--data", write_shards(root / "data") + "/", "--max-steps", 3, "--checkpoint-every", 2,
                         "--eval-every", 3],
            "gpt2": ON_INPUT + RUN + ["--max-steps", STEPS, "--eval-every", STEPS, "--max-lr", 1e-2]}
    if hasattr(torch.optim, "Muon"):  # the modern recipe needs torch.optim.Muon
        runs["modern"] = runs["gpt2"][:-2] + ["--recipe", "modern", "--head-lr", 0.05, "--hellaswag-every", STEPS,
                                              "--hellaswag-file", hellaswag_file]
    made = {}
    try:
        for name, train in runs.items():
            log_dir, out = root / f"log_{name}", root / f"hf_{name}"
            train_gpt2.main([str(arg) for arg in train + ["--log-dir", log_dir]])
            if name == "gpt2":
                out.mkdir()
            printed = io.StringIO()
            slash = "/" if name == 128 else ""
            with contextlib.redirect_stdout(printed):  # a path in both forms
                train_gpt2.main(["--export-hf", f"{out}{slash}", f"--log-dir={log_dir}{slash}"])
            made[name] = checkpoint_path(log_dir, 3 if name == 128 else STEPS), str(out), printed.getvalue()
    finally:
        torch.set_num_threads(threads)
    return made


def ours(ckpt_path):
    return checkpoints.model_from_checkpoint(load_ckpt(ckpt_path), ckpt_path, train_gpt2.model_of).eval()


def theirs(out):
    """The export as transformers loads it: offline, by its config.json alone, as a class of its own."""
    return transformers.AutoModelForCausalLM.from_pretrained(out).eval()


@pytest.mark.parametrize("name", ALL)
def test_transformers_loads_its_own_class_and_computes_our_probabilities(exports, name):
    """On GPT-2's real ids (the padding rows are not exported), over the whole block, in float32: the next-token
    probabilities within 1e-5 (the logits too)."""
    ckpt, out, _ = exports[name]
    model, hf = ours(ckpt), theirs(out)
    assert type(hf).__name__ == CLASSES[name] and hf.dtype == torch.float32
    assert not [file for file in os.listdir(out) if file.endswith(".py")]  # no code of ours: not trust_remote_code
    n_tokens = model.n_tokens
    assert hf.config.vocab_size == n_tokens
    idx = torch.randint(0, n_tokens, (3, model.config.block_size), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = model(idx)[0][..., :n_tokens], hf(idx).logits
    assert got.shape == (3, model.config.block_size, n_tokens)
    assert (got.softmax(-1) - expected.softmax(-1)).abs().max().item() < 1e-5
    assert (got - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", ALL)
def test_the_exported_files(exports, name):
    ckpt_path, out, printed = exports[name]
    ckpt = load_ckpt(ckpt_path)
    n_tokens = 128 if name == 128 else GPT2_VOCAB
    assert sorted(os.listdir(out)) == FILES
    assert not [file for file in os.listdir(os.path.dirname(out)) if file.endswith(".tmp")]
    weights = load_file(os.path.join(out, "model.safetensors"))
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == [CLASSES[name]]
    if name == "modern":
        assert {key for key in weights if ".layers.1." in key} == {
            f"model.layers.1.{part}.weight" for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                         "self_attn.o_proj", "mlp.fc1", "mlp.fc2")}
        assert weights["model.embed_tokens.weight"].shape == weights["lm_head.weight"].shape == (n_tokens, 64)
        assert weights["model.layers.1.mlp.fc1.weight"].shape == (256, 64)  # nn.Linear's (out, in), as ours
        assert config["model_type"] == "nanochat" and (config["num_hidden_layers"], config["num_attention_heads"],
                                                       config["hidden_size"], config["max_position_embeddings"],
                                                       config["vocab_size"]) == (2, 4, 64, BLOCK, n_tokens)
        assert config["rms_norm_eps"] == torch.finfo(torch.float32).eps  # F.rms_norm's default in float32
        assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": modern.ROTARY_BASE}
        assert (config["final_logit_softcapping"], config["tie_word_embeddings"], config["pad_token_id"]) == (
            15.0, False, None)
    else:
        assert "lm_head.weight" not in weights  # tied to the token embedding
        assert weights["transformer.wte.weight"].shape == (n_tokens, 64)  # the padding rows dropped
        assert weights["transformer.h.1.attn.c_attn.weight"].shape == (64, 192)  # Conv1D's (in, out)
        assert weights["transformer.h.1.mlp.c_proj.weight"].shape == (256, 64)
        assert config["model_type"] == "gpt2" and (config["n_layer"], config["n_head"], config["n_embd"],
                                                   config["vocab_size"]) == (2, 4, 64, n_tokens)
    assert config["eos_token_id"] == (EOT if name != 128 else None)  # a vocabulary of 128 has no <|endoftext|>
    generation = json.load(open(os.path.join(out, "generation_config.json")))
    assert generation["max_length"] == ckpt["model_config"]["block_size"]  # transformers never samples past it
    mode = os.stat(os.path.join(out, "config.json")).st_mode
    assert os.stat(os.path.join(out, "model.safetensors")).st_mode == mode  # not safetensors' private file
    card = open(os.path.join(out, "README.md")).read()
    n_params = sum(t.numel() for t in weights.values())
    assert f"# {CLASSES[name]} from train_gpt2.py" in card
    assert f"{n_params:,} parameters" in card and "2 layers, 4 heads, width 64" in card
    steps = 3 if name == 128 else STEPS
    assert f"{steps * 256:,} tokens ({steps} steps of 256)" in card  # step x total_batch_size
    assert f"validation: {checkpoints.val_loss_in_words(ckpt)}" in card and "val loss" in card
    # hf upload publishes the card: the paths of this machine are named, not where they lay
    data = ckpt["train_config"]["data"]
    assert f" of {os.path.basename(os.path.normpath(data))}\n" in card and data not in card
    assert f"weights: the checkpoint {os.path.basename(ckpt_path)} (step " in card
    log_dir = os.path.basename(os.path.dirname(ckpt_path))
    assert f"`python train_gpt2.py --export-hf {os.path.basename(out)} --log-dir={log_dir}`" in card
    assert os.path.dirname(out) not in card
    assert (f"GPT-2's first {n_tokens} token ids" in card) == (name == 128)
    logged = [r for r in read_log(os.path.dirname(ckpt_path)) if "hellaswag_acc" in r]
    if name == "modern":  # measured at the exported step, and what transformers needs for the class
        assert (f"HellaSwag: acc_norm {logged[-1]['hellaswag_acc_norm']:.4f}, acc {logged[-1]['hellaswag_acc']:.4f} at "
                f"step {STEPS}") in card
        assert 'needs: transformers 5.0 or later' in card and "Load it in float32" in card
    else:
        assert not logged and "HellaSwag: not measured at these weights" in card and "needs:" not in card
    assert re.match(rf"exported {re.escape(ckpt_path)} to {re.escape(out)}/?: a {CLASSES[name]} of ", printed)


@pytest.mark.parametrize("name", [128, "gpt2"])
def test_our_from_pretrained_reads_the_export_back(exports, name):
    ckpt, out, _ = exports[name]
    expected, loaded = ours(ckpt).state_dict(), GPT.from_pretrained(out).state_dict()
    assert set(loaded) == set(expected)
    for key, tensor in expected.items():
        if key in ("transformer.wte.weight", "lm_head.weight"):
            tensor = tensor[:GPT2_VOCAB]  # the padding rows, never scored, are not exported
        assert torch.equal(loaded[key], tensor), key


@needs_muon
def test_the_modern_recipe_reads_its_export_back(exports):
    """modern.from_pretrained, of the model settings that the directory's config.json gives
    (presets.settings_of_export): the same weights, the padding rows left at zero."""
    ckpt, out, _ = exports["modern"]
    model_settings = presets.settings_of_export(out, train_gpt2.RECIPES)
    assert model_settings == dict(recipe="modern", n_layer=2, n_head=4, n_embd=64, block_size=BLOCK,
                                  vocab_size=GPT2_VOCAB, logit_softcap=15.0)
    padded = train_gpt2.GPTConfig(**dict(model_settings, vocab_size=PADDED))
    expected, loaded = ours(ckpt).state_dict(), modern.from_pretrained(out, padded).state_dict()
    assert set(loaded) == set(expected)
    for key, tensor in expected.items():
        if key in ("transformer.wte.weight", "lm_head.weight"):
            assert not loaded[key][GPT2_VOCAB:].any()
            loaded[key], tensor = loaded[key][:GPT2_VOCAB], tensor[:GPT2_VOCAB]
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
    expect_usage_error(argv[:1] + [tmp_path / "again"] + argv[2:3] + [out], capsys, f"--init-from {out} is a Hugging "
                       f"Face model directory already")


@pytest.mark.parametrize("config", [None, "[" * 200000 + "]" * 200000])
def test_our_from_pretrained_needs_the_config(exports, tmp_path, config):
    """A config.json missing, or nested too deep for json to parse (a RecursionError traceback before)."""
    copy = tmp_path / "no_config"
    shutil.copytree(exports[128][1], copy)
    os.remove(copy / "config.json")
    if config is not None:
        (copy / "config.json").write_text(config)
    with pytest.raises(UsageError, match=f"^{copy / 'config.json'}: not the config.json of a Hugging Face GPT-2"):
        GPT.from_pretrained(str(copy))


def greedy(model, prompt, new_tokens):
    """Our greedy continuation of prompt (1, P), each token predicted from all before it, no cache."""
    tokens = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            tokens = torch.cat([tokens, model(tokens)[0][:, -1:].argmax(-1)], dim=1)
    return tokens.tolist()


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("name", ALL)
def test_transformers_decodes_our_greedy_tokens(exports, name, use_cache):
    """Greedy decoding through transformers' generate, with its KV cache and without: our tokens, 64 of them with the
    prompt (16 for the model of 128 ids, whose prompt is "Hi!&", and a block of 32)."""
    ckpt, out, _ = exports[name]
    model, hf = ours(ckpt), theirs(out)
    if name == 128:
        prompt = torch.tensor([[39, 72, 0, 5]])
    else:
        prompt = torch.tensor([gpt2_tokenizer().encode_ordinary("ROMEO:\nWhat say")])
    new_tokens = (16 if name == 128 else 64) - prompt.size(1)
    with torch.no_grad():
        decoded = hf.generate(prompt, max_new_tokens=new_tokens, do_sample=False, use_cache=use_cache)
    assert decoded.tolist() == greedy(model, prompt, new_tokens)


def test_transformers_samples_from_the_export(exports):
    ckpt, out, _ = exports[128]
    with torch.no_grad():
        sampled = theirs(out).generate(torch.tensor([[39, 72, 0, 5]]), max_new_tokens=12, do_sample=True)
    assert sampled.shape == (1, 16) and sampled.max() < 128


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
    about = dict(model_card.published_facts("random weights"), command="python train_gpt2.py --export-hf hf/run1",
                 scores=[(b.NAME, b.card_line(None, published="random weights")) for b in train_gpt2.BENCHMARKS])
    gpt2 = train_gpt2.RECIPES["gpt2"].hf_format
    hf_format.export(out, gpt2, model.state_dict(), asdict(model.config), model.n_tokens, about)
    return out


def one_liner(text):
    """The Python of the transformers one-liner in a README: a `python -c '...'` line, or a ```python block."""
    python_c, block = r"python -c '(.*pipeline\(.*)'", r"```python\n(.*?pipeline\(.*?)```"
    return (re.search(python_c, text) or re.search(block, text, re.S)).group(1)


def test_the_model_cards_pipeline_runs_as_written(quick_start_export, capsys):
    """The exported model card's one-liner, with the export's path for the model's: it samples to the end of the
    model's context, not past it (transformers' pipeline would add 256 tokens to the prompt). The README's own
    one-liners are tests/test_readme.py's."""
    code = one_liner(open(os.path.join(quick_start_export, "README.md")).read())
    assert code.count('model="path/to/this/directory"') == 1, code
    torch.manual_seed(0)  # the sampling
    exec(code.replace("path/to/this/directory", quick_start_export), {})
    printed = capsys.readouterr().out
    assert "Hello, I" in printed and len(printed) > 500, printed  # 250 new tokens or so


# -----------------------------------------------------------------------------
# lm-evaluation-harness, and the way back (--init-from DIR)


@pytest.fixture(scope="module")
def harness(hellaswag_file, tmp_path_factory):
    """lm-evaluation-harness (None where it is not installed) and the directory of a task of it that gives it
    hellaswag_file's text as hellaswag.py does: each ending after its context and a space."""
    tasks = tmp_path_factory.mktemp("tasks")
    write_harness_task(tasks, hellaswag_file)
    with pytest.MonkeyPatch.context() as patch:
        for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # read when the datasets library is imported
            patch.setenv(name, "1")
        try:
            import lm_eval
            from lm_eval.tasks import TaskManager
        except ImportError:
            yield None, tasks
            return
        yield functools.partial(lm_eval.simple_evaluate, tasks=[HARNESS_TASK], device="cpu", log_samples=True,
                                task_manager=TaskManager(include_path=str(tasks), include_defaults=False)), tasks


def harness_way(hf, tokenizer, examples):
    """Each ending's log-likelihood, as lm-evaluation-harness computes it, with transformers: the context and the
    ending (" " + ending) encoded as one text, the context's tokens taken off the front, the ending's log-probabilities
    summed; acc picks the likeliest."""
    likelihoods = []
    for example in examples:
        context = tokenizer(example["ctx"])["input_ids"]
        row = []
        for ending in example["endings"]:
            whole = tokenizer(example["ctx"] + " " + ending)["input_ids"]
            with torch.no_grad():
                logits = hf(torch.tensor([whole[:-1]])).logits[0, len(context) - 1:]  # those that predict the ending
            log_probs = torch.log_softmax(logits.double(), dim=-1)
            row.append(log_probs.gather(1, torch.tensor(whole[len(context):])[:, None]).sum().item())
        likelihoods.append(row)
    return likelihoods


def accuracy(likelihoods, examples):
    right = [max(range(4), key=row.__getitem__) == example["label"] for row, example in zip(likelihoods, examples)]
    return sum(right) / len(examples)


@pytest.mark.parametrize("name", ON_INPUT_ONLY)
def test_lm_eval_scores_the_export_as_eval_only(exports, harness, hellaswag_file, name, tmp_path, capsys):
    """On a HellaSwag-format file: lm-evaluation-harness's acc of the export (its hf model, its task that file's),
    where it is installed, and the same computed its way with transformers, is --eval-only's
    acc of the checkpoint; each ending's log-likelihood ours."""
    ckpt, out, _ = exports[name]
    examples = synthetic_examples(HELLASWAG_LABELS)
    code, _, err = run_main(RUN + ["--eval-only", "--resume", ckpt, "--hellaswag-every", "1", "--hellaswag-file",
                                   hellaswag_file, "--log-dir", tmp_path], capsys)
    assert code == 0, err
    eval_only = read_log(tmp_path)[-1]["hellaswag_acc"]
    prepared = hellaswag.prepare(examples, gpt2_tokenizer(), BLOCK)
    assert prepared["tokens"].size(-1) < BLOCK  # whole: no context cut, which the harness would cut by one token less
    with torch.no_grad():
        sums, _ = hellaswag.ending_losses(ours(ckpt), prepared["tokens"], prepared["mask"])
    likelihoods = harness_way(theirs(out), transformers.AutoTokenizer.from_pretrained(out), examples)
    torch.testing.assert_close(torch.tensor(likelihoods, dtype=torch.double), -sums.double(), rtol=1e-5, atol=1e-4)
    assert accuracy(likelihoods, examples) == eval_only
    evaluate, _ = harness
    if evaluate is None:
        pytest.skip("lm-evaluation-harness is not installed (pip install \"lm_eval[hf]\"): checked with transformers")
    results = evaluate(model="hf", model_args=f"pretrained={out}")  # the README's lm_eval lines: tests/test_readme.py
    assert results["results"][HARNESS_TASK]["acc,none"] == eval_only
    samples = sorted(results["samples"][HARNESS_TASK], key=lambda sample: sample["doc_id"])
    hf_tokenizerlikelihoods = [[float(response[0][0]) for response in sample["resps"]] for sample in samples]
    torch.testing.assert_close(torch.tensor(hf_tokenizerlikelihoods, dtype=torch.double), -sums.double(), rtol=1e-5,
                               atol=1e-4)


@pytest.mark.parametrize("name", ON_INPUT_ONLY)
def test_init_from_the_export_starts_at_its_validation_loss(exports, name, tmp_path, capsys):
    """--init-from DIR, with no recipe or shape flags (GPT-2's: our whole export; the modern recipe's: config.json and
    model.safetensors alone, as the Hub holds such a model): the directory's recipe and shapes, and step 0's validation
    loss is the exported model's, the checkpoint's and transformers' own on the same tokens. Then it trains on (here at
    the recipe's rates for training from scratch). Its export's card names the directory it fine-tuned, not where it
    lay."""
    ckpt, out, _ = exports[name]
    if name == "modern":
        os.mkdir(tmp_path / "hub")
        for file in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(out, file), tmp_path / "hub")
        out = str(tmp_path / "hub")
    code, printed, err = run_main(RUN + ["--init-from", out, "--log-dir", tmp_path / "log", "--max-steps", "2",
                                         "--eval-every", "2"], capsys)
    assert code == 0, err
    assert f"\nfine-tuning the weights in {out} for 2 steps\n" in printed
    assert f"preset --init-from {out} (its config.json's recipe and shapes) sets" in printed
    assert ("--recipe modern (default: gpt2)" in printed) == (name == "modern")
    assert "(a flag overrides any of these but what --init-from fixes)" in printed  # those flags would be refused
    assert "--vocab-size" not in printed  # 50257 real rows, padded to the file's 50304
    val = val_records(read_log(tmp_path / "log"))
    assert val[0]["val_loss"] == pytest.approx(load_ckpt(ckpt)["val_loss"], abs=1e-6)
    tokens = gpt2_tokenizer().encode_ordinary(open(INPUT, encoding="utf-8").read())
    targets = torch.tensor(tokens[int(0.9 * len(tokens)):][:513])  # the validation tokens: the last 10%
    with torch.no_grad():
        logits = theirs(out)(targets[:-1].view(16, 32)).logits
    assert F.cross_entropy(logits.flatten(0, 1), targets[1:]).item() == pytest.approx(val[0]["val_loss"], abs=1e-5)
    assert sorted(train_records(read_log(tmp_path / "log"))) == [0, 1] and val[2]["val_loss"] != val[0]["val_loss"]
    code, _, err = run_main(["--export-hf", tmp_path / "hf", "--log-dir", tmp_path / "log"], capsys)
    assert code == 0, err
    card = (tmp_path / "hf" / "README.md").read_text()
    assert f" of input.txt, fine-tuning the weights in {os.path.basename(out)}\n" in card
    assert str(tmp_path) not in card


@needs_muon
def test_a_flag_that_contradicts_the_export_is_refused(exports, tmp_path, capsys):
    out = exports["modern"][1]
    expect_usage_error(RUN + ["--init-from", out, "--n-layer", "4", "--log-dir", tmp_path], capsys,
                       f"--init-from {out} fixes --n-layer 2, and the flags say --n-layer 4; drop it")
    expect_usage_error(RUN + ["--init-from", out, "--recipe", "gpt2", "--vocab-size", "128", "--log-dir", tmp_path],
                       capsys, "fixes --recipe modern, --vocab-size 50304 (", "and the flags say --recipe gpt2, "
                               "--vocab-size 128; drop them")
    # config.json says 50257, the error's 50304: it names both, and why they differ
    line = expect_usage_error(RUN + ["--init-from", out, "--vocab-size", "50257", "--log-dir", tmp_path], capsys)
    assert json.load(open(os.path.join(out, "config.json")))["vocab_size"] == 50257
    assert ("fixes --vocab-size 50304 (its config.json's 50257 tokens, padded with rows that are never predicted: "
            "such matmuls run faster), and the flags say --vocab-size 50257; drop it") in line
    assert os.listdir(tmp_path) == []


def test_a_preset_seq_len_longer_than_the_exports_block_is_fitted_and_a_flag_is_refused_naming_config_json(
        exports, shards, tmp_path, capsys, monkeypatch):
    """--init-from an export of --block-size 32 said `--seq-len 128 is longer than the model's --block-size 32`: the
    128 was the Shakespeare preset's (1024, the file's, with shards) and the 32 its config.json's, neither said. The
    --seq-len no flag gave is cut to the block, and said; one given is refused, naming config.json."""
    monkeypatch.chdir(tmp_path)  # no shards: the Shakespeare preset's --seq-len 128
    out, env = exports[128][1], train_gpt2.Env(0, 0, 1, "cpu", "cpu")
    origin = f"--block-size 32, from preset --init-from {out} (its config.json's recipe and shapes)"
    for data in ([], ["--data", shards]):
        capsys.readouterr()
        cfg = resolved(["--init-from", out, *data], env)
        assert cfg.seq_len == 32, data
        printed = capsys.readouterr().out
        assert f"the model's block of 32 tokens ({origin}) sets:" in printed, printed
        assert "--seq-len 32 (default: 1024)" in printed
    expect_usage_error(["--init-from", out, "--seq-len", "64", "--device", "cpu"], capsys,
                       f"--seq-len 64 is longer than the model's block of 32 tokens ({origin}); pass --seq-len 32 or "
                       f"less")


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
    out = exports["gpt2"][1]
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
    for hf_tokenizer in tokenizers:
        ids = hf_tokenizer(text)["input_ids"]
        assert ids == expected, type(hf_tokenizer)
        assert hf_tokenizer.decode(ids) == text, type(hf_tokenizer)
        assert hf_tokenizer.eos_token_id == EOT


def test_merges_are_recovered_from_the_ranks():
    """GPT-2's merges.txt opens with these, in this order."""
    merges = tokenizer.tokenizer_files(1024)["merges.txt"].splitlines()
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


def test_a_directory_named_scratch_here_is_no_init_from(exports, tmp_path, capsys, monkeypatch):
    """--init-from's default, scratch, is never a directory, even where one of that name is (HPC users keep one)."""
    ckpt, _, _ = exports[128]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "scratch").mkdir()
    code, out, err = run_main(["--export-hf", tmp_path / "hf", "--resume", ckpt], capsys)
    assert code == 0, err
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors")


def test_the_model_card_reads_hellaswag_past_a_damaged_log_line(tmp_path):
    """The run's log.jsonl beside a checkpoint, with a line cut short and a byte that is not UTF-8 (as plot.py skips
    them), still gives the HellaSwag record of the step; the checkpoint's path may end in a slash (a sharded one)."""
    record = {"step": 5, "hellaswag_acc_norm": 0.25, "hellaswag_acc": 0.5}
    (tmp_path / "log.jsonl").write_bytes(b'{"step": 5, "hellaswag_acc_norm": 0.9\n\xff\xfe{}\n' +
                                         json.dumps(record).encode() + b"\n")
    in_a_directory = str(tmp_path / "ckpt_000005.dcp") + "/"
    assert checkpoint_commands.logged_evaluation(in_a_directory, 5, "hellaswag_acc_norm") == record
    assert checkpoint_commands.logged_evaluation(str(tmp_path / "ckpt_000004.pt"), 4, "hellaswag_acc_norm") is None


def test_a_log_line_nested_too_deep_leaves_the_export_its_hellaswag(exports, tmp_path, capsys):
    """A damaged line of 200,000 ['s in the run's log.jsonl stopped --export-hf with a RecursionError traceback, and
    nothing was exported: the model card's reader of the log skips it, as plot.py does, and reads the rest."""
    ckpt, _, _ = exports[128]
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(ckpt, run / os.path.basename(ckpt))
    record = {"step": 3, "tokens": 768, "hellaswag_acc_norm": 0.25, "hellaswag_acc": 0.5}
    (run / "log.jsonl").write_text("[" * 200_000 + "]" * 200_000 + "\n" + json.dumps(record) + "\n")
    code, out, err = run_main(["--export-hf", tmp_path / "hf", "--log-dir", run], capsys)
    assert code == 0 and "Traceback" not in err, err
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "HellaSwag: acc_norm 0.2500, acc 0.5000 at step 3, as train_gpt2.py scores it" in card


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


def test_an_interrupted_export_leaves_nothing(exports, tmp_path, capsys, monkeypatch):
    """Ctrl-C after the weights are written: no OUT_DIR, and no temporary directory beside it."""
    def interrupted(block_size):
        raise KeyboardInterrupt

    monkeypatch.setattr(tokenizer, "tokenizer_files", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_main(["--export-hf", tmp_path / "hf", "--resume", exports[128][0]], capsys)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("size", ["1m", "256k"])
def test_a_full_disk_stops_the_export_in_one_line(exports, tmp_path, size):
    """A real file system that fills up halfway, in the tokenizer's files after the weights (1m), or in the weights
    (256k), whose SafetensorError named the errno in its text alone (a traceback): one line, and the disk holds
    nothing afterwards."""
    mount = tmp_path / "disk"
    out = mount / "hf"
    result = run_script_on_tmpfs(["--export-hf", out, "--resume", exports[128][0]], tmp_path, mount, f"size={size}")
    stdout, _, listing = result.stdout.rstrip("\n").rpartition("\n")
    line = check_usage_error(result.returncode, stdout, result.stderr, f"disk full writing {out}: ", "run the same")
    assert listing == "", line


SIGTERM_MIDWAY = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import train_gpt2
from machinery import tokenizer

def terminated(block_size):  # once the weights are written, as `kill PID` would
    os.kill(os.getpid(), signal.SIGTERM)
    raise AssertionError("the export went on after SIGTERM")

tokenizer.tokenizer_files = terminated
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
    out, tokenizer_files = tmp_path / "hf", tokenizer.tokenizer_files

    def another_export_finishes(block_size):
        out.mkdir()
        (out / "config.json").write_text("the other export's")
        return tokenizer_files(block_size)

    monkeypatch.setattr(tokenizer, "tokenizer_files", another_export_finishes)
    expect_usage_error(["--export-hf", out, "--resume", exports[128][0]], capsys, f"--export-hf {out}",
                       "not an empty directory")
    assert os.listdir(tmp_path) == ["hf"] and (out / "config.json").read_text() == "the other export's"


def test_under_torchrun_rank_0_alone_exports(exports, tmp_path, capsys, monkeypatch):
    """Each rank of `torchrun train_gpt2.py --export-hf OUT_DIR` (the variables are those torchrun sets): rank 1
    writes nothing and exits 0, whether it starts before rank 0 or after; rank 0 writes OUT_DIR."""
    argv = ["--export-hf", tmp_path / "hf", "--resume", exports[128][0]]
    for name, value in (("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    for rank, listing in (("1", []), ("0", ["hf"]), ("1", ["hf"])):
        monkeypatch.setenv("RANK", rank)
        code, printed, err = run_main(argv, capsys)
        assert (code, err) == (0, ""), (rank, err)
        assert (printed.startswith("exported") if rank == "0" else printed == "") and os.listdir(tmp_path) == listing
    assert sorted(os.listdir(tmp_path / "hf")) == FILES
