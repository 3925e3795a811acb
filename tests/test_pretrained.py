"""--init-from: OpenAI's GPT-2 weights in the Hugging Face layout, downloaded, mapped, and checked against a
forward pass written out on the raw tensors. The file is a tiny random model written by the test and served
from 127.0.0.1, so nothing here needs the network. Also --init-from DIR, a directory of Hugging Face's format as the
Hub has them, and the refusals of what neither recipe computes."""
import contextlib
import http.server
import json
import math
import os
import re
import signal
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

import train_gpt2
from evaluation import hellaswag
from helpers import (
    REPO,
    expect_usage_error,
    run_main,
    run_script,
    serve_hellaswag,
    serving,
    start_script,
    synthetic_examples,
    write_jsonl,
)
from machinery import downloads
from machinery.errors import UsageError
from machinery.tokenizer import gpt2_tokenizer

N_LAYER, N_HEAD, N_EMBD, BLOCK_SIZE = 2, 2, 32, 1024  # OpenAI's files always have 1024 positions
HALF = 4 * downloads.DOWNLOAD_CHUNK  # bytes a stalled download has when it is stopped


def hf_gpt2_weights(seed=0):
    """Random weights in the layout of openai-community/gpt2's model.safetensors: no 'transformer.' prefix,
    Conv1D weights stored (in, out), 50257 token rows, no lm_head, and the causal-mask buffers h.N.attn.bias."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, std=0.2):
        return torch.randn(*shape, generator=generator) * std

    C = N_EMBD
    weights = {"wte.weight": randn(50257, C), "wpe.weight": randn(BLOCK_SIZE, C),
               "ln_f.weight": 1 + randn(C), "ln_f.bias": randn(C)}
    for i in range(N_LAYER):
        weights.update({
            f"h.{i}.ln_1.weight": 1 + randn(C), f"h.{i}.ln_1.bias": randn(C),
            f"h.{i}.attn.c_attn.weight": randn(C, 3 * C), f"h.{i}.attn.c_attn.bias": randn(3 * C),
            f"h.{i}.attn.c_proj.weight": randn(C, C), f"h.{i}.attn.c_proj.bias": randn(C),
            f"h.{i}.attn.bias": torch.tril(torch.ones(BLOCK_SIZE, BLOCK_SIZE)).view(1, 1, BLOCK_SIZE, BLOCK_SIZE),
            f"h.{i}.ln_2.weight": 1 + randn(C), f"h.{i}.ln_2.bias": randn(C),
            f"h.{i}.mlp.c_fc.weight": randn(C, 4 * C), f"h.{i}.mlp.c_fc.bias": randn(4 * C),
            f"h.{i}.mlp.c_proj.weight": randn(4 * C, C), f"h.{i}.mlp.c_proj.bias": randn(C),
        })
    return weights


def reference_logits(w, idx):
    """GPT-2's forward pass on the raw tensors, in float64: Conv1D is x @ W + b, GELU the tanh approximation."""
    w = {k: v.double() for k, v in w.items()}
    B, T = idx.shape
    C, hs = N_EMBD, N_EMBD // N_HEAD

    def layer_norm(x, name):
        mean = x.mean(dim=-1, keepdim=True)
        var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-5) * w[name + ".weight"] + w[name + ".bias"]

    def conv1d(x, name):
        return x @ w[name + ".weight"] + w[name + ".bias"]

    def gelu(x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    x = w["wte.weight"][idx] + w["wpe.weight"][:T]  # (B, T, C)
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    for i in range(N_LAYER):
        q, k, v = conv1d(layer_norm(x, f"h.{i}.ln_1"), f"h.{i}.attn.c_attn").split(C, dim=-1)
        q, k, v = (t.view(B, T, N_HEAD, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(hs)).masked_fill(future, float("-inf"))  # (B, nh, T, T)
        y = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, T, C)
        x = x + conv1d(y, f"h.{i}.attn.c_proj")
        x = x + conv1d(gelu(conv1d(layer_norm(x, f"h.{i}.ln_2"), f"h.{i}.mlp.c_fc")), f"h.{i}.mlp.c_proj")
    return layer_norm(x, "ln_f") @ w["wte.weight"].T  # (B, T, 50257): the output layer is the token embedding


def openai_gpt2(**kwargs):
    return train_gpt2.GPT.from_pretrained("gpt2", **kwargs)


@pytest.fixture
def gpt2_server(static_server, monkeypatch):
    """Serves the tiny weights as openai-community/gpt2, whose size preset is shrunk to match."""
    www, base_url = static_server
    weights = hf_gpt2_weights()
    path = www / "openai-community" / "gpt2" / "resolve" / "main" / "model.safetensors"
    path.parent.mkdir(parents=True)
    save_file(weights, str(path), metadata={"format": "pt"})
    monkeypatch.setitem(train_gpt2.MODEL_SIZES, "gpt2", dict(n_layer=N_LAYER, n_head=N_HEAD, n_embd=N_EMBD))
    monkeypatch.setenv("HF_ENDPOINT", base_url)
    return weights, path, static_server.log


def test_loaded_model_matches_direct_computation(gpt2_server, tmp_path):
    weights, served, _ = gpt2_server
    model = openai_gpt2(cache_dir=str(tmp_path / "cache")).eval()
    idx = torch.randint(0, 50257, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, _ = model(idx)
    expected = reference_logits(weights, idx)
    assert logits.shape == (2, 24, 50304) and expected.shape == (2, 24, 50257)
    torch.testing.assert_close(logits[..., :50257].double(), expected, rtol=1e-4, atol=1e-4)
    assert torch.all(logits[..., 50257:] == float("-inf"))  # the padding rows, out of the softmax

    served.unlink()  # the second load reads the cached copy
    cached = openai_gpt2(cache_dir=str(tmp_path / "cache")).eval()
    with torch.no_grad():
        assert torch.equal(cached(idx)[0], logits)


def test_missing_weights_are_a_one_line_error(gpt2_server, tmp_path):
    gpt2_server[1].unlink()  # the hub answers 404
    with pytest.raises(UsageError, match="could not download .*HF_ENDPOINT"):
        openai_gpt2(cache_dir=str(tmp_path / "cache"))
    assert not os.listdir(tmp_path / "cache" / "gpt2")  # no file, and no temp file either


def test_truncated_download_is_not_cached(gpt2_server, static_server, tmp_path):
    _, served, _ = gpt2_server
    served.write_bytes(served.read_bytes()[:-1000])  # a connection that dropped near the end
    url = re.escape(f"{static_server[1]}/openai-community/gpt2/resolve/main/model.safetensors")
    with pytest.raises(UsageError, match=f"^downloaded {url} is not a valid safetensors file \\(.+\\); "
                                                  f"nothing was cached; retry, or set HF_ENDPOINT"):
        openai_gpt2(cache_dir=str(tmp_path / "cache"))
    assert not os.listdir(tmp_path / "cache" / "gpt2")
    assert len(static_server.log) == 2  # fetched afresh once: a file that fails its check may be damaged on the way


def test_a_download_cut_twice_resumes_where_it_stopped_and_says_each_retry(gpt2_server, static_server, tmp_path,
                                                                            capsys, monkeypatch):
    """The connection drops mid-body twice. Each retry asks for the bytes still missing (Range) and says so; the
    weights arrive whole, and no byte is sent twice. The retries wait nothing here (1 s, then doubling, by default)."""
    _, served, _ = gpt2_server
    monkeypatch.setattr(downloads, "RETRYING", downloads.Retrying(delay=0))
    url = f"{static_server[1]}/openai-community/gpt2/resolve/main/model.safetensors"
    chunk = downloads.DOWNLOAD_CHUNK  # whole chunks: what arrived before each drop is all written, so all kept
    static_server.cut["/openai-community/gpt2/resolve/main/model.safetensors"] = [3 * chunk, 5 * chunk]
    openai_gpt2(cache_dir=str(tmp_path / "cache"))
    assert static_server.ranges == [None, f"bytes={3 * chunk}-", f"bytes={8 * chunk}-"]
    assert os.listdir(tmp_path / "cache" / "gpt2") == ["model.safetensors"]  # no temp file left
    assert (tmp_path / "cache" / "gpt2" / "model.safetensors").read_bytes() == served.read_bytes()
    retries = [line for line in capsys.readouterr().out.splitlines() if "retry" in line]
    # progress made before each drop: each is the first retry of a new failure
    assert len(retries) == 2 and all(line.startswith(f"{url}: ") and line.endswith(
        "; retry 1 of 10 in 0 s; giving up after 10 retries, 0 s of waiting in all") for line in retries), retries


def test_an_endpoint_without_its_scheme_fails_at_once(tmp_path, capsys, monkeypatch):
    """HF_ENDPOINT=hf-mirror.com, without https://: no retry would mend it, so none is made, and one line says why."""
    monkeypatch.setattr(downloads, "RETRYING", downloads.Retrying(delay=0))
    monkeypatch.setenv("HF_ENDPOINT", "hf-mirror.com")
    with pytest.raises(UsageError, match=r"^could not download hf-mirror\.com/openai-community/gpt2/resolve/main/"
                                         r"model\.safetensors \(Invalid URL .*\); set HF_ENDPOINT to a mirror"):
        openai_gpt2(cache_dir=str(tmp_path / "cache"))
    assert "retry" not in capsys.readouterr().out
    assert not os.listdir(tmp_path / "cache" / "gpt2")


def test_too_few_token_rows_are_refused(gpt2_server, tmp_path):
    """A wte with fewer than GPT-2's 50257 rows would leave the other tokens' embeddings at zero."""
    weights, served, _ = gpt2_server
    save_file({**weights, "wte.weight": weights["wte.weight"][:50000]}, str(served), metadata={"format": "pt"})
    with pytest.raises(UsageError, match=r"transformer\.wte\.weight has shape \(50000, 32\), expected \(50257, 32\)"):
        openai_gpt2(cache_dir=str(tmp_path / "cache"))


def test_hf_token_goes_to_the_hub_only(gpt2_server, static_server, tmp_path, monkeypatch):
    www, base_url = static_server
    monkeypatch.setenv("HF_TOKEN", "secret")
    serve_hellaswag(static_server, monkeypatch, synthetic_examples([0, 1]))
    openai_gpt2(cache_dir=str(tmp_path / "cache"))
    hellaswag.load_examples(cache_dir=str(tmp_path / "cache"))
    assert static_server.log == [("/openai-community/gpt2/resolve/main/model.safetensors", "Bearer secret"),
                              ("/hellaswag_val.jsonl", None)]


def test_eval_only_init_from_gpt2_prints_its_hellaswag_accuracy(gpt2_server, tmp_path, capsys):
    """train_gpt2.py --eval-only --init-from gpt2 --hellaswag-every 1 (once hellaswag.py's command line): the last line
    is the HellaSwag accuracy of OpenAI's weights."""
    examples = synthetic_examples([0, 1, 2, 3, 0, 1, 2])
    write_jsonl(tmp_path / "hellaswag_val.jsonl", examples)
    cache_dir = str(tmp_path / "cache")
    model = openai_gpt2(cache_dir=cache_dir)
    prepared = hellaswag.prepare(examples, gpt2_tokenizer(), model.config.block_size)
    acc_norm, acc, n = hellaswag.evaluate(model, prepared, "cpu", contextlib.nullcontext())

    code, out, err = run_main(["--eval-only", "--init-from", "gpt2", "--cache-dir", cache_dir, "--hellaswag-every", "1",
                               "--hellaswag-file", tmp_path / "hellaswag_val.jsonl", "--device", "cpu",
                               "--data", os.path.join(REPO, "input.txt"), "--log-dir", tmp_path / "log",
                               "--batch-size", "2", "--seq-len", "64", "--total-batch-size", "128",
                               "--val-tokens", "128", "--num-samples", "0"], capsys)
    assert code == 0, err
    assert out.strip().splitlines()[-1] == (
        f"step     0 | hellaswag acc_norm {acc_norm:.4f} acc {acc:.4f} ({n} examples)")


def test_ctrl_c_during_the_download_is_one_line_and_caches_nothing(tmp_path, monkeypatch):
    """Ctrl-C while OpenAI's weights download (from a server that sends half the file, then waits): one line that
    says so, exit 2, no traceback, and no part of the file left in the cache."""
    sent, finish = threading.Event(), threading.Event()

    class HalfThenWait(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(2 * HALF))
            self.end_headers()
            self.wfile.write(bytes(HALF))
            self.wfile.flush()
            sent.set()
            finish.wait(60)

        def log_message(self, *args):
            pass

    cache, out = tmp_path / "cache", tmp_path / "out.txt"
    with serving(http.server.ThreadingHTTPServer(("127.0.0.1", 0), HalfThenWait)) as server:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        monkeypatch.setenv("HF_ENDPOINT", url)
        training = start_script(["--init-from", "gpt2", "--cache-dir", cache, "--device", "cpu"], tmp_path, out)
        try:
            assert sent.wait(60), out.read_text()
            deadline = time.time() + 60
            while not [p for p in (cache / "gpt2").glob("*.tmp") if p.stat().st_size == HALF]:  # all of it written
                assert time.time() < deadline and training.poll() is None, out.read_text()
                time.sleep(0.01)
            training.send_signal(signal.SIGINT)
            training.wait(60)
        finally:
            finish.set()
    lines = out.read_text().strip().splitlines()
    assert training.returncode == 2 and "Traceback" not in out.read_text(), lines
    assert lines[-1] == f"error: stopped by Ctrl-C while downloading {url}/openai-community/gpt2/resolve/main/" \
                        f"model.safetensors; nothing was cached, and the same command downloads it again"
    assert os.listdir(cache / "gpt2") == []


def test_eval_only_that_cannot_download_gpt2_says_so_in_one_line(gpt2_server, tmp_path):
    """`python train_gpt2.py --eval-only --init-from gpt2` (once `python hellaswag.py --init-from gpt2`) with no hub to
    reach (an offline node): one line, not a traceback. Run as a script, train_gpt2 is __main__: the UsageError of the
    download, raised in machinery/downloads.py, must be the class its main catches (hellaswag.py's script once raised
    another)."""
    gpt2_server[1].unlink()  # the hub answers 404
    write_jsonl(tmp_path / "hellaswag_val.jsonl", synthetic_examples([0, 1]))
    result = run_script(["--eval-only", "--init-from", "gpt2", "--cache-dir", tmp_path / "cache", "--device", "cpu",
                         "--hellaswag-every", "1", "--hellaswag-file", tmp_path / "hellaswag_val.jsonl"], tmp_path,
                        HF_ENDPOINT=os.environ["HF_ENDPOINT"])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: could not download "), result.stderr
    assert "HF_ENDPOINT" in result.stderr.strip().splitlines()[-1]


def test_eval_only_init_from_gpt2_logs_the_reference(gpt2_server, tmp_path, monkeypatch):
    """What plot.py draws as GPT-2's lines: an --eval-only --init-from gpt2 run's val loss and HellaSwag, each
    checked against the served weights: the val loss against the float64 forward pass on the raw tensors."""
    examples = synthetic_examples([0, 1, 2, 3, 0, 1, 2])
    write_jsonl(tmp_path / "hellaswag_val.jsonl", examples)
    monkeypatch.setenv("GPT2_CACHE_DIR", str(tmp_path / "cache"))
    log_dir = tmp_path / "log"
    train_gpt2.main(["--init-from", "gpt2", "--eval-only", "--data", os.path.join(REPO, "input.txt"),
                     "--log-dir", str(log_dir), "--device", "cpu", "--no-compile", "--batch-size", "2",
                     "--seq-len", "64", "--total-batch-size", "128", "--val-tokens", "256", "--num-samples", "0",
                     "--hellaswag-every", "1", "--hellaswag-file", str(tmp_path / "hellaswag_val.jsonl")])
    records = [json.loads(line) for line in (log_dir / "log.jsonl").read_text().splitlines()]
    assert all(r["eval_only"] is True and r["init_from"] == "gpt2" for r in records)
    val_loss = next(r["val_loss"] for r in records if "val_loss" in r)
    weights = gpt2_server[0]
    with open(os.path.join(REPO, "input.txt"), encoding="utf-8") as f:
        tokens = gpt2_tokenizer().encode_ordinary(f.read())
    val = torch.tensor(tokens[int(0.9 * len(tokens)):][:257])  # the last 10% validates: its first 256 targets
    logits = reference_logits(weights, val[:-1].view(4, 64))  # (4, 64, 50257) float64
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), val[1:]).item()
    assert val_loss == pytest.approx(expected, rel=1e-5)

    model = openai_gpt2()  # the logged HellaSwag is that of the loaded weights
    prepared = hellaswag.prepare(examples, gpt2_tokenizer(), 1024)
    acc_norm, acc, n = hellaswag.evaluate(model, prepared, "cpu", contextlib.nullcontext())
    logged = next(r for r in records if "hellaswag_acc_norm" in r)
    assert (logged["hellaswag_acc_norm"], logged["hellaswag_acc"]) == (acc_norm, acc)


