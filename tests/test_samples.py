"""Samples are printed for a person to read: the decoded text as it is, line breaks and all, each sample under a
header line and the last followed by an end line; never as a Python string literal. And they are as long as asked:
a context longer than the block slides its window, the prompt kept whole and every new token sampled."""
import contextlib
import re

import pytest
import torch

import train_gpt2
from helpers import (
    SAMPLE_HEADER,
    TINY,
    VOCAB,
    checkpoint_path,
    expect_usage_error,
    printed_samples,
    read_log,
    run_main,
    run_script,
    tiny_gpt,
    train_records,
    val_records,
)
from train_gpt2 import TrainConfig, generate


def test_samples_print_as_text_with_real_line_breaks(shards, tmp_path, capsys):
    """A prompt of three lines (a play's speakers) comes back as three lines at the start of every sample, printed at
    each evaluation; a control character the model might sample (here, in the prompt) shows as its symbol."""
    args = TINY + ["--data", shards, "--log-dir", tmp_path / "log", "--vocab-size", "50304", "--max-steps", "2",
                   "--eval-every", "2", "--num-samples", "3", "--max-new-tokens", "6",
                   "--prompt", "ROMEO:\nJULIET:\nNURSE:\x1b[2J"]
    code, out, err = run_main(args, capsys)
    assert code == 0 and err == "", err
    samples = printed_samples(out)
    assert [(i, n, step) for i, n, step, _ in samples] == [(1, 3, 0), (2, 3, 0), (3, 3, 0),
                                                            (1, 3, 2), (2, 3, 2), (3, 3, 2)]
    assert len(re.findall(SAMPLE_HEADER, out, re.M)) == 6 and out.count("\n--- end of samples ---\n") == 2
    for *_, text in samples:
        lines = text.split("\n")
        assert lines[:2] == ["ROMEO:", "JULIET:"] and lines[2].startswith("NURSE:␛[2J")
        assert len(text) > len("ROMEO:\nJULIET:\nNURSE:␛[2J")
    shown = out[out.index("--- sample"):]  # the first lines give the flag's value as typed, quoted
    assert "\\n" not in shown and "\x1b" not in shown and "'ROMEO" not in shown and '"ROMEO' not in shown  # no literals
    assert sorted(val_records(read_log(tmp_path / "log"))) == [0, 2]
    # each evaluation's samples follow its validation line, and end before training goes on
    val_line = out.index("step     0 | val loss")
    first_sample, end = out.index("--- sample 1/3 (step 0) ---"), out.index("--- end of samples ---")
    assert val_line < first_sample < end < out.index("step     0/2 | loss")


# -----------------------------------------------------------------------------
# a context longer than the block: the window slides, and every requested token is sampled


class IdsAsText:
    """A tokenizer whose text is the token ids, space-separated: a printed sample's tokens can be counted exactly."""

    def encode_ordinary(self, text):
        return [int(word) for word in text.split()]

    def decode(self, tokens):
        return " ".join(map(str, tokens))


def test_a_prompt_longer_than_the_block_is_kept_whole_and_every_new_token_is_sampled():
    """20 prompt tokens into 8 positions, and 5 new ones asked for: all 25 come back, the prompt first and whole (the
    fault: the prompt was cut to its last 7 tokens and the 5 new tokens to 1, without a word)."""
    model = tiny_gpt(vocab_size=VOCAB, block_size=8).eval()
    prompt = list(range(3, 23))
    out = generate(model, prompt, 2, 5, torch.Generator().manual_seed(0))
    assert [len(row) for row in out] == [25, 25]
    assert all(row[:20] == prompt for row in out)
    assert all(0 <= token < VOCAB for row in out for token in row[20:])


@pytest.mark.parametrize("prompt_length", [3, 8, 20])  # shorter than the block of 8, as long, longer
def test_samples_say_in_one_line_when_the_prompt_outgrows_the_block(prompt_length, capsys):
    """print_samples prints every sample whole, the prompt and all --max-new-tokens, and says so in one line before
    them when the prompt is longer than the block (each token is then sampled from the last block_size before it);
    a prompt that fits gets no such line."""
    model = tiny_gpt(vocab_size=VOCAB, block_size=8).eval()
    prompt = list(range(3, 3 + prompt_length))
    cfg = TrainConfig(prompt=" ".join(map(str, prompt)), num_samples=2, max_new_tokens=5)
    capsys.readouterr()
    train_gpt2.print_samples(model, cfg, IdsAsText(), "cpu", contextlib.nullcontext(), 0, 7, rows=2)
    out, err = capsys.readouterr()
    assert err == ""
    before_samples = out[: out.index("--- sample 1/2 (step 7) ---")].splitlines()
    if prompt_length > 8:
        assert len(before_samples) == 1, out
        assert "outgrow" in before_samples[0] and re.search(r"\b20\b.*\b8\b", before_samples[0]), out
    else:
        assert before_samples == [], out
    samples = printed_samples(out)
    assert [(i, n, step) for i, n, step, _ in samples] == [(1, 2, 7), (2, 2, 7)]
    for *_, text in samples:
        tokens = [int(word) for word in text.split()]
        assert len(tokens) == prompt_length + 5 and tokens[:prompt_length] == prompt, text


