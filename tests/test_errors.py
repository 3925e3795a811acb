"""Mistakes a user can make: each one is a single `error: ...` line on stderr naming the file or the flag,
exit code 2, no traceback."""
import os
import re
import resource

import numpy as np
import pytest
import torch

import train_gpt2
from helpers import (
    TINY,
    check_usage_error,
    expect_usage_error,
    file_permissions_enforced,
    run_main,
    run_script,
    run_script_on_tmpfs,
    write_shards,
)
from machinery import errors, settings


def args(data, log_dir, *extra):
    return TINY + ["--data", str(data), "--log-dir", str(log_dir), "--max-steps", "1", *extra]


def test_missing_data_path(tmp_path, capsys):
    expect_usage_error(args(tmp_path / "nowhere", tmp_path / "log"), capsys, "--data", "nowhere", "python fineweb.py")
    assert not os.path.exists(tmp_path / "log")


@pytest.mark.parametrize("missing", ["train", "val"])
def test_no_train_or_no_val_shards(tmp_path, capsys, missing):
    d = tmp_path / "data"
    write_shards(d)
    for name in os.listdir(d):
        if missing in name:
            os.remove(d / name)
    expect_usage_error(args(d, tmp_path / "log"), capsys, f"no {missing} shards", str(d), "fineweb.py")


def test_empty_data_directory(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    expect_usage_error(args(tmp_path / "data", tmp_path / "log"), capsys, "no train shards")


def test_a_shard_named_for_both_splits(tmp_path, capsys):
    d = write_shards(tmp_path / "data")
    os.rename(os.path.join(d, "synth_train_000001.npy"), os.path.join(d, "synth_train_val_000001.npy"))
    expect_usage_error(args(d, tmp_path / "log"), capsys, "synth_train_val_000001.npy", "both train and val")


def test_a_single_shard_as_data(tmp_path, capsys):
    d = write_shards(tmp_path / "data")
    expect_usage_error(args(os.path.join(d, "synth_val_000000.npy"), tmp_path / "log"), capsys, "single shard",
                       "directory")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "int32"])