def test_fine_tuning_starts_from_the_loaded_weights(gpt2_server, tmp_path, monkeypatch):
    """`python train_gpt2.py --init-from gpt2` with no shards fine-tunes on tiny Shakespeare at the gentle rate,
    and its first loss is that of the served weights on the first batch."""
    monkeypatch.chdir(tmp_path)  # no edu_fineweb10B/ here
    monkeypatch.setenv("GPT2_CACHE_DIR", str(tmp_path / "cache"))
    train_gpt2.main(["--init-from", "gpt2", "--max-steps", "2", "--device", "cpu", "--no-compile", "--batch-size", "1",
                     "--total-batch-size", "128", "--val-tokens", "256", "--num-samples", "0"])
    records = [json.loads(line) for line in (tmp_path / "log" / "log.jsonl").read_text().splitlines()]
    first = next(r for r in records if r.get("step") == 0 and "train_loss" in r)
    assert first["lr"] == pytest.approx(3e-5)  # the fine-tuning preset's peak; 2 steps leave no room for its warmup
    with open(os.path.join(REPO, "input.txt"), encoding="utf-8") as f:
        tokens = torch.tensor(gpt2_tokenizer().encode_ordinary(f.read())[:129])  # the first batch
    logits = reference_logits(gpt2_server[0], tokens[:-1].view(1, 128))
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[1:]).item()
    assert first["train_loss"] == pytest.approx(expected, rel=1e-5)


