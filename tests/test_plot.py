"""plot.py: curves.png from a log.jsonl, the reading rules (last line per step, resumes, references, tokens), the loss
axis' range, errors."""
import json
import math
import os
import struct
import subprocess
import sys

import pytest

import plot
from helpers import REPO

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
            records.append({"step": step, "tokens": step * 1024, "hellaswag_acc_norm": 0.25 + step / 100,
                            "hellaswag_acc": 0.25})
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
    assert "skipped 1 line" in result.stdout
    assert "GPT-2 val_loss 3.2900, GPT-2 hellaswag_acc_norm 0.2955" in result.stdout
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
    curves, gpt2, bad_lines = plot.read_log(tmp_path / "log.jsonl")
    assert sorted(curves["train_loss"]) == [0, 1, 2, 3]
    assert curves["train_loss"][3] == (3072, 42.0)
    assert sorted(curves["val_loss"]) == [0, 2]  # the checkpoint's eval-only line is not a point of this run
    assert curves["hellaswag_acc_norm"] == {0: (0, 0.25), 2: (2048, 0.3)}
    assert gpt2 == {} and bad_lines == 0


def test_train_and_val_losses_of_the_same_weights_share_their_tokens(tmp_path):
    """A train line logs the tokens through its step, (step + 1) * batch; its loss is that of the weights before
    the step's update, which the val line of that step evaluates at step * batch tokens."""
    write_log(tmp_path, run_log(range(5)))
    curves, _, _ = plot.read_log(tmp_path / "log.jsonl")
    assert {step: tokens for step, (tokens, _) in curves["train_loss"].items()} == {s: s * 1024 for s in range(5)}
    assert all(curves["val_loss"][s][0] == curves["train_loss"][s][0] for s in curves["val_loss"])


def test_gpt2_references_come_from_its_eval_only_lines(tmp_path):
    pytest.importorskip("matplotlib")
    gpt2_lines = [{"step": 0, "tokens": 0, "val_loss": 3.29, "eval_only": True, "init_from": "gpt2"},
                  {"step": 0, "tokens": 0, "hellaswag_acc_norm": 0.2955, "hellaswag_acc": 0.29, "eval_only": True,
                   "init_from": "gpt2"},
                  {"step": 0, "tokens": 0, "val_loss": 2.9, "hellaswag_acc_norm": 0.4, "eval_only": True,
                   "init_from": "gpt2-medium"}]
    for extra, expected, label in [
        (gpt2_lines, {"val_loss": 3.29, "hellaswag_acc_norm": 0.2955}, "OpenAI GPT-2 124M, measured (0.2955)"),
        (gpt2_lines[:1], {"val_loss": 3.29}, "OpenAI GPT-2 124M, published (0.2945)"),
    ]:
        write_log(tmp_path, run_log() + extra)
        curves, gpt2, _ = plot.read_log(tmp_path / "log.jsonl")
        assert gpt2 == expected
        fig = plot.plot_curves(curves, gpt2, "run")
        hellaswag_lines = {line.get_label(): line.get_ydata()[0] for line in fig.axes[2].get_lines()}
        assert hellaswag_lines[label] == gpt2.get("hellaswag_acc_norm", 0.2945)
        assert hellaswag_lines["OpenAI GPT-3 124M, published (0.337)"] == 0.337
        plot.plt.close(fig)


