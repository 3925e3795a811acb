"""hellaswag.py: download, file checks, tokenizing, scoring against a hand computation, and evaluating a checkpoint
from the command line (train_gpt2.py --eval-only), in one process and in 2 ranks under torchrun."""
import contextlib
import functools
import json
import os
import re

import pytest
import torch

import train_gpt2
from evaluation import hellaswag
from helpers import (
    REPO,
    SYNTHETIC,
    expect_usage_error,
    read_log,
    run_main,
    run_script,
    serve_hellaswag,
    synthetic_examples,
    tiny_gpt,
    write_jsonl,
)
from machinery import checkpoints
from machinery.errors import UsageError
from machinery.tokenizer import EOT, gpt2_tokenizer

SCRIPTS = os.path.join(REPO, "tests", "scripts")


def tiny_model(seed=0, recipe="gpt2"):
    """A random 2-layer model; weights larger than at init, so that the losses differ clearly between endings."""
    model = tiny_gpt(block_size=64, n_head=2, n_embd=32, seed=seed, recipe=recipe)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5)
    return model.eval()


def hand_scores(model, enc, ctx, endings, block_size):
    """Summed and mean loss of each ending, one unpadded forward pass per ending, a loop over the ending tokens."""
    context = enc.encode_ordinary(ctx)
    sums, means = [], []
    for ending in endings:
        ending_tokens = enc.encode_ordinary(" " + ending)
        sequence = (context + ending_tokens)[-block_size:]
        with torch.no_grad():
            logits, _ = model(torch.tensor([sequence]))
        log_probs = torch.log_softmax(logits[0].double(), dim=-1)  # (T, V)
        total, count = 0.0, 0
        # position 0 has nothing before it to predict it from
        for position in range(max(len(sequence) - len(ending_tokens), 1), len(sequence)):
            total -= log_probs[position - 1, sequence[position]].item()
            count += 1
        sums.append(total)
        means.append(total / count)
    return sums, means


def argmin(values):
    return min(range(len(values)), key=lambda i: values[i])


def labelled_by_hand(model, enc, block_size):
    """
    Examples whose labels make the expected accuracies known: the hand acc_norm prediction is right for the
    even examples and wrong for the odd ones. Returns (examples, expected acc_norm, expected acc, hand scores).
    """
    scores = [hand_scores(model, enc, a + " " + b, endings, block_size) for a, b, endings in SYNTHETIC]
    for sums, means in scores:  # the test is only meaningful if float noise cannot flip a prediction
        assert sorted(means)[1] - sorted(means)[0] > 1e-3 and sorted(sums)[1] - sorted(sums)[0] > 1e-3
    labels = [(argmin(means) + i % 2) % 4 for i, (_, means) in enumerate(scores)]
    examples = synthetic_examples(labels)
    n = len(examples)
    acc_norm = sum(argmin(means) == label for (_, means), label in zip(scores, labels)) / n
    acc = sum(argmin(sums) == label for (sums, _), label in zip(scores, labels)) / n
    return examples, acc_norm, acc, scores


@pytest.mark.parametrize("block_size", [64, 12])  # 12: long examples lose context from the left
def test_download_then_scores_match_hand_computation(static_server, tmp_path, monkeypatch, block_size):
    model, enc = tiny_model(), gpt2_tokenizer()
    examples, expected_acc_norm, expected_acc, scores = labelled_by_hand(model, enc, block_size)
    serve_hellaswag(static_server, monkeypatch, examples)
    cache_dir = tmp_path / "cache"

    umask = os.umask(0o002)  # a group-shared cache: the file must be group-writable, not private (mkstemp's 0600)
    try:
        loaded = hellaswag.load_examples(cache_dir=str(cache_dir))
    finally:
        os.umask(umask)
    assert loaded == examples
    assert os.listdir(cache_dir) == ["hellaswag_val.jsonl"]  # no temp file left behind
    assert os.stat(cache_dir / "hellaswag_val.jsonl").st_mode & 0o777 == 0o664
    prepared = hellaswag.prepare(loaded, enc, block_size)
    N, _, L = prepared["tokens"].shape
    assert N == len(examples) and L <= block_size and prepared["mask"].shape == (N, 4, L)

    sum_loss, num_tokens = hellaswag.ending_losses(model, prepared["tokens"], prepared["mask"])  # (N, 4)
    hand_sums = torch.tensor([sums for sums, _ in scores], dtype=torch.float64)
    hand_means = torch.tensor([means for _, means in scores], dtype=torch.float64)
    torch.testing.assert_close(sum_loss.double(), hand_sums, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close((sum_loss / num_tokens).double(), hand_means, rtol=1e-5, atol=1e-4)

    # 7 examples: batches of 8 and of 3 both end in a padded partial batch
    for examples_per_batch in (8, 3):
        acc_norm, acc, n = hellaswag.evaluate(model, prepared, "cpu", contextlib.nullcontext(),
                                              examples_per_batch=examples_per_batch)
        assert (acc_norm, acc, n) == (expected_acc_norm, expected_acc, len(examples))
    assert expected_acc_norm == 4 / 7  # by construction, see labelled_by_hand

    # 3 ranks, one after the other, each keeping its own counts: together they count every example once
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op=None: None)
    per_rank = [hellaswag.evaluate(model, prepared, "cpu", contextlib.nullcontext(), rank, 3, examples_per_batch=2)
                for rank in range(3)]
    assert sum(n for _, _, n in per_rank) == len(examples)
    assert round(sum(a * n for a, _, n in per_rank)) == round(expected_acc_norm * len(examples))