# -----------------------------------------------------------------------------
# --init-from DIR: a directory of Hugging Face's format, as the Hub holds one (tests/test_export.py: our exports)

HUB_GPT2_CONFIG = {  # openai-community/gpt2's config.json, of the tiny model's shapes
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1, "bos_token_id": 50256,
    "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2", "n_ctx": BLOCK_SIZE, "n_embd": N_EMBD, "n_head": N_HEAD, "n_layer": N_LAYER,
    "n_positions": BLOCK_SIZE, "resid_pdrop": 0.1, "summary_activation": None, "summary_first_dropout": 0.1,
    "summary_proj_to_labels": True, "summary_type": "cls_index", "summary_use_proj": True, "vocab_size": 50257,
}
# a NanoChatForCausalLM's, as ours are written, of a model the modern recipe computes
NANOCHAT_CONFIG = {
    "architectures": ["NanoChatForCausalLM"], "model_type": "nanochat", "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 2, "hidden_size": 32, "intermediate_size": 128,
    "max_position_embeddings": 64, "vocab_size": 50257, "hidden_act": "relu2",
    "rms_norm_eps": torch.finfo(torch.float32).eps, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "final_logit_softcapping": 15.0, "tie_word_embeddings": False,
}


def hub_directory(path, config, weights=None):
    """A model directory as the Hub has them: config.json and model.safetensors, nothing of ours."""
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if weights is None:
        open(os.path.join(path, "model.safetensors"), "wb").close()  # the refusals never read it
    else:
        save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def test_eval_only_init_from_a_hub_directory_computes_gpt2s_loss(tmp_path):
    """--eval-only --init-from DIR, a GPT-2 of the Hub's format (its causal-mask buffers and Conv1D layout, dropout
    settings and all): the validation loss of the float64 forward pass on the raw tensors, its 50257 rows padded."""
    weights = hf_gpt2_weights()
    directory = hub_directory(tmp_path / "hub", HUB_GPT2_CONFIG, weights)
    log_dir = tmp_path / "log"
    train_gpt2.main(["--init-from", directory, "--eval-only", "--data", os.path.join(REPO, "input.txt"),
                     "--log-dir", str(log_dir), "--device", "cpu", "--batch-size", "2", "--seq-len", "64",
                     "--total-batch-size", "128", "--val-tokens", "256", "--num-samples", "0"])
    record = [json.loads(line) for line in (log_dir / "log.jsonl").read_text().splitlines()][-1]
    assert record["eval_only"] is True and record["init_from"] == directory
    with open(os.path.join(REPO, "input.txt"), encoding="utf-8") as f:
        tokens = gpt2_tokenizer().encode_ordinary(f.read())
    val = torch.tensor(tokens[int(0.9 * len(tokens)):][:257])
    logits = reference_logits(weights, val[:-1].view(4, 64))
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), val[1:]).item()
    assert record["val_loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("config, fragments", [
    (dict(NANOCHAT_CONFIG, model_type="llama"), ["model_type 'llama', a model no recipe of train_gpt2.py computes",
                                                 "gpt2 (--recipe gpt2), nanochat (--recipe modern)"]),
    (dict(NANOCHAT_CONFIG, num_key_value_heads=1), ["num_key_value_heads is 1, and train_gpt2.py's modern recipe "
                                                    "has 2"]),
    (dict(NANOCHAT_CONFIG, rms_norm_eps=1e-6), ["rms_norm_eps is 1e-06", "edit config.json to 1.1920928955078125e-07"]),
    (dict(NANOCHAT_CONFIG, final_logit_softcapping=None), ["final_logit_softcapping is None", "soft-caps its logits"]),
    (dict(NANOCHAT_CONFIG, vocab_size=65536), ["vocab_size 65536 is not GPT-2's vocabulary", "GPT-2's BPE"]),
    (dict(NANOCHAT_CONFIG, hidden_size=34, intermediate_size=136),  # with weights: rotate's RuntimeError
     ["hidden_size 34 / num_attention_heads 2 = head size 17", "rotary positions", "needs an even head size"]),
    (dict(HUB_GPT2_CONFIG, activation_function="relu"), ["activation_function is 'relu', and train_gpt2.py's GPT-2 "
                                                         "has 'gelu_new'"]),
    (dict(HUB_GPT2_CONFIG, tie_word_embeddings=False), ["tie_word_embeddings is False"]),
])
def test_a_directory_neither_recipe_computes_is_refused(tmp_path, capsys, config, fragments):
    """In one line that names config.json and the field, before any data is read."""
    directory = hub_directory(tmp_path / "hub", config)
    expect_usage_error(["--init-from", directory, "--log-dir", tmp_path / "log", "--device", "cpu"], capsys,
                       os.path.join(directory, "config.json"), *fragments)
    assert not os.path.exists(tmp_path / "log")


