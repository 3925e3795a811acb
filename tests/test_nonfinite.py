"""Steps with a non-finite loss: the update is skipped and logged (as null: log.jsonl stays strict JSON), no periodic
checkpoint is written nor any pruned while they last (the end, a signal or a shard gone bad saves the weights they left,
unless those are not finite), and too many in a row stop the run, naming the checkpoint to go back to. Most NaNs are
made here: GPT.forward's loss is multiplied by NaN in the steps chosen, so train_step itself must find the step
non-finite; the last test's weights really diverge."""
import json
import math
import os
import signal

import pytest
import torch

import train_gpt2
from helpers import (
    TINY,
    assert_tensors_equal,
    check_usage_error,
    checkpoint_path,
    expect_usage_error,
    load_ckpt,
    needs_muon,
    put_bad_token,
    read_log,
    run_main,
    train_records,
    write_shards,
)
from machinery import checkpoints
from variations import modern

CONSTANT_LR = ["--warmup-steps", "0", "--min-lr-ratio", "1", "--max-lr", "1e-2"]  # the same lr whatever --max-steps


def poison_steps(monkeypatch, steps, after_step=None, model=train_gpt2.GPT):
    """Makes the loss NaN in the given steps of a run started fresh (its n-th train_step call is step n), as a bad
    batch or a diverging model would. after_step(step, model, optimizers) is called after each step. model: the
    recipe's model class (modern.GPT for --recipe modern)."""
    real_train_step, real_forward = train_gpt2.train_step, model.forward
    state = {"step": -1, "poisoned": False}

    def train_step(model, optimizers, *args, **kwargs):
        state["step"] += 1
        state["poisoned"] = state["step"] in steps
        try:
            result = real_train_step(model, optimizers, *args, **kwargs)
        finally:
            state["poisoned"] = False
        if after_step:
            after_step(state["step"], model, optimizers)
        return result

    def forward(self, idx, targets=None, kv_cache=None):
        logits, loss = real_forward(self, idx, targets, kv_cache)
        return logits, loss * float("nan") if state["poisoned"] and loss is not None else loss

    monkeypatch.setattr(train_gpt2, "train_step", train_step)
    monkeypatch.setattr(model, "forward", forward)


def copy_of(state_dict):
    """A deep copy of a (nested) state dict's tensors, as a checkpoint would hold them."""
    if isinstance(state_dict, dict):
        return {key: copy_of(value) for key, value in state_dict.items()}
    if isinstance(state_dict, list):
        return [copy_of(value) for value in state_dict]
    return state_dict.detach().clone() if isinstance(state_dict, torch.Tensor) else state_dict


def test_non_finite_step_is_skipped(shards, tmp_path, capsys, monkeypatch):
    args = TINY + ["--data", shards, "--checkpoint-every", "4"] + CONSTANT_LR
    after_3 = {}

    def keep_step_3(step, model, optimizers):
        if step == 3:
            after_3.update(model=copy_of(model.state_dict()), optimizers=[copy_of(o.state_dict()) for o in optimizers])

    poison_steps(monkeypatch, {3}, keep_step_3)
    code, out, err = run_main(args + ["--max-steps", "6", "--log-dir", tmp_path / "nan"], capsys)
    assert code == 0, err
    assert "non-finite: update skipped (1 in a row)" in out
    monkeypatch.undo()
    code, _, err = run_main(args + ["--max-steps", "3", "--log-dir", tmp_path / "ref"], capsys)
    assert code == 0, err
    nan, ref = train_records(read_log(tmp_path / "nan")), train_records(read_log(tmp_path / "ref"))
    assert nan[3]["skipped"] is True and nan[3]["train_loss"] is None
    for step in (0, 1, 2, 4, 5):
        assert "skipped" not in nan[step] and nan[step]["train_loss"] is not None
    for step in (0, 1, 2):
        assert nan[step]["train_loss"] == ref[step]["train_loss"]
    # the weights after steps 0-3 with 3 skipped are those after steps 0-2, exactly. (Taken from the model itself: the
    # checkpoint of step 4 waits for a finite step, as the step before it was non-finite, and is written at step 5.)
    assert not os.path.exists(checkpoint_path(tmp_path / "nan", 4))
    assert os.path.exists(checkpoint_path(tmp_path / "nan", 5))
    reference = load_ckpt(checkpoint_path(tmp_path / "ref", 3))
    assert_tensors_equal(after_3["model"], reference["model"])
    assert len(after_3["optimizers"]) == len(reference["optimizers"])
    for skipped, saved in zip(after_3["optimizers"], reference["optimizers"]):
        assert_tensors_equal(skipped["state"], saved["state"])
    assert all(torch.isfinite(t).all() for t in load_ckpt(checkpoint_path(tmp_path / "nan", 6))["model"].values())


