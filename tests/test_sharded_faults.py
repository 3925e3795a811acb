"""--fsdp's checkpoints, from one run's on 2 gloo processes (tests/scripts/ranks.py): the end saved again as its
run.pt alone; the tied embedding stored once, and a checkpoint written before, with it twice, read as well; a slice
damaged by random bytes (every reader goes back past it, or refuses it in one line); and one rank at its open-file
limit (prlimit on its pid: the steps trained are saved, or where no save can be, the line names the checkpoint kept)."""
import os
import resource
import shutil
import signal
import subprocess
import time

import pytest
import torch

import train_gpt2
from helpers import (
    TINY,
    expect_usage_error,
    logged_train_steps,
    ranks_of,
    read_log,
    run_main,
    run_script,
    scribble,
    script_command,
    script_env,
    start_command,
    train_records,
    wait_for_step,
    write_shards,
)
from machinery import checkpoints, sharded_checkpoints

FSDP = ["--fsdp", "--checkpoint-every", "2", "--keep-checkpoints", "3"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-process --fsdp run of GPT-2's recipe to step 6, with checkpoints at steps 2, 4 and 6: (its flags, its log
    dir); its output in run.out beside that."""
    root = tmp_path_factory.mktemp("sharded_faults")
    args = TINY + ["--data", write_shards(root / "data"), *FSDP]
    result = run_script(args + ["--max-steps", "6", "--log-dir", root / "run"], cwd=root, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert checkpoints.checkpoint_paths(root / "run") == [str(root / "run" / f"ckpt_00000{step}.dcp")
                                                               for step in (2, 4, 6)]
    (root / "run.out").write_text(result.stdout)
    return args, root / "run"


def test_the_end_is_saved_whole_before_its_evaluations_then_its_run_file_alone(trained):
    """The end of a run is saved before its final evaluations (a preemption may come during them), and again once
    they are done, so that a resume does not do them again: that wrote the weights and optimizer state twice. Now the
    second save writes run.pt alone, the slices and their checksums kept: it holds the evaluations, and reads whole."""
    args, log_dir = trained
    end = log_dir / "ckpt_000006.dcp"
    output = (log_dir.parent / "run.out").read_text()
    saved = [line for line in output.splitlines() if line.startswith(f"saved {end} ")]
    assert len(saved) == 2 and "MiB in" in saved[0], saved
    assert saved[1].startswith(f"saved {end} again, with its step's evaluations (its run.pt alone, its slices as "
                               f"written: "), saved
    ckpt = checkpoints.load(str(end))
    assert ckpt["evaluated"] and ckpt["val_step"] == 6 and checkpoints.damage(ckpt, str(end)) is None
    assert sorted(ckpt["checksums"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    checkpoints.release(ckpt)


def copy_of(trained, tmp_path):
    args, log_dir = trained
    shutil.copytree(log_dir, tmp_path / "log")
    return args, tmp_path / "log"


def index_keys(checkpoint):
    dcp, _ = sharded_checkpoints.checkpoint_modules()
    return set(dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata)


def as_written_before(new, old):
    """The sharded checkpoint at new, written at old as this trainer wrote it before it stored the tied embedding once
    and checksummed its files: the embedding twice, as model.lm_head.weight too, and no checksums in run.pt. Returns
    new's contents whole."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    old.parent.mkdir()
    whole = old.parent / "whole.pt"
    dcp_to_torch_save(new, whole)
    contents = torch.load(whole, weights_only=True)
    weights = {**contents["model"], "lm_head.weight": contents["model"]["transformer.wte.weight"]}
    torch.save({**contents, "model": weights}, whole)
    torch_save_to_dcp(whole, old)
    run = torch.load(new / "run.pt", weights_only=True)
    del run["checksums"]
    torch.save(run, old / "run.pt")
    return contents