def test_init_from_what_is_neither_a_name_nor_an_export_is_refused(tmp_path, capsys):
    """Training, and --export-hf before it downloads anything (argparse's choices refused such a name once)."""
    for command in ([], ["--export-hf", tmp_path / "hf", "--cache-dir", tmp_path / "cache"]):
        expect_usage_error(["--init-from", "gpt3", "--log-dir", tmp_path / "log", *command], capsys, "--init-from "
                           "gpt3: no such directory, nor an OpenAI model name; pass scratch, one of gpt2, gpt2-medium")
        assert os.listdir(tmp_path) == []
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text(json.dumps(NANOCHAT_CONFIG))
    expect_usage_error(["--init-from", tmp_path / "half", "--log-dir", tmp_path / "log"], capsys,
                       f"--init-from {tmp_path / 'half'}: it holds no model.safetensors")
    expect_usage_error(["--init-from", "", "--log-dir", tmp_path / "log"], capsys, "--init-from is empty")


def changed(config, **fields):
    return {**config, **fields}


@pytest.mark.parametrize("config, fragments", [
    (changed(HUB_GPT2_CONFIG, n_layer="2"), ['n_layer is "2", not a positive whole number']),
    (changed(HUB_GPT2_CONFIG, n_layer=2.0), ["n_layer is 2.0, not a positive whole number"]),
    (changed(HUB_GPT2_CONFIG, n_embd=None), ["n_embd is null, not a positive whole number"]),
    (changed(HUB_GPT2_CONFIG, n_head=0), ["n_head is 0, not a positive whole number"]),
    (changed(HUB_GPT2_CONFIG, n_layer=0), ["n_layer is 0, not a positive whole number"]),
    (changed(HUB_GPT2_CONFIG, n_positions=True), ["n_positions is true, not a positive whole number"]),
    (changed(HUB_GPT2_CONFIG, vocab_size=True), ["vocab_size true is not GPT-2's vocabulary"]),
    (changed(HUB_GPT2_CONFIG, n_head=3), ["n_embd 32 is not a multiple of n_head 3"]),
    (changed(NANOCHAT_CONFIG, num_attention_heads=0), ["num_attention_heads is 0, not a positive whole number"]),
    (changed(NANOCHAT_CONFIG, num_attention_heads="2"), ['num_attention_heads is "2", not a positive whole number']),
    (changed(NANOCHAT_CONFIG, num_hidden_layers=0), ["num_hidden_layers is 0, not a positive whole number"]),
    (changed(NANOCHAT_CONFIG, hidden_size=None), ["hidden_size is null, not a positive whole number"]),
    (changed(NANOCHAT_CONFIG, num_attention_heads=3), ["hidden_size 32 is not a multiple of num_attention_heads 3"]),
    (changed(NANOCHAT_CONFIG, rope_parameters=[1, 2]), ['rope_parameters is [1, 2], not an object such as '
                                                        '{"rope_type": "default", "rope_theta": 10000.0}']),
])
def test_a_config_field_of_the_wrong_type_or_value_is_named(tmp_path, capsys, config, fragments):
    """config.json's shapes of the wrong JSON type ended in tracebacks (TypeError, ZeroDivisionError, AttributeError);
    a 0 was replaced by --model gpt2's 12 and then reported as missing tensors; heads that do not divide the width
    were reported as flags the user never passed (--n-embd 32 must be a multiple of --n-head 3). One line names the
    file, the field and its value, as JSON writes it."""
    directory = hub_directory(tmp_path / "hub", config)
    line = expect_usage_error(["--init-from", directory, "--log-dir", tmp_path / "log", "--device", "cpu"], capsys,
                              os.path.join(directory, "config.json"), *fragments)
    assert "--n-" not in line
    assert not os.path.exists(tmp_path / "log")


@pytest.mark.parametrize("config", [HUB_GPT2_CONFIG, NANOCHAT_CONFIG, "gpt2"])
def test_a_model_flag_that_contradicts_init_from_is_refused(tmp_path, capsys, config):
    """--model gpt2-medium with --init-from was silently ignored, the weights' shapes taken: refused, as any other
    flag that contradicts the shapes the weights fix."""
    init_from = config if config == "gpt2" else hub_directory(tmp_path / "hub", config)
    fixed = "--n-layer 12, --n-head 12, --n-embd 768" if config == "gpt2" else \
        "--n-layer 2, --n-head 2, --n-embd 32"
    expect_usage_error(["--init-from", init_from, "--model", "gpt2-medium", "--log-dir", tmp_path / "log",
                        "--cache-dir", tmp_path / "cache", "--device", "cpu"], capsys,
                       f"--init-from {init_from} fixes {fixed}, and --model gpt2-medium says --n-layer 24, --n-head "
                       f"16, --n-embd 1024; drop --model")
    assert sorted(os.listdir(tmp_path)) == ([] if config == "gpt2" else ["hub"])