@pytest.mark.parametrize("first_bad", [3, 4])
def test_too_many_bad_steps_stop_the_run(shards, tmp_path, capsys, monkeypatch, first_bad):
    """Three bad steps in a row stop the run, naming the latest checkpoint from before them: one written during them
    (none is) or at the step they began from holds the weights that went non-finite, and is named as such."""
    log_dir = tmp_path / "log"
    bad = [first_bad, first_bad + 1, first_bad + 2]
    poison_steps(monkeypatch, set(bad + [first_bad + 3]))
    args = TINY + ["--data", shards, "--checkpoint-every", "2", "--max-bad-steps", "3", "--max-steps", "10",
                   "--log-dir", log_dir] + CONSTANT_LR
    good = checkpoint_path(log_dir, 2)
    line = expect_usage_error(args, capsys, "3 steps in a row", "non-finite", f"step {bad[-1]}", f"resume from {good}",
                              "Lower the learning rate (--max-lr) and")
    assert str(log_dir) in line
    records = train_records(read_log(log_dir))
    assert sorted(records) == list(range(bad[-1] + 1))  # stopped right after the third bad step
    assert [s for s, r in records.items() if r.get("skipped")] == bad
    if first_bad == 3:  # no checkpoint of step 4: the step before it was non-finite
        assert [os.path.basename(p) for p in checkpoints.checkpoint_paths(str(log_dir))] == ["ckpt_000002.pt"]
        assert "--resume" not in line
    else:  # ckpt 4, written before step 4, holds the weights that went non-finite: kept, and named as such
        assert [os.path.basename(p) for p in checkpoints.checkpoint_paths(str(log_dir))] == ["ckpt_000002.pt",
                                                                                            "ckpt_000004.pt"]
        assert f"--resume {good}: the later checkpoints hold the weights that went non-finite" in line
    last_good = load_ckpt(good)
    assert all(torch.isfinite(t).all() for t in last_good["model"].values())


@needs_muon
def test_a_diverging_modern_recipe_is_told_to_lower_its_own_rates(shards, tmp_path, capsys, monkeypatch):
    """--recipe modern has no --max-lr (it refuses the flag): its rates are Muon's, the embedding's and the head's."""
    poison_steps(monkeypatch, {0, 1}, model=modern.GPT)
    args = TINY + ["--data", shards, "--log-dir", tmp_path, "--recipe", "modern", "--max-bad-steps", "2"]
    line = expect_usage_error(args, capsys, "2 steps in a row", "start again",
                              "Lower the learning rates (--muon-lr, --embed-lr, --head-lr) and")
    assert "--max-lr" not in line


def test_a_stop_signal_after_a_skipped_step_saves_its_weights_and_says_so(shards, tmp_path, capsys, monkeypatch):
    """A SIGTERM right after a non-finite step saved nothing ("stopped by signal at step 6, not saved"), though the
    step, skipped, left the weights as they were: finite, as the checkpoint of step 5 holds them. They are saved, and
    the last line names the step skipped."""
    log_dir = tmp_path / "log"

    def terminate_in_step_5(step, model, optimizers):
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)  # caught by the run: it stops after this step

    poison_steps(monkeypatch, {5}, terminate_in_step_5)
    args = TINY + ["--data", shards, "--checkpoint-every", "5", "--max-steps", "10", "--log-dir", log_dir] + CONSTANT_LR
    code, out, err = run_main(args, capsys)
    assert code == 0, err
    last = out.strip().splitlines()[-1]  # as the checkpoints written say: it said so with none written
    assert last == (f"stopped by signal at step 6, checkpoint saved (step 5 was non-finite, skipped: the weights saved "
                    f"are step 5's); resume with the same command (it picks up {log_dir})"), last
    assert checkpoints.checkpoint_paths(log_dir) == [checkpoint_path(log_dir, 5), checkpoint_path(log_dir, 6)]
    saved, before = load_ckpt(checkpoint_path(log_dir, 6)), load_ckpt(checkpoint_path(log_dir, 5))
    assert_tensors_equal(saved["model"], before["model"])


