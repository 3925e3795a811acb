"""benchmarks/recipes.py: the standard library as training text, the share of tokens by hand, and a tiny run of both
recipes end to end."""
import json
import math
import os
import sys

import numpy as np
import pytest
import torch

from helpers import REPO, needs_muon, run_main

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import recipes  # noqa: E402


def test_tokens_to_reach_interpolates_between_evaluations():
    losses = [(0, 9.0), (10, 5.0), (20, 3.0), (30, 2.5)]
    assert recipes.tokens_to_reach(losses, 4.0, 100) == 1500  # half-way from step 10 (5.0) to step 20 (3.0)
    assert recipes.tokens_to_reach(losses, 5.0, 100) == 1000  # reached exactly at an evaluation
    assert recipes.tokens_to_reach(losses, 9.5, 100) == 0  # already at the start
    assert recipes.tokens_to_reach(losses, 2.0, 100) is None  # never


def test_random_batches_are_windows_of_the_text_with_targets_one_token_later():
    tokens = np.arange(1000, dtype=np.uint16)
    x, y = recipes.random_batch(tokens, 8, 16, np.random.default_rng(0))
    assert x.shape == y.shape == (8, 16)
    assert (x[:, 1:] == x[:, :-1] + 1).all() and (y == x + 1).all()
    again, _ = recipes.random_batch(tokens, 8, 16, np.random.default_rng(0))
    assert (again == x).all() and len(set(x[:, 0].tolist())) > 1  # the seed decides; the starts differ


def test_the_standard_library_is_split_by_file_and_renumbered():
    train, val, vocab_size = recipes.standard_library_tokens()
    assert len(train) > 1_000_000 and len(val) > 100_000 and 5_000 < vocab_size < 50257
    assert max(train.max(), val.max()) == vocab_size - 1  # every id in use, none past the vocabulary


@needs_muon
def test_both_recipes_end_to_end(tmp_path, capsys):
    out = tmp_path / "recipes.json"
    code, stdout, stderr = run_main(["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "16",
                                     "--batch-size", "4", "--steps", "4", "--eval-every", "2", "--val-tokens", "256",
                                     "--seeds", "1", "2", "--json", out], capsys, main=recipes.main)
    assert code == 0, stderr
    lines = stdout.splitlines()
    assert lines[0].startswith(f"Python {sys.version.split()[0]} standard library: ")
    header = next(line for line in lines if line.startswith("step "))
    assert header.split()[2:] == ["gpt2", "s1", "modern", "s1", "gpt2", "s2", "modern", "s2"]
    saved = json.loads(out.read_text())
    runs = {(r["recipe"], r["seed"]): r for r in saved["results"]}
    assert sorted(runs) == [("gpt2", 1), ("gpt2", 2), ("modern", 1), ("modern", 2)]
    vocab = int(lines[0].split(" distinct")[0].split()[-1].replace(",", ""))
    for (recipe, _), run in runs.items():
        assert [step for step, _ in run["losses"]] == [0, 2, 4]
        if recipe == "modern":  # a zero head: uniform predictions at step 0
            assert run["losses"][0][1] == pytest.approx(math.log(vocab), abs=1e-4)
    shares = [line for line in lines if "the modern recipe reaches the GPT-2 recipe's final" in line]
    assert [line.split(":")[0] for line in shares] == ["seed 1", "seed 2"]



@needs_muon
def test_both_recipes_train_on_the_same_batches(monkeypatch):
    seen = {}
    real_batch = recipes.random_batch

    def recorded_batch(tokens, B, T, rng):
        x, y = real_batch(tokens, B, T, rng)
        seen.setdefault(recipe, []).append(x.clone())
        return x, y

    monkeypatch.setattr(recipes, "random_batch", recorded_batch)
    tokens = np.random.default_rng(0).integers(0, 64, 5000).astype(np.uint16)
    for recipe in ("gpt2", "modern"):
        cfg = recipes.TrainConfig(recipe=recipe, n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64,
                                  batch_size=2, seq_len=8, total_batch_size=16, max_steps=3, warmup_steps=0)
        losses, _ = recipes.train_recipe(cfg, tokens, tokens[:65], "cpu", 3, 1)
        assert [step for step, _ in losses] == [0, 3]
    assert len(seen["gpt2"]) == 3 and all(torch.equal(a, b) for a, b in zip(seen["gpt2"], seen["modern"]))


def test_the_table_gives_the_share_of_tokens_by_hand(capsys):
    results = [dict(recipe="gpt2", seed=1, losses=[(0, 9.0), (10, 5.0), (20, 4.0)]),
               dict(recipe="modern", seed=1, losses=[(0, 9.0), (10, 3.0), (20, 2.5)])]
    recipes.print_table(results, 100)
    out = capsys.readouterr().out
    # 4.0 is reached 5/6 of the way from step 0 (9.0) to step 10 (3.0): 833 of the GPT-2 recipe's 2,000 tokens
    assert "seed 1: the modern recipe reaches the GPT-2 recipe's final 4.0000 in 42% of its tokens; its own final " \
           "loss is 2.5000, 1.500 lower" in out
    assert "  10     1,000          5.0000        3.0000" in out