def test_the_tied_embedding_is_stored_once_and_a_checkpoint_with_it_twice_still_trains_on(trained, tmp_path, capsys):
    """GPT-2's head is its embedding, and the index listed both, each written: 147 MiB more at 124M. Now the embedding
    alone, as torch.save stores it, and every load ties the head to it again. A checkpoint written before, with both
    (and no checksums), still loads: its model's head is its embedding, and in one process with --fsdp it trains on
    exactly as the new one does."""
    args, log_dir = trained
    new = log_dir / "ckpt_000006.dcp"
    assert "model.transformer.wte.weight" in index_keys(new) and "model.lm_head.weight" not in index_keys(new)
    runs = {name: tmp_path / name / "ckpt_000006.dcp" for name in ("new", "old")}
    shutil.copytree(new, runs["new"])
    whole = as_written_before(new, runs["old"])
    assert "model.lm_head.weight" in index_keys(runs["old"])
    losses, descriptors = {}, []
    for name, path in runs.items():
        model = checkpoints.model_from_checkpoint(checkpoints.load(str(path)), str(path), train_gpt2.model_of)
        assert model.lm_head.weight is model.transformer.wte.weight
        assert torch.equal(model.lm_head.weight, whole["model"]["transformer.wte.weight"])
        code, out, err = run_main(args + ["--max-steps", "8", "--log-dir", path.parent], capsys)
        assert code == 0 and "resuming from the checkpoint of step 6" in out, err
        losses[name] = [record["train_loss"] for record in train_records(read_log(path.parent)).values()]
        descriptors.append(len(os.listdir("/proc/self/fd")))
    assert len(losses["old"]) == 2 and losses["old"] == losses["new"]
    assert descriptors[0] == descriptors[1]  # those kept for saving are let go as a run ends


# -----------------------------------------------------------------------------
# Damaged bytes