def test_block_size_1_trains_and_samples_every_requested_token(shards, tmp_path, capsys, monkeypatch):
    """--block-size 1 (and --seq-len 1): one position, so every new token is sampled from the one before it. It trains,
    evaluates and prints its samples whole, no traceback (the fault: the prompt cut to its last 0 tokens was [-0:],
    all of it, and sampling ended in an IndexError past the position table)."""
    calls = []  # (enc, prompt tokens, samples) of each print_samples
    real_print_samples, real_generate = train_gpt2.print_samples, train_gpt2.generate

    def spy_print_samples(model, cfg, enc, *args, **kwargs):
        calls.append([enc])
        return real_print_samples(model, cfg, enc, *args, **kwargs)

    def spy_generate(model, prompt_tokens, *args, **kwargs):
        samples = real_generate(model, prompt_tokens, *args, **kwargs)
        calls[-1] += [list(prompt_tokens), samples]
        return samples

    monkeypatch.setattr(train_gpt2, "print_samples", spy_print_samples)
    monkeypatch.setattr(train_gpt2, "generate", spy_generate)
    args = TINY + ["--data", shards, "--log-dir", tmp_path / "log", "--block-size", "1", "--seq-len", "1",
                   "--total-batch-size", "4", "--vocab-size", "50304", "--max-steps", "2", "--num-samples", "2",
                   "--max-new-tokens", "5", "--prompt", "Hello, I'm a language model,"]
    code, out, err = run_main(args, capsys)
    assert code == 0 and err == "", err
    assert "Traceback" not in out + err
    records = read_log(tmp_path / "log")
    assert sorted(train_records(records)) == [0, 1] and sorted(val_records(records)) == [2]
    assert len(calls) == 1  # the final evaluation's samples
    enc, prompt, samples = calls[0]
    assert prompt == enc.encode_ordinary("Hello, I'm a language model,") and len(prompt) == 8
    assert [len(row) for row in samples] == [8 + 5, 8 + 5] and all(row[:8] == prompt for row in samples)
    printed = printed_samples(out)
    assert [(i, n, step) for i, n, step, _ in printed] == [(1, 2, 2), (2, 2, 2)]
    assert [text for *_, text in printed] == [enc.decode(row).translate(train_gpt2.CONTROL_SYMBOLS) for row in samples]
    outgrow = [line for line in out.splitlines() if "outgrow" in line]
    assert len(outgrow) == 1 and re.search(r"\b8\b.*\b1\b", outgrow[0]), out


def sample_without_a_cache(model, prompt, num_samples, max_new_tokens, generator, top_k=50):
    """generate() written naively: each new token from the logits of the last block_size tokens, recomputed from
    scratch, with no KV cache; top-k sampling as generate's, drawing from the same generator."""
    tokens = torch.tensor(prompt).repeat(num_samples, 1)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            probs = model(tokens[:, -model.config.block_size:])[0][:, -1].float().softmax(-1)
            top_probs, top_ids = probs.topk(min(top_k, probs.size(-1)), dim=-1)
            next_ids = top_ids.gather(-1, torch.multinomial(top_probs, 1, generator=generator))
            tokens = torch.cat([tokens, next_ids], dim=1)
    return tokens.tolist()


@pytest.mark.parametrize("attn", ["sdpa", "naive"])
@pytest.mark.parametrize("prompt_length", [1, 3, 8, 20])
def test_the_sliding_window_samples_what_the_last_block_without_a_cache_gives(attn, prompt_length):
    """30 new tokens in a block of 8: generate's KV cache fills, then its window slides on, and every token must be
    the one a model without a cache samples from the last 8 tokens before it, with the same seed."""
    model = tiny_gpt(vocab_size=VOCAB, block_size=8, attn=attn).eval()
    prompt = [(7 * i + 5) % VOCAB for i in range(prompt_length)]
    sampled = generate(model, prompt, 3, 30, torch.Generator().manual_seed(7))
    assert sampled == sample_without_a_cache(model, prompt, 3, 30, torch.Generator().manual_seed(7))
    assert all(len(row) == prompt_length + 30 and row[:prompt_length] == prompt for row in sampled)
    assert len(set(map(tuple, sampled))) > 1  # really sampled


def test_under_torchrun_sample_prints_once(shards, tmp_path, capsys):
    """torchrun ... --sample: rank 0 alone prints the checkpoint's line and its samples (every rank printed them)."""
    args = TINY + ["--data", shards, "--log-dir", tmp_path / "log", "--vocab-size", "50304", "--max-steps", "1"]
    assert run_main(args, capsys)[0] == 0
    result = run_script(["--sample", checkpoint_path(tmp_path / "log", 1), "--device", "cpu", "--num-samples", "2",
                         "--max-new-tokens", "4"], cwd=tmp_path, nproc=2, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("checkpoint of step 1 (") == 1, result.stdout
    assert [(i, n, step) for i, n, step, _ in printed_samples(result.stdout)] == [(1, 2, 1), (2, 2, 1)], result.stdout
    assert result.stdout.count("--- end of samples ---") == 1


def test_sample_refuses_a_batch_size_below_one(shards, tmp_path, capsys):
    """--sample CKPT --batch-size 0 ended in range()'s ValueError; -1 printed no sample and said nothing."""
    assert run_main(TINY + ["--data", shards, "--log-dir", tmp_path, "--max-steps", "1"], capsys)[0] == 0
    sample = ["--sample", checkpoint_path(tmp_path, 1), "--device", "cpu", "--prompt", "a"]  # token 64, of 128
    for rows in ("0", "-1"):
        expect_usage_error(sample + ["--batch-size", rows], capsys, f"--batch-size must be positive, not {rows}")