def test_cached_file_is_reused(static_server, tmp_path, monkeypatch):
    examples = synthetic_examples([0] * len(SYNTHETIC))
    serve_hellaswag(static_server, monkeypatch, examples)
    assert hellaswag.load_examples(cache_dir=str(tmp_path / "cache")) == examples
    (static_server[0] / "hellaswag_val.jsonl").unlink()  # the server no longer has it: the cache must answer
    assert hellaswag.load_examples(cache_dir=str(tmp_path / "cache")) == examples


def test_failed_download_leaves_no_cache(static_server, tmp_path, monkeypatch):
    _, base_url = static_server  # serves nothing: 404
    monkeypatch.setenv("HELLASWAG_URL", base_url)
    with pytest.raises(UsageError, match="--hellaswag-file"):
        hellaswag.load_examples(cache_dir=str(tmp_path / "cache"))
    assert os.listdir(tmp_path / "cache") == []


@pytest.mark.parametrize("tail, reason", [
    ("", r"it has 6 examples, expected 7"),  # a mirror (HELLASWAG_URL) short of examples, or a cut-off download
    ('{"ctx": "truncated", "endi', r"line 7 is not valid JSON"),
])
def test_bad_download_is_refused_and_not_cached(static_server, tmp_path, monkeypatch, tail, reason):
    """7 examples expected; the server has the first 6, then tail."""
    serve_hellaswag(static_server, monkeypatch, synthetic_examples([0] * len(SYNTHETIC)))
    path = static_server[0] / "hellaswag_val.jsonl"
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:6]) + tail)
    url = re.escape(f"{static_server[1]}/hellaswag_val.jsonl")
    # the message names the URL, not the temp file it was checked in, which is gone
    with pytest.raises(UsageError, match=f"^downloaded {url} is not a valid HellaSwag file \\({reason}.*\\); "
                                                  f"nothing was cached; retry, or pass --hellaswag-file") as error:
        hellaswag.load_examples(cache_dir=str(tmp_path / "cache"))
    assert ".tmp" not in str(error.value)
    assert os.listdir(tmp_path / "cache") == []


def test_unusable_cache_dir_is_a_one_line_error(static_server, tmp_path, monkeypatch):
    serve_hellaswag(static_server, monkeypatch, synthetic_examples([0]))
    (tmp_path / "not_a_dir").write_text("")  # fails for root too, unlike a read-only directory
    cache_dir = tmp_path / "not_a_dir" / "cache"
    with pytest.raises(UsageError, match=f"cannot write to the cache directory {re.escape(str(cache_dir))} "
                                                  r"\(.*\); pass --cache-dir or set \$GPT2_CACHE_DIR"):
        hellaswag.load_examples(cache_dir=str(cache_dir))