def test_damaged_slices_are_skipped_on_resume_as_every_rank_finds_them(trained, tmp_path):
    """The issue's case: random bytes in the middle of rank 0's slice file of the latest checkpoint, and of rank 1's
    of the one before. Each rank raised torch's CheckpointException (UnpicklingError), or went on from weights that
    were random bytes. Now each rank checks its share of the files against the checksums written with them, they
    vote, and the run resumes from the checkpoint of step 2, as it would past a damaged .pt: the same losses as the
    run that never stopped."""
    args, log_dir = copy_of(trained, tmp_path)
    scribble(log_dir / "ckpt_000006.dcp" / "__0_0.distcp")
    scribble(log_dir / "ckpt_000004.dcp" / "__1_0.distcp")
    result = run_script(args + ["--max-steps", "6", "--log-dir", log_dir], cwd=tmp_path, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warning:")]
    assert [line.split(" (")[0] for line in warnings] == [
        f"warning: skipping unreadable checkpoint {log_dir / name}" for name in ("ckpt_000006.dcp", "ckpt_000004.dcp")]
    assert "__0_0.distcp" in warnings[0] and "__1_0.distcp" in warnings[1], warnings
    assert "resuming from the checkpoint of step 2" in result.stdout
    before, again = train_records(read_log(trained[1])), train_records(read_log(log_dir))
    assert [again[step]["train_loss"] for step in range(2, 6)] == [before[step]["train_loss"] for step in range(2, 6)]


def test_a_damaged_slice_ends_each_command_that_reads_it_in_one_line(trained, tmp_path, capsys):
    """--sample, and --resume of it with --eval-only or --export-hf, refuse the damaged checkpoint in one line naming
    the file; --export-hf and --eval-only of the log directory go back to the checkpoint before, with a warning."""
    args, log_dir = copy_of(trained, tmp_path)
    damaged = log_dir / "ckpt_000006.dcp"
    scribble(damaged / "__0_0.distcp")
    expect_usage_error(["--sample", damaged, "--device", "cpu"], capsys, f"--sample {damaged}: cannot load it",
                       "__0_0.distcp")
    for command in (args + ["--eval-only"], ["--export-hf", tmp_path / "hf"]):
        expect_usage_error(command + ["--resume", damaged, "--log-dir", log_dir], capsys,
                           f"--resume {damaged}: cannot load it", "__0_0.distcp")
    for command, chosen in ((["--export-hf", tmp_path / "hf"], f"exported {log_dir / 'ckpt_000004.dcp'} to "),
                            (args + ["--eval-only"], f"evaluating {log_dir / 'ckpt_000004.dcp'} (step 4)")):
        code, out, err = run_main(command + ["--log-dir", log_dir], capsys)
        assert code == 0, err
        assert f"warning: skipping unreadable checkpoint {damaged} (__0_0.distcp" in out and chosen in out, out


# -----------------------------------------------------------------------------
# A rank at its open-file limit


def lowest_free_descriptor(pid, looks=5):
    """The lowest file descriptor number that the process pid does not hold, in any of a few looks 20 ms apart (one
    held as it reads a shard is let go again): with its open-file limit there, every number below is in use, so that
    it can open nothing more until it closes one."""
    held = None
    for _ in range(looks):
        now = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
        held = now if held is None else held & now
        time.sleep(0.02)
    return min(set(range(len(held) + 1)) - held)


def run_out_of_descriptors(args, log_dir, tmp_path, limit=None):
    """The run of args on 2 processes, with no checkpoint due, rank 1's open-file limit lowered once step 1 is
    logged: to limit, or (None) to its lowest free descriptor. (exit code, output, the step it stopped at)."""
    args = args + ["--max-steps", "100000", "--checkpoint-every", "0", "--log-dir", log_dir]
    with open(tmp_path / "out.txt", "w") as out:
        proc = start_command(script_command(args, nproc=2), tmp_path, script_env(), stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_step(proc, log_dir, logged_train_steps(log_dir)[-1] + 1 if logged_train_steps(log_dir) else 1)
        rank1 = ranks_of(proc.pid, log_dir)[1]
        _, hard = resource.prlimit(rank1, resource.RLIMIT_NOFILE)
        resource.prlimit(rank1, resource.RLIMIT_NOFILE, (limit or lowest_free_descriptor(rank1), hard))
        code = proc.wait(30)  # it hung for good, or went on training
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return code, (tmp_path / "out.txt").read_text(), max(logged_train_steps(log_dir)) + 1


def test_a_rank_at_its_open_file_limit_still_writes_its_slice(trained, tmp_path):
    """The issue's case: a fresh run, no checkpoint due, and rank 1 at its open-file limit (every descriptor below it
    in use), so that its next read of a shard fails. It raised OSError: [Errno 24] importing
    torch.distributed.checkpoint to save, the steps were lost, and a .tmp was left. Now that module is imported before
    training, and rank 1 writes its slice with a few descriptors it kept from its start for that: both ranks stop
    before the same step, saved, and each one's line names the limit to raise and the checkpoint, whole."""
    args, log_dir = trained[0], tmp_path / "log"
    code, out, stop = run_out_of_descriptors(args, log_dir, tmp_path)
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 2 and errors[0] == errors[1] and "Traceback" not in out, out[-3000:]
    saved = log_dir / f"ckpt_{stop:06d}.dcp"
    assert errors[0].startswith("error: rank 1: ") and "too many open files" in errors[0] and "ulimit -n" in errors[0]
    assert f"the run is saved at step {stop}" in errors[0] and f"resumes from {saved}" in errors[0], errors[0]
    assert sorted(os.listdir(log_dir)) == [".lock", f"ckpt_{stop:06d}.dcp", "log.jsonl"]  # no .tmp
    ckpt = checkpoints.load(str(saved))
    assert checkpoints.damage(ckpt, str(saved)) is None and ckpt["step"] == stop
    checkpoints.release(ckpt)


def test_a_rank_that_can_open_no_file_at_all_keeps_the_checkpoint_before(trained, tmp_path):
    """Rank 1's limit at 3 (stdin, stdout, stderr), below the descriptors it already holds: nothing it kept can help
    it write its slice. Every rank ends with one line that says so, and which checkpoint is kept; no .tmp is left."""
    args, log_dir = copy_of(trained, tmp_path)
    code, out, stop = run_out_of_descriptors(args, log_dir, tmp_path, limit=3)
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 2 and errors[0] == errors[1] and "Traceback" not in out, out[-3000:]
    assert errors[0].startswith("error: rank 1: ") and "too many open files" in errors[0], errors[0]
    assert f"saving the run failed too: rank 1 cannot write its part of {log_dir / f'ckpt_{stop:06d}.dcp'}: too " \
           f"many open files" in errors[0] and "ulimit -n 3" in errors[0], errors[0]
    assert errors[0].endswith(f"run the same command again: it resumes from {log_dir / 'ckpt_000006.dcp'}")
    assert sorted(os.listdir(log_dir)) == [".lock", "ckpt_000002.dcp", "ckpt_000004.dcp", "ckpt_000006.dcp",
                                           "log.jsonl"]
