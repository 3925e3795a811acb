"""Checkpoints: SIGKILL and resume (bitwise, on CPU in fp32), SIGTERM (during an evaluation too), a shard gone bad (on
one rank alone too), a damaged latest checkpoint, mismatched shapes, a different number of processes, checkpoints of
another format, sampling from a checkpoint, --no-resume, --eval-only. (Non-finite steps: test_nonfinite.py.)"""
import contextlib
import fcntl
import math
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import torch

import forkserver
import train_gpt2
from helpers import (
    REPO,
    SCRIPT,
    TINY,
    assert_tensors_equal,
    check_usage_error,
    checkpoint_path,
    expect_usage_error,
    load_ckpt,
    logged_train_steps,
    needs_muon,
    printed_samples,
    ranks_of,
    read_log,
    run_main,
    run_script,
    run_script_on_tmpfs,
    scribble,
    script_command,
    script_env,
    start_command,
    start_script,
    train_records,
    val_records,
    wait_for_output,
    wait_for_step,
    write_shards,
)
from machinery import checkpoints, locks, log_directory, resolution


def checkpoint_names(log_dir):
    return [os.path.basename(p) for p in checkpoints.checkpoint_paths(str(log_dir))]


def assert_optimizers_equal(a, b, exact=True, atol=1e-5):
    """The optimizer states of two checkpoints (a list of state dicts each) are equal."""
    assert len(a["optimizers"]) == len(b["optimizers"])
    for x, y in zip(a["optimizers"], b["optimizers"]):
        assert_tensors_equal(x["state"], y["state"], exact, atol)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A 60-step run with checkpoints every 4 steps, run whole once for the tests that kill it: (its flags, but for
    --log-dir; its log dir)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    args = TINY + ["--data", write_shards(root / "data"), "--max-steps", "60", "--checkpoint-every", "4",
                   "--warmup-steps", "2", "--max-lr", "1e-2"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the runs it is compared with have it (conftest's one_thread is not in force yet)
    try:
        train_gpt2.main([str(a) for a in args + ["--log-dir", root / "ref"]])
    finally:
        torch.set_num_threads(threads)
    return args, root / "ref"


@pytest.mark.parametrize("kill_at", [5, 11])  # soon after the first checkpoint (step 4), and just before the third
def test_sigkill_then_resume_is_bitwise_identical(uninterrupted, tmp_path, capsys, kill_at):
    args, ref = uninterrupted
    run = tmp_path / "run"

    # stdout is a one-page pipe nobody reads: the run blocks in print() after ~40 steps, so it cannot reach its end
    # before the SIGKILL lands, however late this process gets to send it
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    proc = forkserver.Process(script_command(args + ["--log-dir", run]), tmp_path, script_env(), stdout=write_end)
    os.close(write_end)
    try:
        wait_for_step(proc, run, kill_at)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        os.close(read_end)
    killed_log = open(run / "log.jsonl").read()
    last = max(logged_train_steps(run))
    assert kill_at <= last < 59, (kill_at, last)
    assert not os.path.exists(checkpoint_path(run, 60))

    code, out, err = run_main(args + ["--log-dir", run], capsys)  # the very same command
    assert code == 0, err
    full_log = open(run / "log.jsonl").read()
    assert full_log.startswith(killed_log)  # appended, never truncated
    events = [r for r in read_log(run) if r.get("event") == "resume"]
    assert len(events) == 1
    start = events[0]["step"]
    assert start % 4 == 0 and 4 <= start <= last + 1, (start, last)
    assert f"resuming from the checkpoint of step {start}" in out
    after = [r for r in read_log(run)[len(killed_log.splitlines()):] if "train_loss" in r]
    assert [r["step"] for r in after] == list(range(start, 60))
    reference = train_records(read_log(ref))
    for r in after:  # the JSON floats, compared exactly
        assert r["train_loss"] == reference[r["step"]]["train_loss"], r["step"]
        assert r["grad_norm"] == reference[r["step"]]["grad_norm"], r["step"]
    assert val_records(read_log(run))[60]["val_loss"] == val_records(read_log(ref))[60]["val_loss"]
    a, b = load_ckpt(checkpoint_path(ref, 60)), load_ckpt(checkpoint_path(run, 60))
    assert_tensors_equal(a["model"], b["model"])
    assert_optimizers_equal(a, b)
    assert a["stream"] == b["stream"] and a["step"] == b["step"] == 60


def test_a_shard_gone_bad_mid_run_is_saved_first_and_the_same_command_finishes_it(uninterrupted, tmp_path, capsys):
    """A token id past the vocabulary, found as the stream reaches it at step 9 (a shard removed or damaged while the
    run reads ends it the same way), ended the run with only the checkpoint of step 8 left: up to 2,500 steps lost
    with the GPU defaults. The run is saved where it stands, before the step, and ends in one line; with the shard
    mended, the same command resumes from there and ends as the run that never stopped."""
    args, ref = uninterrupted
    data, run = tmp_path / "data", tmp_path / "run"
    shutil.copytree(args[args.index("--data") + 1], data)
    args = [str(data) if arg == args[args.index("--data") + 1] else arg for arg in args]
    good = {name: np.load(data / name) for name in os.listdir(data) if "_train_" in name}
    for name, tokens in good.items():  # step 9 reads tokens 2,304 to 2,560 of the first shard in the order
        np.save(data / name, np.concatenate([tokens[:2400], [200], tokens[2401:]]).astype(np.uint16))
    check_usage_error(*run_main(args + ["--log-dir", run], capsys), "holds token id 200",
                      f"; the run is saved at step 9: once that is mended, the same command resumes from "
                      f"{checkpoint_path(run, 9)}")
    assert checkpoint_names(run) == ["ckpt_000004.pt", "ckpt_000008.pt", "ckpt_000009.pt"]
    for name, tokens in good.items():
        np.save(data / name, tokens)
    code, out, err = run_main(args + ["--log-dir", run], capsys)
    assert code == 0 and "resuming from the checkpoint of step 9" in out, err
    reference, resumed = train_records(read_log(ref)), train_records(read_log(run))
    assert sorted(resumed) == list(range(60))
    for step in range(9, 60):  # the JSON floats, compared exactly
        assert resumed[step]["train_loss"] == reference[step]["train_loss"], step
    assert val_records(read_log(run))[60]["val_loss"] == val_records(read_log(ref))[60]["val_loss"]


def tokens_consumed(stream_state, shard_lengths, seed):
    """How many training tokens lie before a stream position, counted by hand from the shard order."""
    stream = train_gpt2.TokenStream([torch.zeros(n) for n in shard_lengths], ["a"] * len(shard_lengths), seed)
    order = stream.order(stream_state["epoch"])
    before = sum(shard_lengths[i] for i in order[: stream_state["index"]])
    return stream_state["epoch"] * sum(shard_lengths) + before + stream_state["offset"]


def test_a_shard_that_one_rank_alone_cannot_read_stops_both_ranks_saved(shards, tmp_path):
    """A read that fails on one rank alone (its node's I/O error, or its open-file limit) hung the job: that rank
    saved alone, and the collective it began never met the other rank, already in the step's all-reduce. The ranks
    vote on each step's read: both stop before the same step, save it, and say the failing rank's line, at once.
    Here rank 1 runs out of file descriptors mid-run (prlimit lowers its `ulimit -n`), so that its next read of a
    shard fails for real."""
    run = tmp_path / "run"
    args = TINY + ["--data", shards, "--max-steps", "100000", "--checkpoint-every", "0", "--log-dir", run]
    with open(tmp_path / "out.txt", "w") as out:
        proc = start_command(script_command(args, nproc=2), tmp_path, script_env(), stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_step(proc, run, 5)
        ranks = ranks_of(proc.pid, run)
        assert sorted(ranks) == [0, 1], ranks
        _, hard = resource.prlimit(ranks[1], resource.RLIMIT_NOFILE)
        resource.prlimit(ranks[1], resource.RLIMIT_NOFILE, (3, hard))  # stdin, stdout, stderr: no descriptor left
        code = proc.wait(15)  # it hung for good
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = open(tmp_path / "out.txt").read()
    assert code == 2, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and errors[0] == errors[1], out[-3000:]  # each rank's line, the same
    stop = max(logged_train_steps(run)) + 1
    assert stop > 5 and "Traceback" not in out, out[-3000:]
    assert errors[0].startswith("error: rank 1: ") and "too many open files" in errors[0], errors[0]
    assert f"the run is saved at step {stop}" in errors[0] and str(checkpoint_path(run, stop)) in errors[0]
    assert checkpoint_names(run) == [f"ckpt_{stop:06d}.pt"]
    # saved before the step that rank 1 could not read, which rank 0 had read: its position is before that step too
    assert tokens_consumed(load_ckpt(checkpoint_path(run, stop))["stream"], [3000, 2500], 1337) == stop * 256


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_a_checkpoint_and_exits_cleanly(shards, tmp_path, signum):
    run = tmp_path / "run"
    args = TINY + ["--data", shards, "--max-steps", "100000", "--checkpoint-every", "0", "--log-dir", run]
    proc = start_script(args, tmp_path, tmp_path / "out.txt")
    wait_for_step(proc, run, 2)
    proc.send_signal(signum)
    assert proc.wait(60) == 0
    out = open(tmp_path / "out.txt").read()
    assert "Traceback" not in out
    last = max(logged_train_steps(run))
    stop = last + 1  # it finished the step it was in
    assert f"stopped by signal at step {stop}" in out and "resume with the same command" in out
    assert checkpoint_names(run) == [f"ckpt_{stop:06d}.pt"]
    ckpt = load_ckpt(checkpoint_path(run, stop))
    assert ckpt["step"] == stop
    assert tokens_consumed(ckpt["stream"], [3000, 2500], 1337) == stop * 256  # the loader's position matches
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values())


def cut_in_half(path):
    os.truncate(path, os.path.getsize(path) // 2)


@pytest.mark.parametrize("damage", [cut_in_half, scribble])
def test_damaged_latest_checkpoint_falls_back_to_the_previous(shards, tmp_path, capsys, damage):
    """A checkpoint cut short, or with random bytes over its middle: torch.load read those as weights, checking none of
    the CRC-32s that torch.save writes; they are read back first now."""
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--max-steps", "6", "--checkpoint-every", "2", "--warmup-steps", "2",
                   "--max-lr", "1e-2", "--log-dir", log_dir]
    code, _, err = run_main(args, capsys)
    assert code == 0, err
    first = train_records(read_log(log_dir))
    assert checkpoint_names(log_dir) == ["ckpt_000004.pt", "ckpt_000006.pt"]
    latest = checkpoint_path(log_dir, 6)
    damage(latest)
    code, out, err = run_main(args, capsys)
    assert code == 0, err
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "ckpt_000006.pt" in warnings[0]
    assert "resuming from the checkpoint of step 4" in out
    records = read_log(log_dir)
    assert [r["step"] for r in records if r.get("event") == "resume"] == [4]
    resume = next(i for i, r in enumerate(records) if r.get("event") == "resume")
    again = [r for r in records[resume:] if "train_loss" in r]
    assert [r["step"] for r in again] == [4, 5]
    for r in again:  # the same steps again, bitwise
        assert r["train_loss"] == first[r["step"]]["train_loss"]
    assert load_ckpt(latest)["step"] == 6  # rewritten whole


def test_mismatched_shapes_give_a_readable_error(shards, tmp_path, capsys):
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--max-steps", "2", "--log-dir", log_dir]
    assert run_main(args, capsys)[0] == 0
    line = expect_usage_error(args + ["--n-embd", "32", "--max-steps", "4"], capsys, "n_embd: checkpoint 64, flags 32",
                              "--no-resume")
    assert "n_layer" not in line
    line = expect_usage_error(args + ["--n-embd", "32", "--n-layer", "3", "--max-steps", "4"], capsys,
                              "n_embd: checkpoint 64, flags 32", "n_layer: checkpoint 2, flags 3")
    # another number of heads leaves every weight's shape as it was, but it is another model
    expect_usage_error(args + ["--n-head", "2", "--max-steps", "4"], capsys, "n_head: checkpoint 4, flags 2")
    expect_usage_error(args + ["--n-head", "2", "--eval-only"], capsys, "n_head: checkpoint 4, flags 2")
    assert os.path.exists(checkpoint_path(log_dir, 2))  # nothing was moved or overwritten


def test_resume_with_another_number_of_processes(shards, tmp_path, capsys):
    """Started with 1 process and 2 accumulation steps, resumed under torchrun with 2 processes of 1."""
    args = TINY + ["--data", shards, "--max-steps", "4", "--checkpoint-every", "2", "--keep-checkpoints", "3",
                   "--warmup-steps", "1", "--max-lr", "1e-2"]
    ref, two = tmp_path / "ref", tmp_path / "two"
    code, _, err = run_main(args + ["--log-dir", ref], capsys)
    assert code == 0, err
    two.mkdir()
    shutil.copy(checkpoint_path(ref, 2), checkpoint_path(two, 2))
    result = run_script(args + ["--log-dir", two], cwd=tmp_path, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from the checkpoint of step 2" in result.stdout
    assert "4 x 32 x 1 accumulation steps x 2 process(es)" in result.stdout
    reference, resumed = train_records(read_log(ref)), train_records(read_log(two))
    assert sorted(resumed) == [2, 3]
    for step in (2, 3):
        assert resumed[step]["train_loss"] == pytest.approx(reference[step]["train_loss"], abs=1e-5)
    assert val_records(read_log(two))[4]["val_loss"] == pytest.approx(val_records(read_log(ref))[4]["val_loss"],
                                                                      abs=1e-5)
    a, b = load_ckpt(checkpoint_path(ref, 4)), load_ckpt(checkpoint_path(two, 4))
    assert_tensors_equal(a["model"], b["model"], exact=False, atol=1e-5)
    assert a["stream"] == b["stream"]


def test_sample_from_a_checkpoint(shards, tmp_path, capsys):
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--max-steps", "2", "--vocab-size", "50304", "--log-dir", log_dir]
    assert run_main(args, capsys)[0] == 0
    sample = ["--sample", checkpoint_path(log_dir, 2), "--prompt", "Hello, I'm", "--num-samples", "2",
              "--max-new-tokens", "8", "--device", "cpu"]
    code, out, err = run_main(sample, capsys)
    assert code == 0 and err == "", err
    lines = out.splitlines()
    assert lines[0].startswith("checkpoint of step 2") and repr("Hello, I'm") in lines[0]
    assert [line for line in lines if line.startswith("--- ")] == ["--- sample 1/2 (step 2) ---",
                                                                    "--- sample 2/2 (step 2) ---",
                                                                    "--- end of samples ---"]
    samples = printed_samples(out)
    assert [sample[:3] for sample in samples] == [(1, 2, 2), (2, 2, 2)]
    for _, _, _, text in samples:  # printed as it is
        assert text.startswith("Hello, I'm") and len(text) > len("Hello, I'm")
    assert run_main(sample, capsys)[1] == out  # seeded: the same samples again
    # a tiny-vocab checkpoint cannot embed the prompt: a message, no crash
    small = tmp_path / "small"
    assert run_main(args[:-4] + ["--log-dir", small, "--max-steps", "1"], capsys)[0] == 0
    code, out, err = run_main(["--sample", checkpoint_path(small, 1), "--prompt", "Hello", "--device", "cpu"], capsys)
    assert code == 0 and "no samples" in out and "Traceback" not in err


def test_no_resume_moves_the_old_log_dir_aside(shards, tmp_path, capsys, monkeypatch):
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--log-dir", log_dir]
    assert run_main(args + ["--max-steps", "2"], capsys)[0] == 0
    first = open(log_dir / "log.jsonl").read()
    code, out, _ = run_main(args + ["--max-steps", "3"], capsys)  # resumes: appends
    assert code == 0 and "resuming from the checkpoint of step 2" in out
    second = open(log_dir / "log.jsonl").read()
    assert second.startswith(first) and len(second) > len(first)
    code, out, _ = run_main(args + ["--max-steps", "1", "--no-resume"], capsys)
    assert code == 0
    moved = re.search(r"from (\S+) aside to (\S+)", out)
    assert moved and moved.group(1) == str(log_dir)
    aside = moved.group(2)
    assert os.path.dirname(aside) == str(tmp_path)
    assert open(os.path.join(aside, "log.jsonl")).read() == second  # kept whole, not deleted
    assert sorted(os.listdir(aside)) == ["ckpt_000002.pt", "ckpt_000003.pt", "log.jsonl"]
    fresh = read_log(log_dir)
    assert not any(r.get("event") == "resume" for r in fresh) and sorted(train_records(fresh)) == [0]
    # once more within the same second (the clock is frozen here): a second, distinct place aside
    stamp = aside.rsplit(".", 1)[1]
    monkeypatch.setattr(log_directory.time, "strftime", lambda *a: stamp)
    code, out, err = run_main(args + ["--max-steps", "1", "--no-resume"], capsys)
    assert code == 0, err
    second_aside = re.search(r"aside to (\S+)", out).group(1)
    assert second_aside != aside and os.path.isdir(aside) and os.path.isdir(second_aside)
    assert sorted(os.listdir(second_aside)) == ["ckpt_000001.pt", "log.jsonl"]


def fresh_start_waiting_for_a_reader(shards, tmp_path, capsys, nproc):
    """A finished run in tmp_path/log, its latest checkpoint held as --eval-only holds it as it loads it, and
    --no-resume started on it in nproc ranks, waiting for that reader: (its args, its process, the reader, {rank: pid},
    {name: bytes} of the old run's files)."""
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--log-dir", log_dir, "--checkpoint-every", "2", "--max-steps", "4"]
    assert run_main(args, capsys)[0] == 0
    before = {name: (log_dir / name).read_bytes() for name in ("ckpt_000002.pt", "ckpt_000004.pt", "log.jsonl")}
    reader = locks.ReadLock(checkpoint_path(log_dir, 4))
    with open(tmp_path / "out.txt", "w") as out:
        process = start_command(script_command(args + ["--no-resume"], nproc), tmp_path, script_env(), stdout=out,
                                stderr=subprocess.STDOUT)
    wait_for_output(process, tmp_path / "out.txt", "waiting for a process that is loading")
    pids = {0: process.pid} if nproc == 1 else ranks_of(process.pid, log_dir)
    assert sorted(pids) == list(range(nproc)), pids
    return args, process, reader, pids, before


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=lambda signum: signum.name)
@pytest.mark.parametrize("nproc", [1, 2], ids=["1rank", "2ranks"])
def test_a_signal_as_a_fresh_start_moves_the_old_run_aside_leaves_it_whole(shards, tmp_path, capsys, signum, nproc):
    """--no-resume waits for a reader loading a checkpoint (--eval-only of the latest) before moving it aside. Ctrl-C
    then had moved ckpt_000002.pt aside and left ckpt_000004.pt and log.jsonl, with a KeyboardInterrupt traceback (and
    SIGTERM, no line): a plain rerun resumed the half left behind. Each file is waited for before any is moved, so a
    signal in the wait moves none, and says so in one line. Under torchrun, a rank other than 0 waited with Python's
    own handlers: Ctrl-C gave it a KeyboardInterrupt traceback, and rank 0 another as that rank left, and no line."""
    log_dir = tmp_path / "log"
    _, process, reader, pids, before = fresh_start_waiting_for_a_reader(shards, tmp_path, capsys, nproc)
    try:
        for pid in pids.values():  # as a terminal's Ctrl-C reaches every worker
            os.kill(pid, signum)
        assert process.wait(60) == 2, (tmp_path / "out.txt").read_text()
    finally:
        reader.release()
        process.kill()
    out = (tmp_path / "out.txt").read_text()
    assert "Traceback" not in out, out
    assert [line for line in out.splitlines() if line.startswith("error: ")] == nproc * [
        f"error: starting fresh: stopped by {signal.Signals(signum).name} before the old run's files were moved aside; "
        f"they stay in {log_dir}, as they were"], out
    assert {name: (log_dir / name).read_bytes() for name in os.listdir(log_dir) if name != ".lock"} == before
    assert sorted(os.listdir(tmp_path)) == ["data", "log", "out.txt"]  # no directory aside


def test_a_signal_to_another_rank_as_rank_0_moves_the_old_run_aside_stops_the_run_at_its_first_step(shards, tmp_path,
                                                                                                      capsys):
    """A signal that reaches rank 1 alone while rank 0 waits to move the old run aside is kept, not lost (the run
    trained on to --max-steps) nor a traceback: rank 0 moves the old run whole, and both ranks stop after the first
    step, saved, as a signal during training stops them."""
    _, process, reader, pids, before = fresh_start_waiting_for_a_reader(shards, tmp_path, capsys, nproc=2)
    try:
        os.kill(pids[1], signal.SIGINT)
        time.sleep(0.5)  # handled while rank 0 still waits
        reader.release()
        assert process.wait(60) == 0, (tmp_path / "out.txt").read_text()
    finally:
        reader.release()
        process.kill()
    out = (tmp_path / "out.txt").read_text()
    assert "Traceback" not in out and "stopped by signal at step 1, checkpoint saved" in out, out
    aside = re.search(r"aside to (\S+)", out).group(1)
    assert {name: open(os.path.join(aside, name), "rb").read() for name in os.listdir(aside)} == before
    assert checkpoint_names(tmp_path / "log") == ["ckpt_000001.pt"]


def test_sigterm_to_one_rank_under_torchrun(shards, tmp_path):
    """Preemption may reach the ranks at different moments: a signal to rank 1 alone must stop both ranks at the
    same step, with one checkpoint and exit code 0 (no hang, no mismatched collectives)."""
    run = tmp_path / "run"
    args = TINY + ["--data", shards, "--max-steps", "100000", "--checkpoint-every", "0", "--log-dir", run]
    with open(tmp_path / "out.txt", "w") as out:
        proc = start_command(script_command(args, nproc=2, torchrun=True), tmp_path, script_env(), stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_step(proc, run, 3)
        workers = ranks_of(proc.pid, run, forked_for_it=forkserver.FORK)
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[1], signal.SIGTERM)
        assert proc.wait(60) == 0, open(tmp_path / "out.txt").read()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = open(tmp_path / "out.txt").read()
    stop = max(logged_train_steps(run)) + 1
    assert f"stopped by signal at step {stop}" in out, out[-3000:]
    assert checkpoint_names(run) == [f"ckpt_{stop:06d}.pt"]
    assert tokens_consumed(load_ckpt(checkpoint_path(run, stop))["stream"], [3000, 2500], 1337) == stop * 256


def test_sigint_to_the_torchrun_launcher_saves_then_torchrun_fails_as_the_readme_says(shards, tmp_path):
    """Ctrl-C or SIGTERM to torchrun itself: it passes the signal on, the workers stop at one step and rank 0 saves,
    then torchrun exits 1 with a SignalException traceback. The README said so of SIGTERM only; it names both, and
    what to signal instead. (One worker: the launcher's handling is the same for any number.)"""
    run = tmp_path / "run"
    args = TINY + ["--data", shards, "--max-steps", "100000", "--checkpoint-every", "0", "--log-dir", run]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", SCRIPT, *args]
    with open(tmp_path / "out.txt", "w") as out:
        proc = start_command([str(word) for word in command], tmp_path, script_env(), stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_step(proc, run, 3)
        os.kill(proc.pid, signal.SIGINT)  # torchrun's own process
        assert proc.wait(60) == 1, open(tmp_path / "out.txt").read()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = open(tmp_path / "out.txt").read()
    stop = max(logged_train_steps(run)) + 1
    assert f"stopped by signal at step {stop}, checkpoint saved" in out and "SignalException" in out, out[-3000:]
    assert checkpoint_names(run) == [f"ckpt_{stop:06d}.pt"]
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = " ".join(f.read().split())
    assert ("SIGTERM or SIGINT to torchrun itself" in readme and "exits 1 with a `SignalException` traceback" in readme
            and "signal the workers instead (`pkill -TERM -P $PID`, or `-INT`)" in readme)


def test_resume_from_an_older_checkpoint_then_auto_resume_continues_it(shards, tmp_path, capsys):
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--checkpoint-every", "2", "--log-dir", log_dir]
    assert run_main(args + ["--max-steps", "6"], capsys)[0] == 0  # ckpt 4 and 6
    code, out, _ = run_main(args + ["--max-steps", "5", "--resume", checkpoint_path(log_dir, 4)], capsys)  # roll back
    assert code == 0 and "resuming from the checkpoint of step 4" in out
    assert os.path.exists(str(checkpoint_path(log_dir, 6)) + ".abandoned")  # moved aside, not deleted
    code, out, _ = run_main(args + ["--max-steps", "7"], capsys)
    assert "resuming from the checkpoint of step 5" in out  # the run just made, not the one rolled back from


def test_flags_win_over_the_checkpoints_optimizer_settings(shards, tmp_path, capsys):
    """Resuming with a new --weight-decay uses it: load_state_dict alone would bring back the saved one."""
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--log-dir", log_dir]
    assert run_main(args + ["--max-steps", "2", "--weight-decay", "0.1"], capsys)[0] == 0
    assert run_main(args + ["--max-steps", "3", "--weight-decay", "0.0"], capsys)[0] == 0
    [optimizer] = load_ckpt(checkpoint_path(log_dir, 3))["optimizers"]
    assert [group["weight_decay"] for group in optimizer["param_groups"]] == [0.0, 0.0]


def test_resuming_under_another_seed_is_refused(shards, tmp_path, capsys):
    """The shard order depends on --seed: the saved position means nothing under another one."""
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--log-dir", log_dir]
    assert run_main(args + ["--max-steps", "2"], capsys)[0] == 0
    expect_usage_error(args + ["--max-steps", "3", "--seed", "7"], capsys, "--seed 1337", "--seed 7")


def test_a_signal_before_an_evaluation_saves_first_and_the_resumed_run_evaluates(shards, tmp_path, capsys,
                                                                                  monkeypatch):
    """A signal that lands after a step's stop vote, with an evaluation due next: the run saves without evaluating
    (the grace period before SIGKILL is short), and the resumed run does that evaluation, once."""
    args = TINY + ["--data", shards, "--max-steps", "8", "--eval-every", "4", "--checkpoint-every", "0"]
    assert run_main(args + ["--log-dir", tmp_path / "ref"], capsys)[0] == 0
    log_dir = tmp_path / "run"
    real_train_step = train_gpt2.train_step

    def train_step_then_signal(*a, **k):
        result = real_train_step(*a, **k)
        if len(train_records(read_log(log_dir))) == 3:  # step 3, after its vote
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(train_gpt2, "train_step", train_step_then_signal)
    code, out, err = run_main(args + ["--log-dir", log_dir], capsys)
    assert code == 0, err
    assert "stopped by signal at step 4" in out
    assert sorted(val_records(read_log(log_dir))) == [0]  # step 4's evaluation was left to the resumed run
    assert load_ckpt(checkpoint_path(log_dir, 4))["evaluated"] is False
    monkeypatch.undo()
    code, out, err = run_main(args + ["--log-dir", log_dir], capsys)
    assert code == 0, err
    resumed, reference = read_log(log_dir), read_log(tmp_path / "ref")
    assert [r["step"] for r in resumed if "val_loss" in r] == [0, 4, 8]
    for step in (4, 8):
        assert val_records(resumed)[step]["val_loss"] == val_records(reference)[step]["val_loss"]


def test_the_end_is_saved_before_its_evaluations_and_a_signal_stops_them(shards, tmp_path, capsys):
    """The final evaluations (HellaSwag, CORE) take minutes, longer than a cluster's grace period between SIGTERM and
    SIGKILL: the end was saved after them, and a signal waited for them, so that SIGTERM then SIGKILL lost every step
    since the last checkpoint. The end is saved first, a signal stops the evaluations at their next forward pass, and
    the resumed run does them. Here the long evaluation is the samples (20,000 forward passes), after the validation
    loss's line."""
    log_dir, out = tmp_path / "log", tmp_path / "out.txt"
    args = TINY + ["--data", shards, "--max-steps", "3", "--checkpoint-every", "0", "--prompt", "a",
                   "--log-dir", log_dir]
    proc = start_script(args + ["--num-samples", "80", "--max-new-tokens", "1000"], tmp_path, out)
    try:
        wait_for_output(proc, out, "step     3 | val loss")
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(3)  # the grace period
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.wait(30) == 0, open(out).read()[-3000:]
    printed = open(out).read()
    saved, validated = printed.index(f"saved {checkpoint_path(log_dir, 3)} "), printed.index("step     3 | val loss")
    assert saved < validated  # before the evaluations: SIGKILL at the end of the grace period loses nothing
    assert "stopped by signal at step 3 (the last: only its final evaluation is left), checkpoint saved" in printed
    assert "--- sample" not in printed and "Traceback" not in printed, printed[-3000:]
    assert checkpoint_names(log_dir) == ["ckpt_000003.pt"]
    assert load_ckpt(checkpoint_path(log_dir, 3))["evaluated"] is False

    code, printed, err = run_main(args, capsys)  # the evaluations of the end, again
    assert code == 0 and "done: step 3" in printed, err
    val_losses = [r["val_loss"] for r in read_log(log_dir) if "val_loss" in r]
    assert len(val_losses) == 2 and val_losses[0] == val_losses[1]  # the same weights: the same loss
    assert load_ckpt(checkpoint_path(log_dir, 3))["evaluated"] is True


def test_a_signal_to_one_rank_stops_both_in_the_same_forward_pass_of_an_evaluation(tmp_path):
    """Every rank votes on a stop signal before each forward pass of an evaluation: a signal to one rank alone (here
    rank 1, during the final validation loss over 400,000 tokens) stops both at the same one, or they would wait for
    each other in different collectives."""
    data, log_dir, out = write_shards(tmp_path / "data", val_length=400_000), tmp_path / "log", tmp_path / "out.txt"
    args = TINY + ["--data", data, "--max-steps", "2", "--checkpoint-every", "0", "--val-tokens", "400000",
                   "--log-dir", log_dir]
    with open(out, "w") as f:
        proc = start_command(script_command(args, nproc=2), tmp_path, script_env(), stdout=f,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_output(proc, out, f"saved {checkpoint_path(log_dir, 2)}")  # the end, saved before its evaluations
        time.sleep(0.5)
        os.kill(ranks_of(proc.pid, log_dir)[1], signal.SIGTERM)
        assert proc.wait(10) == 0, open(out).read()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "stopped by signal at step 2 (the last: only its final evaluation is left)" in open(out).read()
    assert val_records(read_log(log_dir)) == {} and load_ckpt(checkpoint_path(log_dir, 2))["evaluated"] is False


def test_a_finished_run_is_left_alone_and_a_lower_max_steps_is_refused(shards, tmp_path, capsys):
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--checkpoint-every", "2", "--log-dir", log_dir]
    assert run_main(args + ["--max-steps", "4"], capsys)[0] == 0
    finished = open(log_dir / "log.jsonl").read()
    code, out, err = run_main(args + ["--max-steps", "4"], capsys)
    assert code == 0, err
    assert "nothing left to do" in out and "ckpt_000004.pt" in out
    assert open(log_dir / "log.jsonl").read() == finished  # not even the final evaluation again
    expect_usage_error(args + ["--max-steps", "3"], capsys, "ckpt_000004.pt", "step 4", "past --max-steps 3",
                       "--no-resume")
    assert checkpoint_names(log_dir) == ["ckpt_000002.pt", "ckpt_000004.pt"]
    assert open(log_dir / "log.jsonl").read() == finished
    with open(str(checkpoint_path(log_dir, 5)) + ".tmp", "wb") as f:  # a save that a crash cut short
        f.write(b"half a checkpoint")
    code, out, err = run_main(args + ["--max-steps", "5"], capsys)
    assert code == 0 and "resuming from the checkpoint of step 4" in out, err
    assert sorted(os.listdir(log_dir)) == [".lock", "ckpt_000004.pt", "ckpt_000005.pt", "log.jsonl"]


class RunsCodeWhenUnpickled:
    """Unpickling this calls open(path, "w"): a checkpoint holding it would run code if loaded without weights_only."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_checkpoint_that_would_run_code_is_refused(shards, tmp_path, capsys):
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--checkpoint-every", "1", "--log-dir", log_dir]
    assert run_main(args + ["--max-steps", "2"], capsys)[0] == 0
    marker = tmp_path / "code_ran"
    ckpt = load_ckpt(checkpoint_path(log_dir, 2))
    ckpt["note"] = RunsCodeWhenUnpickled(str(marker))
    torch.save(ckpt, checkpoint_path(log_dir, 2))
    code, out, err = run_main(args + ["--max-steps", "3"], capsys)
    assert code == 0, err
    assert not marker.exists()
    assert "warning: skipping unreadable checkpoint" in out and "ckpt_000002.pt" in out
    assert "resuming from the checkpoint of step 1" in out


def test_directory_names_are_paths_not_glob_patterns(tmp_path, capsys):
    """A data dir `data[1]` and a log dir `run[a]`: read as glob patterns, the shards were not found and the second
    start found no checkpoint, started fresh and moved the whole run aside."""
    data = write_shards(tmp_path / "data[1]")
    log_dir = tmp_path / "run[a]"
    args = TINY + ["--data", data, "--log-dir", log_dir]
    code, _, err = run_main(args + ["--max-steps", "2"], capsys)
    assert code == 0, err
    code, out, err = run_main(args + ["--max-steps", "3"], capsys)
    assert code == 0, err
    assert "resuming from the checkpoint of step 2" in out and "starting fresh" not in out
    assert sorted(train_records(read_log(log_dir))) == [0, 1, 2]
    assert checkpoint_names(log_dir) == ["ckpt_000002.pt", "ckpt_000003.pt"]


def test_checkpoints_past_step_999999_are_ordered_by_step(shards, tmp_path, capsys):
    """ckpt_999999.pt sorts after ckpt_1000000.pt as text: pruning deleted the new one and resume took the old."""
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--log-dir", log_dir, "--checkpoint-every", "1"]
    assert run_main(args + ["--max-steps", "1"], capsys)[0] == 0
    ckpt = load_ckpt(checkpoint_path(log_dir, 1))
    ckpt["step"] = 999_999  # as if this run had come that far
    os.remove(checkpoint_path(log_dir, 1))
    torch.save(ckpt, checkpoint_path(log_dir, 999_999))
    args += ["--max-steps", "1000001"]
    code, out, err = run_main(args, capsys)
    assert code == 0, err
    assert "resuming from the checkpoint of step 999999" in out
    assert checkpoint_names(log_dir) == ["ckpt_1000000.pt", "ckpt_1000001.pt"]
    code, out, err = run_main(args, capsys)
    assert code == 0, err
    assert "nothing left to do" in out and "ckpt_1000001.pt" in out


def test_a_signal_in_the_last_step_leaves_a_run_that_finishes(shards, tmp_path, capsys, monkeypatch):
    """SIGTERM in the last step saves the final checkpoint unevaluated. The next start evaluates it and records that,
    so the start after says "nothing left to do" instead of evaluating (and logging) the end again each time; and
    --sample never passes off an older step's validation loss as the checkpoint's."""
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--max-steps", "3", "--eval-every", "10", "--log-dir", log_dir]
    real_train_step = train_gpt2.train_step

    def train_step_then_signal(*a, **k):
        if len(logged_train_steps(log_dir)) == 2:  # step 2, the last, before its vote
            os.kill(os.getpid(), signal.SIGTERM)
        return real_train_step(*a, **k)

    monkeypatch.setattr(train_gpt2, "train_step", train_step_then_signal)
    code, out, err = run_main(args, capsys)
    assert code == 0, err
    assert "stopped by signal at step 3" in out
    monkeypatch.undo()
    assert load_ckpt(checkpoint_path(log_dir, 3))["evaluated"] is False
    sample = ["--sample", checkpoint_path(log_dir, 3), "--device", "cpu", "--num-samples", "0"]
    code, out, err = run_main(sample, capsys)
    assert code == 0, err
    step0_loss = val_records(read_log(log_dir))[0]["val_loss"]
    assert "not evaluated" in out.splitlines()[0] and f"{step0_loss:.4f} at step 0" in out.splitlines()[0]

    code, out, err = run_main(args, capsys)  # evaluates the end, once
    assert code == 0, err
    assert sorted(val_records(read_log(log_dir))) == [0, 3]
    final_loss = val_records(read_log(log_dir))[3]["val_loss"]
    assert load_ckpt(checkpoint_path(log_dir, 3))["evaluated"] is True
    finished = open(log_dir / "log.jsonl").read()
    code, out, err = run_main(args, capsys)
    assert code == 0, err
    assert "nothing left to do" in out
    assert open(log_dir / "log.jsonl").read() == finished
    code, out, err = run_main(sample, capsys)
    assert code == 0, err
    assert f"val loss {final_loss:.4f}" in out.splitlines()[0]


def test_a_full_disk_stops_the_run_in_one_line_and_keeps_the_last_checkpoint(shards, tmp_path, capsys):
    """A real ENOSPC: the log dir is a tmpfs with room for one checkpoint, not two. torch.save's error used to end the
    run with a traceback (RuntimeError: [enforce fail at inline_container.cc]) and leave the partial .tmp behind."""
    args = TINY + ["--data", shards, "--max-steps", "3", "--checkpoint-every", "1"]
    assert run_main(args + ["--max-steps", "1", "--log-dir", tmp_path / "sized"], capsys)[0] == 0
    size = os.path.getsize(checkpoint_path(tmp_path / "sized", 1))
    log_dir = tmp_path / "log"
    result = run_script_on_tmpfs(args + ["--log-dir", log_dir], tmp_path, log_dir, f"size={size * 3 // 2 // 4096 * 4}k")
    line = check_usage_error(result.returncode, result.stdout, result.stderr, "disk full",
                             checkpoint_path(log_dir, 2), "MiB", "ckpt_000001.pt")
    assert re.search(r"needs about [\d.]+ MiB", line), line
    assert f"saved {checkpoint_path(log_dir, 1)}" in result.stdout
    # no partial ckpt_000002.pt.tmp (ls -A: the lock file too; sorted here, as ls's order follows the locale)
    assert sorted(result.stdout.splitlines()[-1].split()) == [".lock", "ckpt_000001.pt", "log.jsonl"]


def test_files_of_the_users_own_in_the_log_dir_stay_where_they_are(shards, tmp_path, capsys):
    """`mkdir run1; python train_gpt2.py --log-dir run1 > run1/out.txt`: there is no earlier run, only the shell's
    out.txt, and the run must start in run1 as it is. A fresh start later moves only the earlier run's own files
    aside."""
    log_dir = tmp_path / "run1"
    log_dir.mkdir()
    args = TINY + ["--data", shards, "--log-dir", log_dir, "--max-steps", "2"]
    with open(log_dir / "out.txt", "w") as out:
        process = start_command(script_command(args), tmp_path, script_env(), stdout=out, stderr=subprocess.PIPE,
                                text=True)
        _, stderr = process.communicate(timeout=240)
    assert process.returncode == 0, stderr[-3000:]
    assert "done: step 2" in (log_dir / "out.txt").read_text()
    (log_dir / "notes").mkdir()
    (log_dir / "notes" / "plan.md").write_text("mine")
    first = (log_dir / "log.jsonl").read_text()
    code, out, err = run_main(args + ["--no-resume", "--max-steps", "1"], capsys)
    assert code == 0, err
    moved = re.search(r"moved the old run's files \(ckpt_000002.pt, log.jsonl\) from (\S+) aside to (\S+)$", out, re.M)
    assert moved and moved.group(1) == str(log_dir), out
    aside = moved.group(2)
    assert os.path.dirname(aside) == str(tmp_path) and os.path.basename(aside).startswith("run1.")
    assert sorted(os.listdir(aside)) == ["ckpt_000002.pt", "log.jsonl"]
    assert open(os.path.join(aside, "log.jsonl")).read() == first
    assert sorted(os.listdir(log_dir)) == [".lock", "ckpt_000001.pt", "log.jsonl", "notes", "out.txt"]
    assert "done: step 2" in (log_dir / "out.txt").read_text() and (log_dir / "notes" / "plan.md").read_text() == "mine"


def test_eval_only_evaluates_the_latest_checkpoint(shards, tmp_path, capsys):
    """--eval-only in a run's log dir, without --resume: its help says it evaluates the resumed model; it evaluated
    random weights and appended them to the run's log."""
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--log-dir", log_dir, "--max-lr", "1e-2", "--warmup-steps", "1"]
    assert run_main(args + ["--max-steps", "4", "--checkpoint-every", "2"], capsys)[0] == 0
    trained = val_records(read_log(log_dir))[4]["val_loss"]
    code, out, err = run_main(args + ["--eval-only"], capsys)
    assert code == 0, err
    last = read_log(log_dir)[-1]
    assert last == {"step": 4, "tokens": 4 * 256, "val_loss": trained, "eval_only": True,
                    "init_from": checkpoint_path(log_dir, 4)}


def test_eval_only_counts_the_tokens_of_the_checkpoints_batch_not_the_commands(shards, tmp_path, capsys):
    """--eval-only logs tokens = step x the --total-batch-size the checkpoint was trained with: a step-30 checkpoint
    of a 256-token-a-step run, evaluated with --total-batch-size 512, logged 15,360 tokens for 7,680."""
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--log-dir", log_dir]  # 256 tokens a step
    assert run_main(args + ["--max-steps", "3"], capsys)[0] == 0
    trained = val_records(read_log(log_dir))[3]
    assert trained["tokens"] == 3 * 256
    code, out, err = run_main(args + ["--eval-only", "--total-batch-size", "512"], capsys)
    assert code == 0, err
    last = read_log(log_dir)[-1]
    assert last["eval_only"] is True and last["step"] == 3
    assert last["tokens"] == 3 * 256, last  # not 3 x 512
    assert last["val_loss"] == trained["val_loss"]


def test_resuming_on_other_data_or_batch_is_refused(shards, tmp_path, capsys):
    """The saved position is an offset into the shards in their shuffled order, and the steps count batches of
    --total-batch-size tokens: other shards with the same count, or another batch, made it meaningless."""
    log_dir = tmp_path / "log"
    args = TINY + ["--log-dir", log_dir, "--max-steps", "3"]
    assert run_main(args + ["--data", shards, "--max-steps", "2"], capsys)[0] == 0
    other = write_shards(tmp_path / "other", train_lengths=(3000, 2400))
    expect_usage_error(args + ["--data", other], capsys, "synth_train_000001.npy", "2,500", "2,400", "--data",
                       "--no-resume")
    renamed = write_shards(tmp_path / "renamed")
    os.rename(os.path.join(renamed, "synth_train_000001.npy"), os.path.join(renamed, "synth_train_000009.npy"))
    expect_usage_error(args + ["--data", renamed], capsys, "synth_train_000001.npy", "synth_train_000009.npy",
                       "--no-resume")
    expect_usage_error(args + ["--data", shards, "--total-batch-size", "512"], capsys,
                       "--total-batch-size 256", "not 512", "--no-resume")
    moved = shutil.copytree(shards, tmp_path / "moved")  # the same shards elsewhere: the same position
    code, out, err = run_main(args + ["--data", moved], capsys)
    assert code == 0 and "resuming from the checkpoint of step 2" in out, err


def as_format_1(ckpt):
    """A checkpoint as train_gpt2.py wrote it before checkpoints had a format: no "format" key, one "optimizer", and
    (the oldest) a data position that holds only the shards' count."""
    old = {k: v for k, v in ckpt.items() if k not in ("format", "optimizers")}
    [old["optimizer"]] = ckpt["optimizers"]
    old["stream"] = {k: v for k, v in ckpt["stream"].items() if k != "shards"} | {"n_shards": 2}
    return old


def test_a_checkpoint_of_an_older_format_is_refused_in_one_line(shards, tmp_path, capsys):
    """Checkpoints written before the format was recorded (format 1: one optimizer, and some without the shards'
    names) were read through fallbacks; now any other format is refused, naming it, and nothing is moved aside."""
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--log-dir", log_dir]
    assert run_main(args + ["--max-steps", "2"], capsys)[0] == 0
    path = checkpoint_path(log_dir, 2)
    torch.save(as_format_1(load_ckpt(path)), path)
    logged = open(log_dir / "log.jsonl").read()
    for argv in (args + ["--max-steps", "3"], args + ["--max-steps", "3", "--resume", path], args + ["--eval-only"],
                 ["--sample", path, "--device", "cpu"]):
        expect_usage_error(argv, capsys, path, "format 1", "format 2")
    assert checkpoint_names(log_dir) == ["ckpt_000002.pt"] and "format" not in load_ckpt(path)
    assert open(log_dir / "log.jsonl").read() == logged
    newer = dict(load_ckpt(path), format=3)  # a checkpoint of a later train_gpt2.py: named too
    torch.save(newer, path)
    expect_usage_error(args + ["--max-steps", "3"], capsys, path, "format 3", "format 2")


def test_the_new_checkpoint_is_durable_before_old_ones_are_deleted(shards, tmp_path, capsys, monkeypatch):
    """The renamed checkpoint's directory entry is synced before pruning: else a power cut could keep the deletion of
    the old checkpoints but lose the new one's name, leaving none."""
    log_dir = tmp_path / "log"
    events = []
    real_fsync, real_replace, real_remove = os.fsync, os.replace, os.remove

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            events.append(("sync dir", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace",
                        lambda src, dst: (events.append(("rename", str(dst))), real_replace(src, dst))[1])
    monkeypatch.setattr(os, "remove", lambda path: (events.append(("remove", str(path))), real_remove(path))[1])
    args = TINY + ["--data", shards, "--log-dir", log_dir, "--max-steps", "2", "--checkpoint-every", "1",
                   "--keep-checkpoints", "1"]
    assert run_main(args, capsys)[0] == 0
    saving_2 = events[events.index(("rename", checkpoint_path(log_dir, 2))):]
    assert saving_2[:3] == [("rename", checkpoint_path(log_dir, 2)), ("sync dir", str(log_dir)),
                            ("remove", checkpoint_path(log_dir, 1))]


def test_resuming_a_middle_checkpoint_as_the_end_evaluates_it(shards, tmp_path, capsys):
    """A checkpoint saved mid-run, with no evaluation due at its step, resumed with --max-steps at that step: it is the
    end of this run, unvalidated, and gets its final evaluation (it crashed on its missing val loss)."""
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--log-dir", log_dir, "--checkpoint-every", "2"]
    assert run_main(args + ["--max-steps", "4"], capsys)[0] == 0
    code, out, err = run_main(args + ["--max-steps", "2", "--resume", checkpoint_path(log_dir, 2)], capsys)
    assert code == 0, err
    assert "done: step 2, val loss" in out
    assert [r["step"] for r in read_log(log_dir) if "val_loss" in r][-1] == 2


@pytest.mark.parametrize("fsdp", [[], ["--fsdp"]])
def test_resuming_twice_from_one_checkpoint_keeps_each_abandoned_one(shards, tmp_path, capsys, fsdp):
    """The README's way back from divergence (lower --max-lr, --resume an earlier checkpoint), taken twice: under
    --fsdp the second was refused ("Directory not empty": the first's abandoned directory was in the way), and without
    it the second abandoned checkpoint replaced the first. Each is kept under a name of its own, which its line names,
    and a fresh start moves them all aside."""
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--max-steps", "8", "--checkpoint-every", "4", "--keep-checkpoints", "3",
                   "--log-dir", log_dir, *fsdp]
    four, eight = (str(log_dir / f"ckpt_{step:06d}{'.dcp' if fsdp else '.pt'}") for step in (4, 8))

    def max_lr(path):  # which run wrote the checkpoint at path
        return load_ckpt(os.path.join(path, "run.pt") if fsdp else path)["train_config"]["max_lr"]

    assert run_main(args + ["--max-lr", "6e-4"], capsys)[0] == 0
    for lr, aside in (("3e-4", f"{eight}.abandoned"), ("1e-4", f"{eight}.abandoned.1")):
        code, out, err = run_main(args + ["--max-lr", lr, "--resume", four], capsys)
        assert code == 0, err
        assert f"moved {eight} aside to {aside}: this run continues from step 4" in out
    assert [max_lr(path) for path in (f"{eight}.abandoned", f"{eight}.abandoned.1", eight)] == [6e-4, 3e-4, 1e-4]
    code, out, err = run_main(args + ["--no-resume", "--max-steps", "1", "--checkpoint-every", "0"], capsys)
    assert code == 0, err
    assert "ckpt_000008" + (".dcp" if fsdp else ".pt") + ".abandoned.1, " in out  # moved aside with the rest
    assert not [name for name in os.listdir(log_dir) if "abandoned" in name]


def test_resuming_another_directorys_checkpoint_moves_the_run_in_log_dir_aside(shards, tmp_path, capsys):
    """A run in X, another in Y, then X resumed from Y's checkpoint: X's checkpoints were pruned away and its
    log.jsonl went on as if the two runs were one. The run in X is another run than the checkpoint's: it is moved
    aside whole, as a fresh start moves it, and says so, and X's log begins with the resume. A checkpoint of X by
    another path (a link) is X's own: resuming it goes on with X's run, as resuming any of its checkpoints does."""
    x, y, link = tmp_path / "X", tmp_path / "Y", tmp_path / "link"
    args = TINY + ["--data", shards, "--checkpoint-every", "2"]
    assert run_main(args + ["--log-dir", x, "--max-steps", "6", "--keep-checkpoints", "5", "--seed", "7"],
                    capsys)[0] == 0
    x_log = open(x / "log.jsonl").read()
    assert run_main(args + ["--log-dir", y, "--max-steps", "12"], capsys)[0] == 0
    code, out, err = run_main(args + ["--log-dir", x, "--resume", checkpoint_path(y, 12), "--max-steps", "20",
                                      "--keep-checkpoints", "2"], capsys)
    assert code == 0, err
    moved = re.search(r"resuming (\S+), a checkpoint of another directory: moved the old run's files \(.*\) from (\S+) "
                      r"aside to (\S+)\n", out)
    assert moved and moved.groups()[:2] == (checkpoint_path(y, 12), str(x)), out
    aside = moved.group(3)
    assert sorted(os.listdir(aside)) == ["ckpt_000002.pt", "ckpt_000004.pt", "ckpt_000006.pt", "log.jsonl"]
    assert open(os.path.join(aside, "log.jsonl")).read() == x_log
    records = read_log(x)
    assert records[0]["event"] == "resume" and records[0]["step"] == 12
    assert sorted(train_records(records)) == list(range(12, 20))
    assert checkpoint_names(x) == ["ckpt_000018.pt", "ckpt_000020.pt"]
    assert checkpoint_names(y) == ["ckpt_000010.pt", "ckpt_000012.pt"]  # untouched
    os.symlink(x, link)
    code, out, err = run_main(args + ["--log-dir", x, "--resume", checkpoint_path(link, 18), "--max-steps", "19"],
                              capsys)
    assert code == 0, err
    assert f"moved {checkpoint_path(x, 20)} aside to {checkpoint_path(x, 20)}.abandoned" in out
    assert "another directory" not in out and read_log(x)[:len(records)] == records


def cosine_lr(step, warmup, max_steps, peak=6e-4, end=6e-5):
    """GPT-2's rate after its warmup, written out: down from peak at the warmup's end to end at the last step."""
    return end + 0.5 * (1 + math.cos(math.pi * (step - warmup) / (max_steps - 1 - warmup))) * (peak - end)


def test_a_resumed_run_keeps_its_warmup_and_says_how_its_schedule_changes(shards, tmp_path, capsys):
    """A run of 20 steps warms up for 2, a tenth of it, as the file's 715 do not fit. Resumed with a larger
    --max-steps, it took the file's warmup again: cut to a tenth of the new length, or past 715 steps whole, its rate
    falling back into a warmup. It keeps the run's 2, and one line says how the schedule changes and what the rate
    does next; the rate then follows the run's warmup onto the cosine to the new end."""
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--log-dir", log_dir]
    code, out, err = run_main(args + ["--max-steps", "20"], capsys)
    assert code == 0 and "warming up for 2 steps instead" in out, err
    code, out, err = run_main(args + ["--max-steps", "30"], capsys)
    assert code == 0, err
    assert "warming up" not in out
    # the cosine from step 2 to step 29, a third of the way at step 20: 10% + 90% x (1 + cos(2 pi / 3)) / 2 = 32.5%
    assert ("the schedule changes on resuming: --max-steps 30 (was 20), --warmup-steps 2 (as before); the learning "
            "rate goes from 10% of its peak at step 19 to 32.5% at step 20, then to 10% at step 29\n") in out
    lrs = {step: record["lr"] for step, record in train_records(read_log(log_dir)).items() if step >= 20}
    assert lrs == pytest.approx({step: cosine_lr(step, 2, 30) for step in range(20, 30)}, rel=1e-6)
    assert load_ckpt(checkpoint_path(log_dir, 30))["train_config"]["warmup_steps"] == 2
    # the run's warmup, unless given, or too long for the run (its tenth then, as for a fresh start)
    for max_steps, warmup, given, kept in ((800, 2, {}, 2), (500, 715, {}, 50), (800, 2, {"warmup_steps": 50}, 50)):
        draft = resolution.Draft(train_gpt2.TrainConfig(max_steps=max_steps, **given), set(given))
        resolution.fit_warmup(draft, resumed={"warmup_steps": warmup})
        assert draft.done().warmup_steps == kept, (max_steps, warmup, given)


@needs_muon
def test_a_resumed_modern_run_says_how_its_cool_down_moves(shards, tmp_path, capsys):
    """The modern recipe's rate, cooled down at the end of a run of 4 steps, goes back up to its peak when the run is
    resumed to 8, and cools down over the last 40% of those: one line says so."""
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--log-dir", log_dir, "--recipe", "modern"]
    assert run_main(args + ["--max-steps", "4"], capsys)[0] == 0
    code, out, err = run_main(args + ["--max-steps", "8"], capsys)
    assert code == 0, err
    assert ("the schedule changes on resuming: --max-steps 8 (was 4), --warmup-steps 0 (as before); the learning "
            "rate goes from 10% of its peak at step 3 to 100% at step 4, then to 10% at step 7\n") in out
    lrs = [record["lr"] for step, record in sorted(train_records(read_log(log_dir)).items())]
    # Muon's 0.02, held, then down to 10% of it over the last 40% of the steps after the first (of 3, then of 7)
    peak = 0.02
    assert lrs == pytest.approx([peak, peak, 0.85 * peak, 0.1 * peak] +
                                [peak * (0.1 + 0.9 * min(1, (7 - s) / 2.8)) for s in range(4, 8)])


def test_a_log_dir_linked_to_another_file_system_moves_its_old_run_aside_there(shards, tmp_path, capsys):
    """`log -> /scratch/...`: --log-dir a link from the disk to a tmpfs (/dev/shm). A fresh start moved the old run's
    files beside the link, onto the disk, which no rename reaches (EXDEV): it failed in one line blaming the directory,
    and left an empty directory beside the link at each try. They go beside the directory the link leads to."""
    if os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("/dev/shm is on the file system of the tests' temporary directory")
    target = tempfile.mkdtemp(dir="/dev/shm")
    try:
        link = tmp_path / "linkX"
        os.symlink(os.path.join(target, "x"), link)
        os.mkdir(os.path.join(target, "x"))
        args = TINY + ["--data", shards, "--log-dir", link, "--max-steps", "1"]
        assert run_main(args, capsys)[0] == 0
        asides = []
        for _ in range(2):
            code, out, err = run_main(args + ["--no-resume"], capsys)
            assert code == 0, err
            moved = re.search(r"from (\S+) aside to (\S+)$", out, re.M)
            assert moved and moved.group(1) == str(link), out
            asides.append(moved.group(2))
            assert os.path.dirname(asides[-1]) == target and os.path.basename(asides[-1]).startswith("x.")
            assert sorted(os.listdir(asides[-1])) == ["ckpt_000001.pt", "log.jsonl"]
        assert asides[0] != asides[1]
        assert sorted(os.listdir(tmp_path)) == ["data", "linkX"]  # nothing left beside the link
    finally:
        shutil.rmtree(target)


def test_a_log_dir_that_is_a_mount_point_keeps_its_old_run_on_its_own_file_system(shards, tmp_path, capsys):
    """--log-dir the root of a file system (a container's bind mount, a scratch volume): the directory beside it is
    on another one, which no rename reaches. The old run's files are moved aside inside it."""
    first = tmp_path / "first"
    args = TINY + ["--data", shards, "--max-steps", "1"]
    assert run_main(args + ["--log-dir", first], capsys)[0] == 0
    log_dir = tmp_path / "mnt"
    result = run_script_on_tmpfs(args + ["--log-dir", log_dir, "--no-resume"], tmp_path, log_dir, "size=16m",
                                 before=f"cp {first}/ckpt_000001.pt {first}/log.jsonl .")
    assert result.returncode == 0, result.stderr
    moved = re.search(r"from (\S+) aside to (\S+)$", result.stdout, re.M)
    assert moved and moved.group(1) == str(log_dir), result.stdout
    aside = moved.group(2)
    assert os.path.dirname(aside) == str(log_dir) and os.path.basename(aside).startswith("mnt.")
    left = result.stdout.splitlines()[-1].split()
    assert sorted(left) == sorted([".lock", "ckpt_000001.pt", "log.jsonl", os.path.basename(aside)])
    assert sorted(os.listdir(tmp_path)) == ["data", "first", "mnt"]


def test_a_file_that_cannot_be_moved_aside_leaves_the_old_run_whole(shards, tmp_path, capsys):
    """A fresh start that failed to move one of the old run's files aside (here its wandb/, a mount point, which no
    rename moves) had moved those before it: the run was split in two. They are moved back, and the line says why."""
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--log-dir", log_dir, "--max-steps", "1"]
    assert run_main(args, capsys)[0] == 0
    result = run_script_on_tmpfs(args + ["--no-resume"], tmp_path, log_dir / "wandb", "size=1m")
    check_usage_error(result.returncode, result.stdout, result.stderr, f"--log-dir {log_dir}: cannot use it (",
                      "Device or resource busy")
    assert sorted(os.listdir(log_dir)) == [".lock", "ckpt_000001.pt", "log.jsonl", "wandb"]
    assert sorted(os.listdir(tmp_path)) == ["data", "log"]  # no directory aside


def test_resuming_a_link_to_a_checkpoint_of_log_dir_goes_on_with_its_run(shards, tmp_path, capsys):
    """--resume zz/latest.pt, a link to sl/ckpt_000004.pt, with --log-dir sl: the checkpoint is sl's own, by
    whatever path. It counted as another directory's: sl's run was moved aside, the link left dangling, and a new
    log.jsonl begun."""
    sl, zz = tmp_path / "sl", tmp_path / "zz"
    args = TINY + ["--data", shards, "--log-dir", sl, "--checkpoint-every", "2"]
    assert run_main(args + ["--max-steps", "6"], capsys)[0] == 0
    records = read_log(sl)
    zz.mkdir()
    os.symlink(os.path.join("..", "sl", "ckpt_000004.pt"), zz / "latest.pt")
    code, out, err = run_main(args + ["--max-steps", "6", "--resume", zz / "latest.pt"], capsys)
    assert code == 0, err
    assert "another directory" not in out
    assert f"moved {checkpoint_path(sl, 6)} aside to {checkpoint_path(sl, 6)}.abandoned" in out
    after = read_log(sl)
    assert after[:len(records)] == records and after[len(records)]["event"] == "resume"
    assert checkpoint_names(sl) == ["ckpt_000004.pt", "ckpt_000006.pt"]