@pytest.mark.parametrize("line, message", [
    ("not json", r"bad\.jsonl: line 2 is not valid JSON"),
    ('{"ctx": "a", "endings": ["b", "c", "d"], "label": 0}', r"bad\.jsonl: line 2 is not a HellaSwag example"),
    ('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 4}', r"bad\.jsonl: line 2 is not a HellaSwag example"),
    ("\udcff", r"bad\.jsonl: it is not UTF-8 text"),
    ("null", r"bad\.jsonl: line 2 is not a HellaSwag example"),  # JSON's null is a value, not a blank line
    # a RecursionError traceback, and true taken as label 1 (a bool is an int to Python)
    pytest.param("[" * 200_000 + "]" * 200_000, r"bad\.jsonl: line 2 is not valid JSON \(nested too deep to parse\)",
                 id="nested too deep"),
    pytest.param('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": true}',
                 r"bad\.jsonl: line 2 is not a HellaSwag example", id="label true"),
])
def test_bad_file_is_refused_with_its_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(synthetic_examples([0])[0]) + "\n" + line + "\n", errors="surrogateescape")
    with pytest.raises(UsageError, match=message + ".*; fix it, or pass --hellaswag-file"):
        hellaswag.load_examples(str(path))


def test_blank_lines_are_skipped_and_counted(tmp_path):
    """Lines of whitespace alone (a no-break space too) are no examples; the line a refusal names counts them."""
    good = [json.dumps(example) for example in synthetic_examples([0, 1])]
    path = tmp_path / "blank.jsonl"
    path.write_text("\n".join(["", good[0], "  \t", "\u00a0", good[1], "\r", "[]", ""]), encoding="utf-8")
    with pytest.raises(UsageError, match=r"blank\.jsonl: line 7 is not a HellaSwag example"):
        hellaswag.load_examples(str(path))
    path.write_text("\n".join(["", good[0], "  \t", "\u00a0", good[1], "\r\n"]), encoding="utf-8")
    assert [example["label"] for example in hellaswag.load_examples(str(path))] == [0, 1]


def test_cached_file_is_held_to_the_full_size(static_server, tmp_path, monkeypatch):
    """A cached file (an older download, a copy) is checked as a download is; the user's own --hellaswag-file is not."""
    monkeypatch.setenv("HELLASWAG_URL", static_server[1])  # serves nothing: the cache must answer
    path = tmp_path / "hellaswag_val.jsonl"
    write_jsonl(path, synthetic_examples([0, 1]))
    with pytest.raises(UsageError, match="it has 2 examples, expected 10042; delete it to download it again"):
        hellaswag.load_examples(cache_dir=str(tmp_path))
    assert len(hellaswag.load_examples(str(path))) == 2


def test_text_holding_endoftext_is_tokenized_as_text():
    """HellaSwag text holding "<|endoftext|>" stopped the evaluation with tiktoken's disallowed-special-token
    traceback: prepare() used encode, where the rest of the project uses encode_ordinary. It is text like any other:
    its ids are encode_ordinary's, and the end-of-text token 50256 is never among them (only the padding is)."""
    enc = gpt2_tokenizer()
    examples = synthetic_examples([2, 0])
    examples[0]["ctx"] = "A man types <|endoftext|> on a laptop."  # in the context
    examples[1]["endings"][3] = "writes<|endoftext|> on the board."  # in an ending, glued to a word
    prepared = hellaswag.prepare(examples, enc, 64)
    tokens, mask = prepared["tokens"], prepared["mask"]
    assert prepared["labels"].tolist() == [2, 0]
    for i, example in enumerate(examples):
        context = enc.encode_ordinary(example["ctx"])
        for j, ending in enumerate(example["endings"]):
            ending_tokens = enc.encode_ordinary(" " + ending)
            row = context + ending_tokens
            assert tokens[i, j, :len(row)].tolist() == row, (i, j)
            assert enc.decode(row) == example["ctx"] + " " + ending  # "<|endoftext|>" is there, as its characters
            assert mask[i, j, :len(row)].tolist() == [False] * len(context) + [True] * len(ending_tokens), (i, j)
            assert (tokens[i, j, len(row):] == EOT).all() and not mask[i, j, len(row):].any()  # the padding
            assert EOT not in row
    # the real text of the file, read and scored: no error, one score per example
    acc_norm, acc, n = hellaswag.evaluate(tiny_model(), prepared, "cpu", contextlib.nullcontext())
    assert n == 2 and 0 <= acc_norm <= 1 and 0 <= acc <= 1


# --eval-only's flags for the model of tiny_model(): a checkpoint is evaluated with the flags of the model it holds
TINY_MODEL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "64", "--device", "cpu",
              "--batch-size", "2", "--seq-len", "32", "--total-batch-size", "128", "--val-tokens", "64",
              "--num-samples", "0"]


