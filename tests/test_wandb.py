"""Experiment tracking with Weights & Biases: the real wandb package, offline, writing under the log directory. What
it wrote is read back from its transaction log (<log-dir>/wandb/offline-run-*/run-<id>.wandb) and must hold what
log.jsonl holds; a resumed run continues the same W&B run; rank 0 alone logs; a missing package or a W&B that
cannot start is a one-line error."""
import glob
import json
import os
import signal
import struct
import sys
import time

import pytest
import wandb
from scripts.nan_loss import nan_loss_at
from wandb.proto import wandb_internal_pb2

from helpers import (
    REPO,
    TINY,
    checkpoint_path,
    expect_usage_error,
    load_ckpt,
    needs_muon,
    read_log,
    run_main,
    run_script,
    start_script,
    train_records,
    wait_for_step,
)

SCRIPTS = os.path.join(REPO, "tests", "scripts")


@pytest.fixture(autouse=True)
def wandb_offline(tmp_path, monkeypatch):
    """W&B offline, its settings, cache and logs in tmp_path rather than the home directory, and no server it could
    reach."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # were it ever to go online: nothing listens there
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home" / name.lower()))
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))  # where wandb would look for a login
    for name in ("WANDB_API_KEY", "WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_NAME", "WANDB_RUN_ID",
                 "WANDB_RESUME", "WANDB_SERVICE"):
        monkeypatch.delenv(name, raising=False)
    wandb.teardown()  # wandb reads the environment once, at its set-up: set up again with this test's
    yield
    wandb.teardown()  # its service process, and the WANDB_SERVICE it put in os.environ for child processes


def read_transaction_log(path):
    """The records of a .wandb file: a 7-byte header (':W&B', magic 0xBEE1, version 0), then LevelDB's log format:
    32 KiB blocks of chunks, each a 7-byte header (CRC, length, type: full, first, middle, last) and its data."""
    data = open(path, "rb").read()
    assert data[:7] == b":W&B" + struct.pack("<HB", 0xBEE1, 0), path
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # too little left in the block for a header: padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos: pos + 7])
        if kind == 0:  # zeros: the end of what was written
            break
        pending += data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def items(entries):
    return {"/".join(e.nested_key) or e.key: json.loads(e.value_json) for e in entries}


def read_wandb_run(path):
    """What the trainer logged to one offline W&B run: its id, name, config, history rows (without W&B's own _keys),
    custom x-axes, and the exit code it ended with (None: it never ended)."""
    run = {"history": [], "wandb_steps": [], "x_axes": {}, "exit_code": None}
    for record in read_transaction_log(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(id=record.run.run_id, name=record.run.display_name, project=record.run.project,
                       config={k: v for k, v in items(record.run.config.update).items() if not k.startswith("_")},
                       start=record.run.start_time.ToNanoseconds())
        elif kind == "history":
            row = items(record.history.item)
            run["history"].append({k: v for k, v in row.items() if not k.startswith("_")})
            run["wandb_steps"].append(row["_step"])
        elif kind == "metric" and record.metric.step_metric:
            run["x_axes"][record.metric.glob_name or record.metric.name] = record.metric.step_metric
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run


def wandb_runs(log_dir):
    """The W&B runs written under log_dir/wandb, oldest first."""
    # wandb's service process writes the runs' files from buffers it flushes when it stops: at the trainer's exit in
    # a real run (wandb.finish does not wait for it), here by this call, since main() ran in this process
    wandb.teardown()
    runs = [read_wandb_run(p) for p in glob.glob(os.path.join(log_dir, "wandb", "offline-run-*", "run-*.wandb"))]
    return sorted(runs, key=lambda run: run.get("start", 0))  # a run's record reaches the file once it has started


def test_wandb_logs_what_log_jsonl_holds_and_a_resumed_run_continues_it(shards, tmp_path, capsys):
    """A run, then a resume from an older checkpoint, which trains (and logs) steps 2 and 3 again: two offline
    W&B runs with one id, holding the records of log.jsonl before and after the resume, with the step as x-axis."""
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--log-dir", log_dir, "--eval-every", "2", "--checkpoint-every", "2",
                   "--wandb-project", "tiny", "--wandb-run-name", "first try"]
    code, out, err = run_main(args + ["--max-steps", "4"], capsys)
    assert code == 0, err
    code, out, err = run_main(args + ["--max-steps", "5", "--resume", checkpoint_path(log_dir, 2)], capsys)
    assert code == 0, err
    first, second = wandb_runs(log_dir)
    assert first["id"] == second["id"] == load_ckpt(checkpoint_path(log_dir, 5))["wandb_id"] != ""
    assert first["project"] == second["project"] == "tiny" and first["name"] == second["name"] == "first try"
    records = read_log(log_dir)
    # each launch's first record says what runs; a resume's is log.jsonl's marker for plot.py
    assert records[0]["event"] == "start" and records[0]["recipe"] == "gpt2"
    resume = records.index(next(r for r in records if r.get("event") == "resume"))
    assert records[resume]["step"] == 2
    assert first["history"] == records[:resume] and second["history"] == records[resume:]
    # W&B's own step is the record's line in log.jsonl: it goes on growing across the resume, so that W&B can append
    # the second offline run to the first (wandb sync --append) instead of writing over its history
    assert first["wandb_steps"] == list(range(resume))
    assert second["wandb_steps"] == list(range(resume, len(records)))
    assert [r["step"] for r in second["history"] if "train_loss" in r] == [2, 3, 4]  # steps 2 and 3 again
    # step 2 was evaluated before its checkpoint
    assert [r["step"] for r in second["history"] if "val_loss" in r] == [4, 5]
    assert first["x_axes"] == second["x_axes"] == {"*": "step"}
    assert first["exit_code"] == second["exit_code"] == 0
    for run, max_steps in ((first, 4), (second, 5)):  # the resolved settings, flags and defaults alike
        config = run["config"]
        assert config["max_steps"] == max_steps and config["n_layer"] == 2 and config["data"] == shards
        assert config["wandb_project"] == "tiny" and config["max_lr"] == 6e-4 and config["dtype"] == "fp32"
    # --eval-only of the latest checkpoint logs to a W&B run of its own: the training's may still be going on
    code, out, err = run_main(args + ["--max-steps", "5", "--eval-only"], capsys)
    assert code == 0 and "evaluating" in out, err
    *_, evaluation = wandb_runs(log_dir)
    assert evaluation["id"] != first["id"] and evaluation["history"] == read_log(log_dir)[-1:]
    assert evaluation["history"][0]["eval_only"] and evaluation["exit_code"] == 0
    # a fresh start sets the old run's W&B files aside with the rest of it, and starts another W&B run
    code, out, err = run_main(args + ["--max-steps", "1", "--no-resume"], capsys)
    assert code == 0 and "moved the old" in out, err
    (fresh,) = wandb_runs(log_dir)
    assert fresh["id"] != first["id"] and fresh["history"] == read_log(log_dir)


def test_a_run_resumed_from_another_directorys_checkpoint_is_a_wandb_run_of_its_own(shards, tmp_path, capsys):
    """Y's checkpoint resumed with --log-dir X branches Y's run into X: X's log.jsonl begins at the resume, and W&B's
    step is the record's line in it, so continuing Y's W&B run would log steps that Y's already holds."""
    args = TINY + ["--data", shards, "--wandb-project", "tiny"]
    assert run_main(args + ["--log-dir", tmp_path / "Y", "--max-steps", "2"], capsys)[0] == 0
    code, out, err = run_main(args + ["--log-dir", tmp_path / "X", "--max-steps", "3", "--resume",
                                      checkpoint_path(tmp_path / "Y", 2)], capsys)
    assert code == 0, err
    (y,), (x,) = wandb_runs(tmp_path / "Y"), wandb_runs(tmp_path / "X")
    assert x["id"] != y["id"] and x["history"] == read_log(tmp_path / "X") and x["wandb_steps"][0] == 0


@needs_muon
def test_a_modern_run_logs_its_recipe_and_muons_learning_rate(shards, tmp_path, capsys):
    log_dir = tmp_path / "log"
    code, _, err = run_main(TINY + ["--data", shards, "--log-dir", log_dir, "--max-steps", "3", "--recipe", "modern",
                                    "--muon-lr", "0.03", "--wandb-project", "tiny"], capsys)
    assert code == 0, err
    (run,) = wandb_runs(log_dir)
    assert run["history"] == read_log(log_dir) and run["exit_code"] == 0
    assert (run["config"]["recipe"], run["config"]["muon_lr"], run["config"]["warmup_steps"]) == ("modern", 0.03, 0)
    assert [r["lr"] for r in run["history"] if "lr" in r] == pytest.approx([0.03, 0.03, 0.003])  # cooled down


def test_a_signal_stops_a_run_that_logs_to_wandb_promptly_and_its_resume_continues_it(shards, tmp_path, capsys):
    """W&B must not swallow the trainer's SIGTERM handling: the run saves, ends its W&B run and exits at once."""
    log_dir = tmp_path / "run"
    args = TINY + ["--data", shards, "--checkpoint-every", "0", "--log-dir", log_dir, "--wandb-project", "tiny"]
    proc = start_script(args + ["--max-steps", "100000"], tmp_path, tmp_path / "out.txt")
    wait_for_step(proc, log_dir, 2)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert time.time() - t0 < 20  # a step, a checkpoint and W&B's offline finish; no waiting on a server
    out = open(tmp_path / "out.txt").read()
    assert "Traceback" not in out and "stopped by signal at step" in out
    stop = max(train_records(read_log(log_dir))) + 1
    (stopped,) = wandb_runs(log_dir)
    assert stopped["exit_code"] == 0 and stopped["history"] == read_log(log_dir)
    assert load_ckpt(checkpoint_path(log_dir, stop))["wandb_id"] == stopped["id"]
    code, out, err = run_main(args + ["--max-steps", stop + 1], capsys)  # the same command, resumed: the same W&B run
    assert code == 0 and f"resuming from the checkpoint of step {stop}" in out, err
    first, resumed = wandb_runs(log_dir)
    assert first == stopped and resumed["id"] == stopped["id"]
    assert [r["step"] for r in resumed["history"] if "train_loss" in r] == [stop]


def test_an_error_ends_the_wandb_run_as_failed(shards, tmp_path, capsys, monkeypatch):
    """Two non-finite steps in a row stop the run with an error: the W&B run ends failed, holding the skipped steps
    as log.jsonl does (a null loss)."""
    nan_loss_at({1, 2}, monkeypatch.setattr)  # the loss of steps 1 and 2 is NaN (tests/scripts/nan_loss.py)
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--log-dir", log_dir, "--max-steps", "6", "--max-bad-steps", "2",
                   "--wandb-project", "tiny"]
    expect_usage_error(args, capsys, "2 steps in a row had a non-finite loss")
    (run,) = wandb_runs(log_dir)
    assert run["exit_code"] == 1 and run["history"] == read_log(log_dir)
    assert [r["train_loss"] for r in run["history"] if "train_loss" in r][1:] == [None, None]