@pytest.mark.parametrize("steps, loss, reference", [
    (250, lambda s: 5.0 + 5.8 / (1 + s / 10) ** 0.6, None),  # a CPU run: 10.8 -> 5.8
    (19073, lambda s: 3.0 + 8.0 / (1 + s / 30) ** 0.6, 3.29),  # a GPU run: 11 -> 3.2, past GPT-2's 3.29
])
def test_loss_axis_leaves_out_the_first_steps(steps, loss, reference):
    """The ~11 of the first steps would squeeze the rest of the run into the bottom of the loss panel: the axis
    starts at the losses after the first 5% of the steps, and a late spike does not move it."""
    curves = {"train_loss": {s: (s * 1024, loss(s)) for s in range(steps)},
              "val_loss": {s: (s * 1024, loss(s)) for s in range(0, steps, 25)}, "hellaswag_acc_norm": {}}
    curves["train_loss"][steps * 3 // 4] = (0, 9.0)
    bottom, top = plot.loss_axis_limits(curves, reference)
    assert loss(int(0.06 * steps)) < top < loss(int(0.04 * steps))
    assert bottom < loss(steps - 1) < top and (reference is None or bottom < reference < top)
    if plot.plt is not None:
        fig = plot.plot_curves(curves, {} if reference is None else {"val_loss": reference}, "run")
        assert fig.axes[0].get_ylim() == fig.axes[1].get_ylim() == (bottom, top)
        plot.plt.close(fig)


def drawn(fig, label):
    """The (x, y) points of the line labelled so in the step panels (loss row, HellaSwag row)."""
    line = next(line for ax in fig.axes[::2] for line in ax.get_lines() if line.get_label() == label)
    return list(zip(line.get_xdata(), line.get_ydata()))


def test_non_finite_values_are_skipped_and_the_finite_points_drawn(tmp_path):
    """A diverging run logs NaN (not JSON, but Python's json reads it) next to null; NaN or inf points made
    matplotlib's axis limits NaN and plot.py crash. Each series drops its own non-finite points only."""
    pytest.importorskip("matplotlib")
    records = run_log(range(2)) + run_log(range(3, 6)) + [  # step 2: json.dumps writes NaN, and a skipped step
        {"step": 2, "tokens": 2048, "val_loss": float("nan"), "hellaswag_acc_norm": 0.27},
        {"step": 2, "tokens": 3072, "train_loss": None, "skipped": True}]
    records.append({"step": 0, "tokens": 0, "val_loss": float("nan"), "hellaswag_acc_norm": 0.2955,
                    "eval_only": True, "init_from": "gpt2"})
    hand_written = ('{"step": 6, "tokens": 6144, "val_loss": Infinity, "hellaswag_acc_norm": 0.31}\n'
                    '{"step": 6, "tokens": Infinity, "train_loss": 4.5}\n'
                    '{"step": 7, "tokens": 8192, "train_loss": -Infinity}\n')
    write_log(tmp_path, records, tail=hand_written)
    assert "NaN" in (tmp_path / "log.jsonl").read_text()
    result = subprocess.run([sys.executable, PLOT, str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "6 train_loss, 2 val_loss, 4 hellaswag_acc_norm, GPT-2 hellaswag_acc_norm 0.2955" in result.stdout
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"

    curves, gpt2, bad_lines = plot.read_log(tmp_path / "log.jsonl")
    assert gpt2 == {"hellaswag_acc_norm": 0.2955} and bad_lines == 0
    assert curves["train_loss"][6] == (None, 4.5)  # drawn against steps; against tokens, as a line without them
    fig = plot.plot_curves(curves, gpt2, "run")
    assert drawn(fig, "train loss") == [(0, 11.0), (1, 10.0), (3, 8.0), (4, 7.0), (5, 6.0), (6, 4.5)]
    assert drawn(fig, "val loss") == [(0, 10.0), (4, 6.0)]
    assert drawn(fig, "HellaSwag acc_norm") == [(0, 0.25), (2, 0.27), (4, 0.29), (6, 0.31)]
    assert all(map(math.isfinite, fig.axes[0].get_ylim() + fig.axes[1].get_xlim()))
    plot.plt.close(fig)


@pytest.mark.parametrize("bad_value", ["NaN", "Infinity", "-Infinity", "null"])
def test_a_series_with_no_finite_point_leaves_the_others_drawn(tmp_path, bad_value):
    pytest.importorskip("matplotlib")
    records = [json.dumps({"step": step, "tokens": (step + 1) * 1024, "train_loss": 11.0 - step}) for step in range(4)]
    records += [f'{{"step": {step}, "tokens": {step * 1024}, "val_loss": {bad_value}}}' for step in range(0, 4, 2)]
    (tmp_path / "log.jsonl").write_text("\n".join(records) + "\n")
    result = subprocess.run([sys.executable, PLOT, str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "4 train_loss, 0 val_loss" in result.stdout and (tmp_path / "curves.png").exists()
    curves, gpt2, _ = plot.read_log(tmp_path / "log.jsonl")
    fig = plot.plot_curves(curves, gpt2, "run")
    assert drawn(fig, "train loss") == [(0, 11.0), (1, 10.0), (2, 9.0), (3, 8.0)] and drawn(fig, "val loss") == []
    plot.plt.close(fig)


def test_failed_write_is_one_line_and_leaves_no_temp_file(tmp_path, monkeypatch, capsys):
    matplotlib = pytest.importorskip("matplotlib")

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    write_log(tmp_path / "log", run_log())
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", no_space)
    monkeypatch.setattr(sys, "argv", ["plot.py", str(tmp_path / "log")])
    with pytest.raises(SystemExit) as exit:
        plot.main()
    assert exit.value.code == 2
    err = capsys.readouterr().err
    # the reason, in words, as every write that runs out of room says it
    assert err.startswith(f"error: disk full writing {tmp_path / 'log' / 'curves.png'}: ")
    assert len(err.strip().splitlines()) == 1
    assert os.listdir(tmp_path / "log") == ["log.jsonl"]


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