def checkpoint_holding(model, shards, log_dir, capsys, *flags):
    """A checkpoint that train_gpt2.py wrote (a step of training on shards, with flags) in log_dir, holding model's
    weights."""
    code, _, err = run_main(TINY_MODEL + ["--data", shards, "--log-dir", log_dir, "--max-steps", "1", *flags], capsys)
    assert code == 0, err
    path = log_dir / "ckpt_000001.pt"
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    ckpt["model"] = model.state_dict()
    torch.save(ckpt, path)
    return path


def eval_only(checkpoint, shards, log_dir, *flags):
    """train_gpt2.py's flags that evaluate checkpoint on HellaSwag and stop."""
    return ["--eval-only", "--resume", checkpoint, "--hellaswag-every", "1", "--data", shards, "--log-dir", log_dir,
            *TINY_MODEL, *flags]


def test_eval_only_on_a_checkpoint_one_rank_and_two(shards, static_server, tmp_path, capsys):
    """train_gpt2.py --eval-only --resume CKPT --hellaswag-every 1 (once hellaswag.py's command line) on a checkpoint;
    under torchrun 2 ranks download once and count the same, with DDP and with --fsdp."""
    model, enc = tiny_model(), gpt2_tokenizer()
    examples, expected_acc_norm, expected_acc, _ = labelled_by_hand(model, enc, 64)
    log_dir = tmp_path / "log"
    checkpoint = checkpoint_holding(model, shards, log_dir, capsys)
    write_jsonl(tmp_path / "hellaswag_val.jsonl", examples)
    expected = (f"step     1 | hellaswag acc_norm {expected_acc_norm:.4f} acc {expected_acc:.4f} "
                f"({len(examples)} examples)")

    code, out, err = run_main(eval_only(checkpoint, shards, log_dir,
                                        "--hellaswag-file", tmp_path / "hellaswag_val.jsonl"), capsys)
    assert code == 0, err
    assert out.strip().splitlines()[-1] == expected
    logged = read_log(log_dir)[-1]
    assert (logged["hellaswag_acc_norm"], logged["hellaswag_acc"]) == (expected_acc_norm, expected_acc)
    assert logged["eval_only"] and logged["init_from"] == str(checkpoint) and logged["step"] == 1

    www, base_url = static_server
    write_jsonl(www / "hellaswag_val.jsonl", examples)
    # a download must hold these 7 examples, not the real file's 10042
    two_ranks = run_script([len(examples), *eval_only(checkpoint, shards, log_dir, "--cache-dir", tmp_path / "cache")],
                           cwd=tmp_path, nproc=2, timeout=120,
                           script=os.path.join(SCRIPTS, "train_with_small_hellaswag.py"), HELLASWAG_URL=base_url)
    assert two_ranks.returncode == 0, two_ranks.stderr
    assert two_ranks.stdout.strip().splitlines()[-1] == expected  # 7 examples: rank 0 scores 4, rank 1 scores 3
    assert two_ranks.stdout.count("downloading") == 1
    assert os.listdir(tmp_path / "cache") == ["hellaswag_val.jsonl"]
    logged = read_log(log_dir)[-1]  # rank 0 alone logs
    assert (logged["hellaswag_acc_norm"], logged["hellaswag_acc"]) == (expected_acc_norm, expected_acc)

    # --fsdp: the checkpoint's whole weights split over the 2 ranks, each lending its slices to the other's forward
    # passes, which both must run as often (4 examples and 3); the counts are the hand computation's all the same
    sharded = run_script([*eval_only(checkpoint, shards, log_dir, "--hellaswag-file", tmp_path / "hellaswag_val.jsonl",
                                     "--fsdp")], cwd=tmp_path, nproc=2, timeout=120)
    assert sharded.returncode == 0, sharded.stderr
    assert sharded.stdout.strip().splitlines()[-1] == expected


