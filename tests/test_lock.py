"""Two runs in one log directory: the second is refused in one line, and the first goes on untouched. The lock dies
with its process, even one killed by SIGKILL."""
import os
import signal

from helpers import (
    TINY,
    check_usage_error,
    checkpoint_path,
    logged_train_steps,
    read_log,
    run_script,
    start_script,
    wait_for_step,
)
from machinery.checkpoints import checkpoint_paths

LONG_RUN = ["--max-steps", "100000", "--checkpoint-every", "2", "--keep-checkpoints", "3"]


def files_beside(log_dir):
    """The directories next to log_dir: a fresh start would have moved an earlier run aside into one."""
    return sorted(name for name in os.listdir(os.path.dirname(log_dir)) if name != "first.out")


def test_a_second_run_in_a_busy_log_dir_is_refused_and_the_first_goes_on(shards, tmp_path):
    log_dir = str(tmp_path / "run")
    args = TINY + ["--data", shards, "--log-dir", log_dir] + LONG_RUN
    first = start_script(args, tmp_path, tmp_path / "first.out")
    try:
        wait_for_step(first, log_dir, 5)
        beside = files_beside(log_dir)
        # a fresh start (it used to move the first run's checkpoints aside), and a requeued job (it used to resume from
        # the first's live checkpoint and move its newer ones aside as abandoned)
        for extra in (["--no-resume"], []):
            result = run_script(args + extra, tmp_path)
            check_usage_error(result.returncode, result.stdout, result.stderr,
                              f"another run is using --log-dir {log_dir}", f"pid {first.pid} on ")
            assert "moved" not in result.stdout and "abandoned" not in result.stdout
        assert files_beside(log_dir) == beside  # nothing was moved aside
        assert not [name for name in os.listdir(log_dir) if name.endswith(".abandoned")]
        step = wait_for_step(first, log_dir, max(logged_train_steps(log_dir)) + 4)
        assert first.poll() is None  # the first run goes on, and its checkpoints with it
        assert checkpoint_paths(log_dir) and all(os.path.exists(p) for p in checkpoint_paths(log_dir))
        steps = [r["step"] for r in read_log(log_dir) if "train_loss" in r]
        assert steps == list(range(len(steps))) and max(steps) >= step  # one run's steps in the log, each once
    finally:
        first.kill()
        first.wait()


def test_a_run_killed_with_sigkill_leaves_the_log_dir_free(shards, tmp_path):
    log_dir = str(tmp_path / "run")
    args = TINY + ["--data", shards, "--log-dir", log_dir]
    first = start_script(args + LONG_RUN, tmp_path, tmp_path / "first.out")
    try:
        wait_for_step(first, log_dir, 3)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert os.path.exists(os.path.join(log_dir, ".lock"))  # the file stays; the lock on it died with its process
    result = run_script(args + ["--max-steps", "4"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "resuming from the checkpoint of step 2" in result.stdout
    assert os.path.exists(checkpoint_path(log_dir, 4))


def test_under_torchrun_a_busy_log_dir_stops_every_rank_in_one_line(shards, tmp_path):
    """Rank 0 takes the lock; the other rank stops with its error rather than waiting in a collective."""
    log_dir = str(tmp_path / "run")
    args = TINY + ["--data", shards, "--log-dir", log_dir, "--batch-size", "2"]
    first = start_script(args + LONG_RUN, tmp_path, tmp_path / "first.out")
    try:
        wait_for_step(first, log_dir, 3)
        result = run_script(args + ["--max-steps", "4"], tmp_path, nproc=2)
        assert result.returncode != 0
        ranks_stderr = result.stderr.split("torch/distributed/elastic")[0]  # torchrun's own report follows
        errors = [line for line in ranks_stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 2 and all(f"another run is using --log-dir {log_dir}" in e for e in errors), result.stderr
        assert "Traceback" not in ranks_stderr
        assert first.poll() is None
    finally:
        first.kill()
        first.wait()
