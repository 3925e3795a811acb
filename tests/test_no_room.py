"""A write that runs out of room (a full disk, a disk quota, a file-size limit) stops the run with one line that names
the file and the reason, exit code 2, no partial file, and the last checkpoint in place."""
import errno
import json
import os
import resource
import signal
import subprocess

import torch

from helpers import (
    TINY,
    check_usage_error,
    checkpoint_path,
    run_main,
    run_script,
    run_script_on_tmpfs,
    script_command,
    script_env,
)
from plumbing import checkpoint_paths, checkpoint_step


def test_a_disk_that_fills_while_the_log_is_appended_stops_the_run_in_one_line(shards, tmp_path):
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--log-dir", log_dir, "--max-steps", "100000", "--checkpoint-every", "0"]
    result = run_script_on_tmpfs(args, tmp_path, log_dir, "size=8k")  # a page for the lock file, one for the log
    stdout, listing = result.stdout.rstrip("\n").rsplit("\n", 1)
    check_usage_error(result.returncode, stdout, result.stderr, f"disk full writing {log_dir / 'log.jsonl'}: ",
                      "run the same command again")
    assert listing.split() == [".lock", "log.jsonl"]


def run_with_file_size_limit(args, cwd, limit):
    """The script with RLIMIT_FSIZE at limit bytes: a write past it fails with EFBIG (SIGXFSZ ignored, as Python
    does)."""
    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run(script_command(args), cwd=cwd, env=script_env(), capture_output=True, text=True, timeout=240,
                          preexec_fn=limit_file_size)


def test_a_checkpoint_past_the_file_size_limit_stops_the_run_in_one_line(shards, tmp_path):
    """`ulimit -f`: torch.save used to end in its RuntimeError traceback ("unexpected pos"), as only ENOSPC was
    recognised."""
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--log-dir", log_dir, "--checkpoint-every", "2"]
    first = run_script(args + ["--max-steps", "2"], tmp_path)
    assert first.returncode == 0, first.stderr
    size = os.path.getsize(checkpoint_path(log_dir, 2))
    result = run_with_file_size_limit(args + ["--max-steps", "4"], tmp_path, size // 2)
    check_usage_error(result.returncode, result.stdout, result.stderr,
                      f"file too large for this process's file-size limit (ulimit -f) writing "
                      f"{checkpoint_path(log_dir, 4)}: ", f"resumes from {checkpoint_path(log_dir, 2)}")
    assert sorted(os.listdir(log_dir)) == [".lock", "ckpt_000002.pt", "log.jsonl"]  # no partial file


def test_a_checkpoint_over_the_disk_quota_stops_the_run_in_one_line(shards, tmp_path, capsys, monkeypatch):
    """EDQUOT, the usual end on a cluster's home or scratch. No quota can be set here: the checkpoint's file object
    fails as a file over quota does, inside torch.save, which wraps the OSError in its own RuntimeError."""
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--log-dir", log_dir, "--checkpoint-every", "2", "--keep-checkpoints", "1"]
    code, out, err = run_main(args + ["--max-steps", "2"], capsys)
    assert code == 0, err
    real_save = torch.save

    class OverQuota:
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, data):
            self.written += len(data)
            if self.written > 1000:
                raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
            return self.f.write(data)

        def flush(self):
            self.f.flush()

    monkeypatch.setattr(torch, "save", lambda obj, f: real_save(obj, OverQuota(f)))
    code, out, err = run_main(args + ["--max-steps", "4"], capsys)
    check_usage_error(code, out, err, f"disk quota exceeded writing {checkpoint_path(log_dir, 4)}: ",
                      f"resumes from {checkpoint_path(log_dir, 2)}")
    assert [checkpoint_step(p) for p in checkpoint_paths(log_dir)] == [2]
    assert not [name for name in os.listdir(log_dir) if name.endswith(".tmp")]
    with open(log_dir / "log.jsonl") as f:
        assert all(json.loads(line) for line in f)


def test_a_sharded_checkpoint_past_the_file_size_limit_stops_the_run_in_one_line(shards, tmp_path):
    """--fsdp: torch.distributed.checkpoint gathers each rank's failure into its CheckpointException, which names the
    reason only inside: the line still says what ran out, and the directory being written is gone."""
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--log-dir", log_dir, "--checkpoint-every", "2", "--fsdp"]
    first = run_script(args + ["--max-steps", "2"], tmp_path)
    assert first.returncode == 0, first.stderr
    saved = log_dir / "ckpt_000002.dcp"
    largest = max(os.path.getsize(saved / name) for name in os.listdir(saved))
    result = run_with_file_size_limit(args + ["--max-steps", "4"], tmp_path, largest // 2)
    check_usage_error(result.returncode, result.stdout, result.stderr,
                      "file too large for this process's file-size limit (ulimit -f) writing "
                      f"{log_dir / 'ckpt_000004.dcp'}",
                      f"resumes from {saved}")
    assert sorted(os.listdir(log_dir)) == [".lock", "ckpt_000002.dcp", "log.jsonl"]  # no partial directory