def test_failed_download_stops_both_ranks_with_one_line(shards, static_server, tmp_path, capsys):
    """Under torchrun, rank 1 waits for rank 0's download: when it fails, both ranks exit with its error line, not
    rank 1 with a traceback from the collective it was waiting in."""
    log_dir = tmp_path / "log"
    checkpoint = checkpoint_holding(tiny_model(), shards, log_dir, capsys)
    _, base_url = static_server  # serves nothing: 404, which fails at once (a refused connection is retried)
    result = run_script(eval_only(checkpoint, shards, log_dir, "--cache-dir", tmp_path / "cache"), cwd=tmp_path,
                        nproc=2, timeout=120, torchrun=True, HELLASWAG_URL=base_url)  # torchrun's report too
    assert result.returncode != 0
    # torchrun's own report of the failure follows the ranks' output; it has a traceback of torchrun's, not ours
    ranks_stderr = result.stderr.split("torch/distributed/elastic")[0]
    errors = [line for line in ranks_stderr.splitlines() if line.startswith("error:")]
    assert "Traceback" not in ranks_stderr and "[rank" not in result.stderr, result.stderr
    assert errors and len(errors) <= 2 and len(set(errors)) == 1, result.stderr
    assert errors[0].startswith(f"error: could not download {base_url}/hellaswag_val.jsonl (HTTP 404); ")
    assert "--hellaswag-file" in errors[0]
    assert re.search(r"Root Cause.*?exitcode\s*:\s*2\b", result.stderr, re.S), result.stderr
    assert os.listdir(tmp_path / "cache") == []


def test_compiled_model_compiles_once(tmp_path):
    """Fixed shapes: the padded partial last batch must not trigger a recompile."""
    from torch._dynamo.testing import CompileCounter
    model, enc = tiny_model(), gpt2_tokenizer()
    prepared = hellaswag.prepare(synthetic_examples([0] * len(SYNTHETIC)), enc, 64)
    expected = hellaswag.evaluate(model, prepared, "cpu", contextlib.nullcontext(), examples_per_batch=3)
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    assert hellaswag.evaluate(compiled, prepared, "cpu", contextlib.nullcontext(), examples_per_batch=3) == expected
    assert counter.frame_count == 1


def test_eval_only_errors_are_one_line(shards, tmp_path, capsys):
    log_dir = tmp_path / "log"
    checkpoint = checkpoint_holding(tiny_model(), shards, log_dir, capsys)
    for flags, culprit in [
        (eval_only(tmp_path / "missing.pt", shards, log_dir), "--resume"),
        (eval_only(checkpoint, shards, log_dir, "--hellaswag-file", tmp_path / "missing.jsonl"), "missing.jsonl"),
    ]:
        expect_usage_error(flags, capsys, culprit)  # exit code 2, one line "error: ...", no traceback


def test_trainer_logs_hellaswag_with_compile_on(tmp_path, monkeypatch):
    """--hellaswag-every in a training run with --compile: dynamo and AOTAutograd trace the model as for inductor
    (backend aot_eager, which generates no code: inductor took ~79 s on a CPU runner, aot_eager ~3 s more than eager);
    the logged numbers are those of the weights at that step."""
    examples = synthetic_examples([0, 1, 2, 3, 0, 1, 2])
    write_jsonl(tmp_path / "hellaswag_val.jsonl", examples)
    with open(os.path.join(REPO, "input.txt")) as f:
        (tmp_path / "text.txt").write_text(f.read(20000))
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    log_dir = tmp_path / "log"
    train_gpt2.main(["--data", str(tmp_path / "text.txt"), "--log-dir", str(log_dir), "--device", "cpu",
                     "--compile", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "64",
                     "--batch-size", "2", "--seq-len", "32", "--total-batch-size", "64", "--val-tokens", "64",
                     "--max-steps", "1", "--warmup-steps", "1", "--eval-every", "1", "--hellaswag-every", "1",
                     "--hellaswag-file", str(tmp_path / "hellaswag_val.jsonl"), "--num-samples", "0"])
    records = [json.loads(line) for line in (log_dir / "log.jsonl").read_text().splitlines()]
    logged = [r for r in records if "hellaswag_acc_norm" in r]
    assert [r["step"] for r in logged] == [0, 1]

    path = str(log_dir / "ckpt_000001.pt")
    model = checkpoints.model_from_checkpoint(checkpoints.load(path), path, train_gpt2.model_of)
    acc_norm, acc, n = hellaswag.evaluate(model, hellaswag.prepare(examples, gpt2_tokenizer(), 64), "cpu",
                                          contextlib.nullcontext())
    assert (logged[-1]["hellaswag_acc_norm"], logged[-1]["hellaswag_acc"], n) == (acc_norm, acc, 7)
