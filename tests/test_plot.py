"""plot.py: curves.png from a log.jsonl, the reading rules (last line per step, resumes, references), errors."""
import json
import os
import subprocess
import struct
import sys

import pytest

import plot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLOT = os.path.join(REPO, "plot.py")


def write_log(log_dir, records, tail=""):
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def run_log(steps=(0, 1, 2, 3)):
    """A small run: train lines every step, val and HellaSwag at even steps."""
    records = []
    for step in steps:
        if step % 2 == 0:
            records.append({"step": step, "tokens": step * 1024, "val_loss": 10.0 - step})
            records.append({"step": step, "tokens": step * 1024, "hellaswag_acc_norm": 0.25 + step / 100, "hellaswag_acc": 0.25})
        records.append({"step": step, "tokens": (step + 1) * 1024, "train_loss": 11.0 - step, "lr": 1e-3,
                        "grad_norm": 1.0, "dt_ms": 10.0, "tok_per_sec": 1e5})
    return records


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    log_dir = tmp_path / "log"
    records = run_log() + [{"step": 0, "tokens": 0, "val_loss": 3.29, "hellaswag_acc_norm": 0.2955,
                            "eval_only": True, "init_from": "gpt2"}]
    write_log(log_dir, records, tail='{"step": 4, "tokens": 5120, "train_lo')  # killed mid-write
    result = subprocess.run([sys.executable, PLOT, str(log_dir)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "skipped 1 line" in result.stdout and "GPT-2 val loss 3.2900" in result.stdout
    png = (log_dir / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    assert struct.unpack(">II", png[16:24]) == (1400, 900)  # width, height: 14 x 9 inches at 100 dpi
    assert sorted(os.listdir(log_dir)) == ["curves.png", "log.jsonl"]  # no temp file left behind


def test_last_line_per_step_wins_and_a_resume_drops_later_steps(tmp_path):
    records = run_log(range(6))
    records.append({"step": 2, "event": "resume"})  # from the checkpoint of step 2: steps 3..5 are redone
    rerun = run_log(range(2, 4))  # step 2: val, hellaswag, train; step 3: train
    rerun[1]["hellaswag_acc_norm"], rerun[3]["train_loss"] = 0.3, 42.0
    records += rerun
    records.append({"step": 3, "tokens": 3072, "val_loss": 1.5, "eval_only": True, "init_from": "log/ckpt_000003.pt"})
    records.append({"step": 4, "tokens": 5120, "train_loss": None, "skipped": True})  # non-finite: no point
    write_log(tmp_path, records)
    curves, gpt2_val_loss, bad_lines = plot.read_log(tmp_path / "log.jsonl")
    assert sorted(curves["train_loss"]) == [0, 1, 2, 3]
    assert curves["train_loss"][3] == (4096, 42.0)
    assert sorted(curves["val_loss"]) == [0, 2]  # the checkpoint's eval-only line is not a point of this run
    assert curves["hellaswag_acc_norm"] == {0: (0, 0.25), 2: (2048, 0.3)}
    assert gpt2_val_loss is None and bad_lines == 0


def test_gpt2_reference_comes_from_its_eval_only_line(tmp_path):
    records = run_log() + [{"step": 0, "tokens": 0, "val_loss": 3.29, "eval_only": True, "init_from": "gpt2"},
                           {"step": 0, "tokens": 0, "val_loss": 2.9, "eval_only": True, "init_from": "gpt2-medium"}]
    write_log(tmp_path, records)
    _, gpt2_val_loss, _ = plot.read_log(tmp_path / "log.jsonl")
    assert gpt2_val_loss == 3.29


def test_errors_are_one_line(tmp_path):
    for log_dir, culprit in [(tmp_path / "nothing_here", "log.jsonl not found"),
                             (tmp_path / "empty", "no train_loss, val_loss or hellaswag_acc_norm")]:
        if log_dir.name == "empty":
            write_log(log_dir, [{"step": 0, "event": "resume"}])
        result = subprocess.run([sys.executable, PLOT, str(log_dir)], capture_output=True, text=True)
        assert result.returncode == 2
        assert result.stderr.startswith("error:") and culprit in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_without_matplotlib_says_so_in_one_line(tmp_path):
    blocker = tmp_path / "no_matplotlib" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is blocked by the test')\n")
    write_log(tmp_path / "log", run_log())
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "no_matplotlib"))
    result = subprocess.run([sys.executable, PLOT, str(tmp_path / "log")], capture_output=True, text=True, env=env)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: plot.py needs matplotlib, which is not installed: pip install matplotlib"
    assert not (tmp_path / "log" / "curves.png").exists()