def test_two_processes_make_one_wandb_run(shards, tmp_path):
    """Under torchrun, rank 0 alone starts a W&B run and logs, and only rank 0 writes log.jsonl."""
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--log-dir", log_dir, "--max-steps", "2", "--wandb-project", "tiny"]
    result = run_script(args, cwd=tmp_path, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = wandb_runs(log_dir)
    assert run["history"] == read_log(log_dir) and sorted(train_records(run["history"])) == [0, 1]


def test_without_wandb_installed_the_flag_is_a_one_line_error(shards, tmp_path, capsys, monkeypatch):
    args = TINY + ["--data", shards, "--log-dir", tmp_path / "log", "--max-steps", "1"]
    monkeypatch.setitem(sys.modules, "wandb", None)
    expect_usage_error(args + ["--wandb-project", "tiny"], capsys, "--wandb-project tiny", "pip install wandb")
    assert not (tmp_path / "log").exists()  # refused before any work
    # without the flag, the trainer never imports wandb: not even at its own import, which this process did long ago
    result = run_script(args, cwd=tmp_path, timeout=120, script=os.path.join(SCRIPTS, "train_without_wandb.py"))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]


def test_wandb_that_cannot_start_is_a_one_line_error(shards, tmp_path, capsys, monkeypatch):
    """Online with no login (nothing to reach, either): wandb's error, one line, with what to do about it."""
    args = TINY + ["--data", shards, "--log-dir", tmp_path / "log", "--max-steps", "1"]
    expect_usage_error(args + ["--wandb-run-name", "lonely"], capsys, "--wandb-run-name lonely", "--wandb-project")
    monkeypatch.setenv("WANDB_MODE", "online")
    wandb.teardown()  # so that it reads WANDB_MODE again
    line = expect_usage_error(args + ["--wandb-project", "tiny"], capsys, "--wandb-project tiny", "wandb login",
                              "WANDB_MODE=offline")
    assert "API key" in line  # wandb's own reason