def test_a_skipped_last_step_saves_the_end(shards, tmp_path, capsys, monkeypatch):
    """--checkpoint-every 0 (the Shakespeare default) with the last step non-finite: the run ended "done at step 8, not
    saved", all of it lost, and the same command met the same NaN again. The skipped step left the weights as they
    were: the end is saved, the line names the step, and the same command finds nothing left to do."""
    args = TINY + ["--data", shards, "--checkpoint-every", "0"] + CONSTANT_LR
    poison_steps(monkeypatch, {7})
    code, out, err = run_main(args + ["--max-steps", "8", "--log-dir", tmp_path / "nan"], capsys)
    assert code == 0, err
    last = out.strip().splitlines()[-1]
    assert last.startswith("done: step 8, val loss "), last
    assert "(step 7 was non-finite, skipped: the weights saved are step 7's)" in last, last
    monkeypatch.undo()
    code, out, err = run_main(args + ["--max-steps", "8", "--log-dir", tmp_path / "nan"], capsys)
    assert code == 0 and "nothing left to do" in out, err
    code, _, err = run_main(args + ["--max-steps", "7", "--log-dir", tmp_path / "ref"], capsys)
    assert code == 0, err
    assert_tensors_equal(load_ckpt(checkpoint_path(tmp_path / "nan", 8))["model"],
                         load_ckpt(checkpoint_path(tmp_path / "ref", 7))["model"])


def test_weights_that_are_not_finite_are_never_saved(tmp_path, capsys):
    """Non-finite steps leave the weights as they were, so the end, a signal or a shard gone bad saves them; unless
    they are not finite, as a damaged checkpoint's here (a NaN in one weight), whose every step is then non-finite.
    Nothing is saved, and the run ends in one line: at the end, as where a shard turns bad inside the streak (a save
    of the NaN weights then passed every test)."""
    data = write_shards(tmp_path / "data")
    put_bad_token(data, 800)  # step 3 reads tokens 768 to 1,024
    log_dir = tmp_path / "log"
    args = TINY + ["--data", data, "--log-dir", log_dir]
    assert run_main(args + ["--max-steps", "2"], capsys)[0] == 0
    damaged = load_ckpt(checkpoint_path(log_dir, 2))
    damaged["model"]["transformer.h.0.mlp.c_fc.weight"][0, 0] = float("nan")
    torch.save(damaged, checkpoint_path(log_dir, 2))
    not_finite = "the run is not saved at step 3: its weights are not finite (the steps since 2 were non-finite"
    expect_usage_error(args + ["--max-steps", "3"], capsys, not_finite, "Lower the learning rate (--max-lr)")
    expect_usage_error(args + ["--max-steps", "10"], capsys, "holds token id 200", f"; saving the run failed too: "
                       f"{not_finite}")
    assert checkpoints.checkpoint_paths(log_dir) == [checkpoint_path(log_dir, 2)]


# Weights that really diverge (a learning rate of 1e20, not a patched loss)

SCHEDULE_OFF = ["--warmup-steps", "0", "--min-lr-ratio", "1"]  # the --max-lr given, at every step


def strict_records(log_dir):
    """log.jsonl's records, read as strict JSON: NaN and Infinity are not JSON, and parsers such as jq refuse them."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    with open(os.path.join(log_dir, "log.jsonl")) as f:
        return [json.loads(line, parse_constant=refuse) for line in f]


def test_a_diverging_run_keeps_the_last_checkpoint_that_trains_and_names_it(shards, tmp_path, capsys):
    log_dir = str(tmp_path / "log")
    args = TINY + ["--data", shards, "--log-dir", log_dir, "--checkpoint-every", "1"] + SCHEDULE_OFF
    code, out, err = run_main(args + ["--max-steps", "6", "--max-lr", "1e-3"], capsys)
    assert code == 0, err
    assert [checkpoints.checkpoint_step(p) for p in checkpoints.checkpoint_paths(log_dir)] == [5, 6]

    # the step from 6 has a finite loss and takes the weights to ~1e20; every step after it is non-finite
    code, out, err = run_main(args + ["--max-steps", "30", "--max-lr", "1e20", "--eval-every", "1"], capsys)
    line = check_usage_error(code, out, err, "5 steps in a row had a non-finite loss", "(last: step 11)",
                             f"resume from {checkpoint_path(log_dir, 6)}", f"--resume {checkpoint_path(log_dir, 6)}")
    # the checkpoint of step 7 was written before its step showed its weights non-finite; none after, none pruned
    assert [checkpoints.checkpoint_step(p) for p in checkpoints.checkpoint_paths(log_dir)] == [5, 6, 7], line

    records = strict_records(log_dir)
    diverged = [r for r in records if r.get("step", 0) >= 7 and ("val_loss" in r or "train_loss" in r)]
    assert diverged and all(r.get("val_loss", r.get("train_loss")) is None for r in diverged), diverged

    # the named checkpoint trains again, at a sane learning rate
    code, out, err = run_main(args + ["--max-steps", "8", "--max-lr", "1e-3", "--resume", checkpoint_path(log_dir, 6)],
                              capsys)
    assert code == 0, err
    resumed = [r for r in strict_records(log_dir) if "train_loss" in r][-2:]
    assert [r["step"] for r in resumed] == [6, 7]
    assert all(r["train_loss"] is not None and math.isfinite(r["train_loss"]) for r in resumed), resumed