def test_bad_npy_shard(tmp_path, capsys, damage):
    d = write_shards(tmp_path / "data")
    path = os.path.join(d, "synth_train_000001.npy")
    raw = open(path, "rb").read()
    if damage == "truncated":
        open(path, "wb").write(raw[: len(raw) // 2])
    elif damage == "garbage":
        open(path, "wb").write(os.urandom(len(raw)))
    elif damage == "empty":
        open(path, "wb").close()
    else:
        np.save(path, np.arange(3000, dtype=np.int32))
    expect_usage_error(args(d, tmp_path / "log"), capsys, path)


@pytest.mark.parametrize("damage", ["magic", "version", "short header", "truncated", "too long"])
def test_bad_bin_shard(tmp_path, capsys, damage):
    d = write_shards(tmp_path / "data", ext="bin")
    path = os.path.join(d, "synth_train_000000.bin")
    raw = bytearray(open(path, "rb").read())
    header = np.frombuffer(bytes(raw[:1024]), dtype=np.int32).copy()
    if damage == "magic":
        header[0] = 20240519
    elif damage == "version":
        header[1] = 7
    if damage in ("magic", "version"):
        raw[:1024] = header.tobytes()
    elif damage == "short header":
        raw = raw[:500]
    elif damage == "truncated":
        raw = raw[:-100]
    else:
        raw += b"\0\0"
    open(path, "wb").write(bytes(raw))
    want = "header" if damage in ("magic", "version", "short header") else "truncated"
    expect_usage_error(args(d, tmp_path / "log"), capsys, path, want)


@pytest.mark.parametrize("ext", ["npy", "bin"])
@pytest.mark.parametrize("kind", ["dangling link", "directory", "unreadable"])
def test_a_shard_that_cannot_be_opened(tmp_path, capsys, kind, ext):
    """Listed, but not openable: a link into purged scratch storage, a directory named like a shard, a shard this user
    may not read. Each was a traceback (FileNotFoundError, IsADirectoryError, PermissionError)."""
    d = write_shards(tmp_path / "data", ext=ext)
    path = os.path.join(d, f"x_train_000009.{ext}")
    if kind == "dangling link":
        os.symlink(tmp_path / "purged" / os.path.basename(path), path)
        fragments = ["purged", "restore"]
    elif kind == "directory":
        os.mkdir(path)
        fragments = ["a directory", "move it out of"]
    else:
        os.rename(os.path.join(d, f"synth_train_000000.{ext}"), path)
        os.chmod(path, 0)
        fragments = ["Permission denied", "chmod"]
    with file_permissions_enforced():
        expect_usage_error(args(d, tmp_path / "log"), capsys, path, *fragments)


@pytest.mark.parametrize("split", ["train", "val"])
def test_token_ids_beyond_the_vocab(tmp_path, capsys, split):
    d = write_shards(tmp_path / "data")
    path = os.path.join(d, f"synth_{split}_000000.npy")
    tokens = np.load(path)
    tokens[5] = 200
    np.save(path, tokens)
    fragment = path if split == "train" else "validation data"
    # the train shards are read lazily: the run must still fail on the first step, with the file's name
    expect_usage_error(args(d, tmp_path / "log", "--max-steps", "3"), capsys, fragment, "200", "--vocab-size 128")


def test_padding_ids_are_not_tokens(tmp_path, capsys):
    """With the table padded to 50304, ids 50257..50303 have rows but are no GPT-2 token: an error, not a crash."""
    d = write_shards(tmp_path / "data")
    path = os.path.join(d, "synth_train_000000.npy")
    tokens = np.load(path)
    tokens[5] = 50300
    np.save(path, tokens)
    expect_usage_error(args(d, tmp_path / "log", "--vocab-size", "50304"), capsys, path, "50300", "below 50257")


def test_text_file_too_small_for_one_batch(tmp_path, capsys):
    path = tmp_path / "small.txt"
    path.write_text("To be, or not to be, that is the question. " * 5)
    expect_usage_error(args(path, tmp_path / "log", "--vocab-size", "50304"), capsys, str(path),
                       "--total-batch-size 256")


def test_eval_only_needs_no_training_batch(tmp_path, capsys):
    """An evaluation reads the validation split alone: a file too small for one training batch still evaluates."""
    path = tmp_path / "small.txt"
    path.write_text("To be, or not to be, that is the question. " * 40)  # 520 tokens: 468 to train on, 52 to validate
    argv = args(path, tmp_path / "log", "--vocab-size", "50304", "--total-batch-size", "1024")
    expect_usage_error(argv, capsys, "fewer than one batch of --total-batch-size 1024")
    code, out, err = run_main(argv + ["--eval-only"], capsys)
    assert code == 0, err
    assert re.search(r"^step +0 \| val loss \d+\.\d{4}$", out, re.M), out


def test_text_file_not_utf8(tmp_path, capsys):
    path = tmp_path / "binary.txt"
    path.write_bytes(b"\xff\xfe\x00\x81" * 100)
    expect_usage_error(args(path, tmp_path / "log"), capsys, str(path), "UTF-8")


def test_total_batch_not_divisible(shards, tmp_path, capsys):
    expect_usage_error(args(shards, tmp_path / "log", "--total-batch-size", "200"), capsys,
                       "--total-batch-size 200", "4 x 32 x 1 = 128")


def test_seq_len_longer_than_block_size(shards, tmp_path, capsys):
    expect_usage_error(args(shards, tmp_path / "log", "--seq-len", "64", "--total-batch-size", "512"), capsys,
                       "--seq-len 64", "--block-size 32")


def test_cuda_asked_for_but_absent(shards, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    expect_usage_error(args(shards, tmp_path / "log", "--device", "cuda"), capsys, "--device cuda")


@pytest.mark.parametrize("flag, value", [
    ("--max-steps", "-1"), ("--batch-size", "0"), ("--seq-len", "0"), ("--total-batch-size", "-256"),
    ("--n-layer", "-1"), ("--warmup-steps", "-5"), ("--max-lr", "0"), ("--max-lr", "nan"), ("--grad-clip", "-1"),
    ("--keep-checkpoints", "0"), ("--eval-every", "-1"), ("--val-tokens", "0"), ("--min-lr-ratio", "-0.5"),
    ("--min-lr-ratio", "2"), ("--weight-decay", "-0.1"), ("--seed", "-1"), ("--seed", str(2**32)),
    ("--max-lr", "inf"), ("--grad-clip", "inf"), ("--weight-decay", "inf"), ("--min-lr-ratio", "inf"),
])
def test_nonsense_values(shards, tmp_path, capsys, flag, value):
    expect_usage_error(args(shards, tmp_path / "log", flag, value), capsys, flag)


@pytest.mark.parametrize("flag", ["--muon-lr", "--embed-lr", "--head-lr", "--logit-softcap", "--cooldown-frac"])
def test_the_modern_recipes_settings_must_be_finite(shards, tmp_path, capsys, flag):
    """--logit-softcap inf made every step NaN (inf / inf); an infinite rate trained with lr nan."""
    expect_usage_error(args(shards, tmp_path / "log", "--recipe", "modern", flag, "inf"), capsys,
                       f"{flag} must be a finite number, not inf")


@pytest.mark.parametrize("flags", [["--max-lr"], ["--recipe", "modern", "--muon-lr"],
                                   ["--recipe", "modern", "--embed-lr"], ["--recipe", "modern", "--head-lr"]])
def test_a_rate_that_overflows_float32_is_refused(shards, tmp_path, capsys, flags):
    """--max-lr 1e38 ended in a traceback inside Adam (value cannot be converted to type float without overflow):
    Adam divides its rate by 1 - beta1 at the first step, 10 or 5 times it, and Muon multiplies its own by up to 2,
    past float32's largest number, 3.4e38. Every rate of both recipes is refused from a hundredth of that; one just
    below trains into non-finite steps, which end the run in its own line."""
    if "modern" in flags and not hasattr(torch.optim, "Muon"):
        pytest.skip("--recipe modern needs PyTorch 2.9 or later")
    flag, steps = flags[-1], ["--max-steps", "3", "--warmup-steps", "0"]  # the modern rates' peaks before a cool-down
    expect_usage_error(args(shards, tmp_path / "log", *steps, *flags, "1e38"), capsys,
                       f"{flag} must be at most 3.4e+36 (a larger rate can overflow float32 in the optimizer's step), "
                       f"not 1e+38")
    code, out, err = run_main(args(shards, tmp_path / "log", *steps, *flags, "3e36"), capsys)
    assert code == 0 and "Traceback" not in err, (out, err)


# every path flag, named here as well as declared (path=True), so that a path left undeclared fails its test
@pytest.mark.parametrize("name", ["data", "log_dir", "init_from", "hellaswag_file", "core_data", "cache_dir",
                                  "sample", "export_hf", "resume"])
def test_an_empty_path_is_refused(shards, tmp_path, capsys, monkeypatch, name):
    """As an unset shell variable gives it (`--export-hf "$OUT"`): an empty path means "off" or "the default" to some
    of these flags, and `--export-hf ""` trained (over the run in --log-dir). Refused before anything is written, in
    --log-dir or in the current directory."""
    monkeypatch.chdir(tmp_path)
    flag = settings.flag(name)
    expect_usage_error(args(shards, tmp_path / "log", flag, ""), capsys, f"{flag} is empty")
    assert os.listdir(tmp_path) == ["data"]


def test_seq_len_zero_without_shards(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no edu_fineweb10B/: the Shakespeare preset, which divides by --seq-len
    expect_usage_error(["--seq-len", "0", "--device", "cpu"], capsys, "--seq-len")


def test_log_dir_that_is_a_file(shards, tmp_path, capsys):
    """Said as such (it said "cannot write in it (File exists)"), and so is a file where a directory above it goes."""
    (tmp_path / "log").write_text("not a directory")
    expect_usage_error(args(shards, tmp_path / "log"), capsys, f"--log-dir {tmp_path / 'log'}: cannot write in it (it "
                       f"is a file, not a directory)")
    expect_usage_error(args(shards, tmp_path / "log" / "run"), capsys, f"--log-dir {tmp_path / 'log' / 'run'}: cannot "
                       f"write in it ({tmp_path / 'log'} is a file, not a directory)")


def test_more_processes_than_gpus(monkeypatch):
    """torchrun --nproc_per_node=2 where CUDA_VISIBLE_DEVICES shows one GPU: a readable error, not a CUDA traceback."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(errors.UsageError,
                       match=r"LOCAL_RANK=1 but only 1 GPU.*CUDA_VISIBLE_DEVICES=3.*--nproc_per_node"):
        train_gpt2.set_up_distributed("cuda")


def test_hellaswag_with_a_small_vocab(shards, tmp_path, capsys):
    expect_usage_error(args(shards, tmp_path / "log", "--hellaswag-every", "5"), capsys, "--hellaswag-every 5",
                       "--vocab-size is 128")


def test_n_embd_not_multiple_of_n_head(shards, tmp_path, capsys):
    expect_usage_error(args(shards, tmp_path / "log", "--n-head", "5"), capsys, "--n-embd 64", "--n-head 5")


@pytest.mark.parametrize("what", ["--resume", "--sample"])
def test_unreadable_checkpoint_path(shards, tmp_path, capsys, what):
    bad = tmp_path / "ckpt_000002.pt"
    bad.write_bytes(b"not a checkpoint at all")
    expect_usage_error(args(shards, tmp_path / "log", what, bad), capsys, what, str(bad))
    expect_usage_error(args(shards, tmp_path / "log", what, tmp_path / "missing.pt"), capsys, what, "missing.pt")


def test_fresh_start_never_moves_a_directory_it_did_not_make(tmp_path, capsys):
    """--log-dir pointing at a folder of other things (a project, a parent of runs): the run starts there, and a
    fresh start moves nothing but an earlier run's own files; the folder and the user's files stay."""
    d = write_shards(tmp_path / "data")
    log_dir = tmp_path / "runs"
    log_dir.mkdir()
    (log_dir / "notes.txt").write_text("mine")
    code, out, err = run_main(args(d, log_dir, "--no-resume"), capsys)
    assert code == 0, err
    assert "aside" not in out  # nothing to move: no run was there
    assert (log_dir / "notes.txt").read_text() == "mine" and os.path.exists(log_dir / "log.jsonl")
    assert sorted(os.listdir(tmp_path)) == ["data", "runs"]


def test_a_log_dir_that_cannot_be_written_is_refused_at_start_up(shards, tmp_path, capsys):
    """Found before any data is read or evaluation run (10M tokens on FineWeb), not at the first log line after it."""
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    log_dir.chmod(0o555)
    argv = args(shards, log_dir, "--eval-every", "1")
    try:
        if not os.access(log_dir, os.W_OK):  # a user's own directory without write permission
            code, out, err = run_main(argv, capsys)
        else:  # root writes regardless of permissions: a read-only file system stops it
            result = run_script_on_tmpfs(argv, tmp_path, log_dir, "ro")
            code, out, err = result.returncode, result.stdout, result.stderr
    finally:
        log_dir.chmod(0o755)
    line = check_usage_error(code, out, err, "--log-dir", str(log_dir))
    assert "read-only" in line.lower() or "permission" in line.lower()
    assert "val loss" not in out and "data:" not in out


def test_a_log_this_user_cannot_append_to_is_refused_at_start_up(shards, tmp_path, capsys):
    """log.jsonl another user's, in a directory this user may write in (a group's shared one): the training that would
    resume and append to it, and --eval-only, are refused before any work, as an unwritable directory is (they ended
    in a PermissionError traceback, --eval-only's computed result never printed)."""
    log_dir = tmp_path / "log"
    assert run_main(args(shards, log_dir), capsys)[0] == 0
    (log_dir / "log.jsonl").chmod(0o444)
    with file_permissions_enforced():
        for extra in (["--max-steps", "2"], ["--eval-only"]):
            code, out, err = run_main(args(shards, log_dir, *extra), capsys)
            check_usage_error(code, out, err, f"--log-dir {log_dir}", str(log_dir / "log.jsonl"), "Permission denied")
            assert "data:" not in out and "val loss" not in out


def test_an_evaluation_is_printed_even_if_its_log_line_cannot_be_written(shards, tmp_path, capsys):
    """The result reaches the terminal first: a log.jsonl past the file-size limit (ulimit -f) stops the run after."""
    log_dir = tmp_path / "log"
    assert run_main(args(shards, log_dir), capsys)[0] == 0
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(log_dir / "log.jsonl"), limit[1]))
    try:
        code, out, err = run_main(args(shards, log_dir, "--eval-only"), capsys)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    check_usage_error(code, out, err, "file-size limit", str(log_dir / "log.jsonl"))
    assert re.search(r"^step +1 \| val loss \d+\.\d{4}$", out, re.M), out


def test_compile_mode_without_compile(shards, tmp_path, capsys):
    expect_usage_error(args(shards, tmp_path / "log", "--compile-mode", "max-autotune"), capsys,
                       "--compile-mode max-autotune", "--compile")


def test_chunked_loss_with_fp16(shards, tmp_path, capsys):
    expect_usage_error(args(shards, tmp_path / "log", "--loss", "chunked", "--dtype", "fp16"), capsys,
                       "--loss chunked", "--dtype fp16")


@pytest.mark.parametrize("problem", ["log dir", "resume"])
def test_an_error_found_by_rank_0_alone_stops_every_rank_in_one_line(shards, tmp_path, problem):
    """Work that rank 0 does alone (checking the log dir, picking the checkpoint): under torchrun its error must stop
    rank 1 too, with the same line, not leave it waiting in a collective (a traceback under gloo, a hang under NCCL)."""
    (tmp_path / "a_file").write_text("")
    extra = {"log dir": ["--log-dir", tmp_path / "a_file" / "log"],
             "resume": ["--log-dir", tmp_path / "log", "--resume", tmp_path / "a_file"]}[problem]
    result = run_script(TINY + ["--data", shards, "--max-steps", "1", *extra], cwd=tmp_path, nproc=2, timeout=120)
    assert result.returncode != 0
    # torchrun's own report follows, with its traceback
    ranks_stderr = result.stderr.split("torch/distributed/elastic")[0]
    errors = [line for line in ranks_stderr.splitlines() if line.startswith("error:")]
    assert "Traceback" not in ranks_stderr and len(errors) == 2 and len(set(errors)) == 1, result.stderr
    assert errors[0].startswith("error: --log-dir" if problem == "log dir" else "error: --resume"), errors[0]
