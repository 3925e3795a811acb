"""Checkpoints as files that other processes read: a damaged --fsdp directory is skipped, or refused in one line, as
a damaged file is."""
import os
import shutil

import pytest

import plumbing
import train_gpt2
from helpers import TINY, expect_usage_error, run_main, write_shards

SHARDED = ["--max-steps", "8", "--checkpoint-every", "4", "--fsdp"]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The log dir of an --fsdp run in one process, with checkpoints at steps 4 and 8: (its flags, its log dir)."""
    root = tmp_path_factory.mktemp("sharded")
    args, log_dir = TINY + ["--data", write_shards(root / "data")], root / "log"
    train_gpt2.main([str(a) for a in args + SHARDED + ["--log-dir", log_dir]])  # it exits on an error alone
    assert plumbing.checkpoint_paths(log_dir) == [str(log_dir / "ckpt_000004.dcp"), str(log_dir / "ckpt_000008.dcp")]
    return args, log_dir


def copy_of(sharded, tmp_path):
    args, log_dir = sharded
    shutil.copytree(log_dir, tmp_path / "log")
    return args, tmp_path / "log"


def cut_in_half(path):
    os.truncate(path, os.path.getsize(path) // 2)


DAMAGES = {  # what is done to the latest checkpoint's directory, and what the line says of it
    "a slice file gone": (lambda d: os.remove(d / "__0_0.distcp"), "__0_0.distcp, which its index .metadata names, is "
                                                                   "missing"),
    "the index gone": (lambda d: os.remove(d / ".metadata"), "its index .metadata is missing"),
    "a slice file cut in half": (lambda d: cut_in_half(d / "__0_0.distcp"), "__0_0.distcp is cut short: "),
    "the index cut in half": (lambda d: cut_in_half(d / ".metadata"), "its index .metadata cannot be read"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_sharded_checkpoint_is_skipped_or_refused_in_one_line(sharded, tmp_path, capsys, damage):
    """Only run.pt was read to choose a checkpoint: --eval-only (and every reader) ended in torch's FileNotFoundError,
    "metadata is None" or "failed finding central directory" tracebacks. Now the index and the files it names are
    checked: --eval-only goes back to the previous checkpoint with a warning, as for a .pt cut in half, and --sample
    refuses the damaged one by name in one line."""
    args, log_dir = copy_of(sharded, tmp_path)
    damaged = log_dir / "ckpt_000008.dcp"
    do, reason = DAMAGES[damage]
    do(damaged)
    expect_usage_error(["--sample", damaged, "--device", "cpu"], capsys, f"--sample {damaged}: cannot load it", reason)
    code, out, err = run_main(args + ["--eval-only", "--log-dir", log_dir], capsys)
    assert code == 0, err
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"skipping unreadable checkpoint {damaged} (" in warnings[0], out
    assert reason in warnings[0]
    assert f"evaluating {log_dir / 'ckpt_000004.dcp'} (step 4)" in out


def test_training_and_export_go_back_past_a_damaged_sharded_checkpoint(sharded, tmp_path, capsys):
    """The issue's case: a slice file of the latest checkpoint deleted. The training resumed from it and died in
    torch's FileNotFoundError; now it resumes from the one before, as --export-hf exports that one."""
    args, log_dir = copy_of(sharded, tmp_path)
    os.remove(log_dir / "ckpt_000008.dcp" / "__0_0.distcp")
    code, out, err = run_main(["--export-hf", tmp_path / "hf", "--log-dir", log_dir], capsys)
    assert code == 0, err
    assert f"exported {log_dir / 'ckpt_000004.dcp'} to {tmp_path / 'hf'}" in out and "warning: skipping" in out
    code, out, err = run_main(args + SHARDED + ["--max-steps", "10", "--log-dir", log_dir], capsys)
    assert code == 0, err
    assert "warning: skipping unreadable checkpoint" in out and "resuming from the checkpoint of step 4" in out
    assert os.path.exists(log_dir / "ckpt_000010.dcp")


@pytest.mark.parametrize("inside", ["run.pt", "__0_0.distcp"])
def test_a_file_inside_a_sharded_checkpoint_is_refused_naming_the_directory(sharded, tmp_path, capsys, inside):
    """run.pt is a .pt: --resume of it read it, and then failed in torch with "Not a directory"."""
    args, log_dir = copy_of(sharded, tmp_path)
    directory = log_dir / "ckpt_000004.dcp"
    for command in (args + SHARDED + ["--log-dir", log_dir, "--resume", directory / inside],
                    ["--sample", directory / inside, "--device", "cpu"]):
        expect_usage_error(command, capsys, f"{directory / inside} is a file inside the sharded checkpoint "
                                            f"{directory}: pass the directory {directory}")
