"""plot.py: curves.png from a log.jsonl, the reading rules (last line per step, resumes, references, tokens), the loss
axis' range and what it leaves above, errors; log/ by default, the title, token counts, the train loss' running
mean, the training-time axis, runs compared."""
import json
import math
import os
import random
import struct
import sys

import pytest

import plot
from evaluation import core_score
from helpers import REPO, run_command

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
    result = run_command([sys.executable, PLOT, str(log_dir)], None, dict(os.environ), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "skipped 1 line" in result.stdout
    assert "GPT-2 val_loss 3.2900, GPT-2 hellaswag_acc_norm 0.2955" in result.stdout
    png = (log_dir / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    assert struct.unpack(">II", png[16:24]) == (1000, 900)  # width, height: 10 x 9 inches at 100 dpi, one column
    assert sorted(os.listdir(log_dir)) == ["curves.png", "log.jsonl"]  # no temp file left behind


def test_a_line_that_is_not_utf8_is_skipped_as_damaged_lines_are(tmp_path, capsys):
    """A damaged disk block or a stray binary write leaves bytes that are not UTF-8 in log.jsonl: plot.py died on
    the UnicodeDecodeError. Such a line is skipped and counted with the lines that are not JSON."""
    write_log(tmp_path, run_log(range(2)))
    with open(tmp_path / "log.jsonl", "ab") as f:
        f.write(b'{"step": 2, "tokens": 3072, "train_loss": 9.0}\xff\xfe\x00\n')
        f.write(b'\xc3\n')  # half a two-byte character
        f.write(json.dumps({"step": 3, "tokens": 4096, "train_loss": 8.0}).encode() + b"\n")
    (run,) = plot.read_runs([str(tmp_path)], None)
    warning = f"warning: skipped 2 line(s) of {tmp_path / 'log.jsonl'} that are not log records (line 5, 6)\n"
    assert capsys.readouterr().out == warning
    assert sorted(run.curves["train_loss"]) == [0, 1, 3]  # the lines after them are read


def test_a_blank_line_is_counted_with_the_damaged_ones(tmp_path, capsys):
    """A blank line holds no record: it is named as a damaged line is (the readers of data files skip blank lines)."""
    write_log(tmp_path, run_log(range(2)))
    with open(tmp_path / "log.jsonl", "a") as f:
        f.write("\n" + json.dumps({"step": 2, "tokens": 3072, "train_loss": 9.0}) + "\n")
    (run,) = plot.read_runs([str(tmp_path)], None)
    warning = f"warning: skipped 1 line(s) of {tmp_path / 'log.jsonl'} that are not log records (line 5)\n"
    assert capsys.readouterr().out == warning
    assert sorted(run.curves["train_loss"]) == [0, 1, 2]


def test_a_line_nested_too_deep_or_of_an_impossible_step_is_skipped_and_named(tmp_path):
    """A damaged log.jsonl stopped plot.py with a traceback: a line of 200,000 ['s (RecursionError), a step of -1 (the
    train line's tokens per step divided by zero), a loss of 10**400 (OverflowError: no float holds it). The first
    two are skipped and named by their line numbers, the loss is no point, and the rest is drawn."""
    pytest.importorskip("matplotlib")
    write_log(tmp_path, run_log(range(2)), tail="[" * 200_000 + "]" * 200_000 + "\n" +
              '{"step": -1, "train_loss": 1.0, "tokens": 5}\n{"step": 2, "train_loss": 1' + "0" * 400 + "}\n")
    with open(tmp_path / "log.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "tokens": 4096, "train_loss": 8.0}) + "\n")
    result = run_command([sys.executable, PLOT, str(tmp_path)], None, dict(os.environ), timeout=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert (f"warning: skipped 2 line(s) of {tmp_path / 'log.jsonl'} that are not log records (line 5, 6)"
            in result.stdout.splitlines())
    assert "(3 train_loss, 1 val_loss, 1 hellaswag_acc_norm, 0 core)" in result.stdout  # train steps 0, 1 and 3
    assert os.path.getsize(tmp_path / "curves.png") > 0


def test_last_line_per_step_wins_and_a_resume_drops_later_steps(tmp_path):
    records = run_log(range(6))
    records.append({"step": 2, "event": "resume"})  # from the checkpoint of step 2: steps 3..5 are redone
    rerun = run_log(range(2, 4))  # step 2: val, hellaswag, train; step 3: train
    rerun[1]["hellaswag_acc_norm"], rerun[3]["train_loss"] = 0.3, 42.0
    records += rerun
    records.append({"step": 3, "tokens": 3072, "val_loss": 1.5, "eval_only": True, "init_from": "log/ckpt_000003.pt"})
    records.append({"step": 4, "tokens": 5120, "train_loss": None, "skipped": True})  # non-finite: no point
    write_log(tmp_path, records)
    curves, gpt2, bad_lines = plot.read_log(tmp_path / "log.jsonl")[:3]
    assert sorted(curves["train_loss"]) == [0, 1, 2, 3]
    assert curves["train_loss"][3] == (3072, 42.0)
    assert sorted(curves["val_loss"]) == [0, 2]  # the checkpoint's eval-only line is not a point of this run
    assert curves["hellaswag_acc_norm"] == {0: (0, 0.25), 2: (2048, 0.3)}
    assert gpt2 == {} and bad_lines == []


def test_train_and_val_losses_of_the_same_weights_share_their_tokens(tmp_path):
    """A train line logs the tokens through its step, (step + 1) * batch; its loss is that of the weights before
    the step's update, which the val line of that step evaluates at step * batch tokens."""
    write_log(tmp_path, run_log(range(5)))
    curves, _, _ = plot.read_log(tmp_path / "log.jsonl")[:3]
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
        (gpt2_lines, {"val_loss": 3.29, "hellaswag_acc_norm": 0.2955},
         "OpenAI GPT-2 124M HellaSwag acc_norm, measured (0.2955)"),
        (gpt2_lines[:1], {"val_loss": 3.29}, "OpenAI GPT-2 124M HellaSwag acc_norm, published (0.2945)"),
    ]:
        write_log(tmp_path, run_log() + extra)
        curves, gpt2, _ = plot.read_log(tmp_path / "log.jsonl")[:3]
        assert gpt2 == expected
        fig = plot.plot_runs([plot.Run(curves, gpt2)])
        hellaswag_lines = {line.get_label(): line.get_ydata()[0] for line in fig.axes[1].get_lines()}
        assert hellaswag_lines[label] == gpt2.get("hellaswag_acc_norm", 0.2945)
        assert hellaswag_lines["OpenAI GPT-3 124M HellaSwag acc_norm, published (0.337)"] == 0.337
        plot.plt.close(fig)


def test_core_has_a_row_of_its_own_with_gpt2s_lines(tmp_path):
    """CORE against the step, under HellaSwag, with GPT-2 124M's line (nanochat's measure, as core_score.py has it, or
    the log's own of --eval-only --init-from gpt2) and GPT-2 1.5B's; without HellaSwag points, right under the
    losses."""
    pytest.importorskip("matplotlib")
    openai = core_score.OPENAI_CORE
    assert (plot.GPT2_124M_CORE, plot.GPT2_XL_CORE) == (openai["gpt2"], openai["gpt2-xl"])
    core_lines = [{"step": step, "tokens": step * 1024, "core": 0.01 * step, "core_accuracy": {"copa": 0.5},
                   "core_centered": {"copa": 0.0}, "core_examples": 100} for step in (0, 2)]
    gpt2_line = {"step": 0, "tokens": 0, "core": 0.1142, "eval_only": True, "init_from": "gpt2"}
    for records, rows, gpt2 in [
        (run_log() + core_lines, 3, ("nanochat's", 0.1139)),
        ([r for r in run_log() if "hellaswag_acc_norm" not in r] + core_lines + [gpt2_line], 2, ("measured", 0.1142)),
    ]:
        write_log(tmp_path, records)
        fig = plot.plot_runs([plot.read_log(tmp_path / "log.jsonl")])
        core_panel = fig.axes[rows - 1]
        assert len(fig.axes) == rows and core_panel.get_ylabel() == "CORE"
        references = {line.get_label(): line.get_ydata()[0] for line in core_panel.get_lines()}
        assert references[f"OpenAI GPT-2 124M CORE, {gpt2[0]} ({gpt2[1]})"] == gpt2[1]
        assert references["OpenAI GPT-2 1.5B CORE, nanochat's (0.2565)"] == 0.2565
        assert drawn(fig, "CORE") == [(0, 0.0), (2, 0.02)]
        plot.plt.close(fig)


@pytest.mark.parametrize("steps, loss, reference", [
    (250, lambda s: 5.0 + 5.8 / (1 + s / 10) ** 0.6, None),  # a CPU run: 10.8 -> 5.8
    (19073, lambda s: 3.0 + 8.0 / (1 + s / 30) ** 0.6, 3.29),  # a GPU run: 11 -> 3.2, past GPT-2's 3.29
])
def test_loss_axis_leaves_out_the_first_steps(steps, loss, reference):
    """The ~11 of the first steps would squeeze the rest of the run into the bottom of the loss panel: the axis
    starts at the losses after the first 5% of the steps, and a late spike does not move it."""
    curves = {"train_loss": {s: (s * 1024, loss(s)) for s in range(steps)},
              "val_loss": {s: (s * 1024, loss(s)) for s in range(0, steps, 25)}, "hellaswag_acc_norm": {}, "core": {}}
    curves["train_loss"][steps * 3 // 4] = (0, 9.0)
    bottom, top = plot.loss_axis_limits([curves], reference)
    assert loss(int(0.06 * steps)) < top < loss(int(0.04 * steps))
    assert bottom < loss(steps - 1) < top and (reference is None or bottom < reference < top)
    if plot.plt is not None:
        fig = plot.plot_runs([plot.Run(curves, {} if reference is None else {"val_loss": reference})])
        assert fig.axes[0].get_ylim() == (bottom, top)
        plot.plt.close(fig)


def drawn(fig, label):
    """The (x, y) points of the line labelled so in the step panels (loss row, HellaSwag row)."""
    line = next(line for ax in fig.axes if ax.get_xlabel() == "step" for line in ax.get_lines()
                if line.get_label() == label)
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
    result = run_command([sys.executable, PLOT, str(tmp_path)], None, dict(os.environ), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "6 train_loss, 2 val_loss, 4 hellaswag_acc_norm, 0 core, GPT-2 hellaswag_acc_norm 0.2955" in result.stdout
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"

    curves, gpt2, bad_lines = plot.read_log(tmp_path / "log.jsonl")[:3]
    assert gpt2 == {"hellaswag_acc_norm": 0.2955} and bad_lines == []
    assert curves["train_loss"][6] == (None, 4.5)  # drawn against steps; against tokens, as a line without them
    fig = plot.plot_runs([plot.Run(curves, gpt2)])
    assert drawn(fig, "train loss") == [(0, 11.0), (1, 10.0), (3, 8.0), (4, 7.0), (5, 6.0), (6, 4.5)]
    assert drawn(fig, "val loss") == [(0, 10.0), (4, 6.0)]
    assert drawn(fig, "HellaSwag acc_norm") == [(0, 0.25), (2, 0.27), (4, 0.29), (6, 0.31)]
    fig.canvas.draw()
    assert all(map(math.isfinite, fig.axes[0].get_ylim() + fig.axes[0].child_axes[0].get_xlim()))  # tokens: on top
    plot.plt.close(fig)


@pytest.mark.parametrize("bad_value", ["NaN", "Infinity", "-Infinity", "null"])
def test_a_series_with_no_finite_point_leaves_the_others_drawn(tmp_path, bad_value):
    pytest.importorskip("matplotlib")
    records = [json.dumps({"step": step, "tokens": (step + 1) * 1024, "train_loss": 11.0 - step}) for step in range(4)]
    records += [f'{{"step": {step}, "tokens": {step * 1024}, "val_loss": {bad_value}}}' for step in range(0, 4, 2)]
    (tmp_path / "log.jsonl").write_text("\n".join(records) + "\n")
    result = run_command([sys.executable, PLOT, str(tmp_path)], None, dict(os.environ), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "4 train_loss, 0 val_loss" in result.stdout and (tmp_path / "curves.png").exists()
    curves, gpt2, _ = plot.read_log(tmp_path / "log.jsonl")[:3]
    fig = plot.plot_runs([plot.Run(curves, gpt2)])
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
                             (tmp_path / "empty", "no train_loss, val_loss, hellaswag_acc_norm or core")]:
        if log_dir.name == "empty":
            write_log(log_dir, [{"step": 0, "event": "resume"}])
        result = run_command([sys.executable, PLOT, str(log_dir)], None, dict(os.environ), timeout=120)
        assert result.returncode == 2
        assert result.stderr.startswith("error:") and culprit in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_without_matplotlib_says_so_in_one_line(tmp_path):
    blocker = tmp_path / "no_matplotlib" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is blocked by the test')\n")
    write_log(tmp_path / "log", run_log())
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "no_matplotlib"))
    result = run_command([sys.executable, PLOT, str(tmp_path / "log")], None, env, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: plot.py needs matplotlib, which is not installed: pip install matplotlib"
    assert not (tmp_path / "log" / "curves.png").exists()


def png_size(path):
    png = path.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    return struct.unpack(">II", png[16:24])  # width, height


def test_no_argument_reads_log_the_trainers_default(tmp_path, monkeypatch, capsys):
    """`python plot.py` was a usage error; the trainer's --log-dir defaults to log, and so does plot.py."""
    pytest.importorskip("matplotlib")
    write_log(tmp_path / "log", run_log())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["plot.py"])
    plot.main()
    assert capsys.readouterr().out.startswith(f"wrote {os.path.join('log', 'curves.png')} (4 train_loss, 2 val_loss")
    assert png_size(tmp_path / "log" / "curves.png") == (1000, 900)


def shakespeare_curves(seed=0):
    """The Shakespeare quick start's shape: 900 steps of 1024 tokens, train loss falling from ~11 to noise around
    4-6, its val losses every 150 steps."""
    rng = random.Random(seed)
    train = {s: (s * 1024, 4.8 + 6.1 * math.exp(-s / 38) + rng.gauss(0, 0.45 if s > 40 else 0.1)) for s in range(900)}
    val = dict(zip(range(0, 901, 150), [10.84, 6.11, 5.47, 5.59, 5.19, 5.37, 5.11]))
    return {"train_loss": train, "val_loss": {s: (s * 1024, v) for s, v in val.items()}, "hellaswag_acc_norm": {},
            "core": {}}


def test_points_above_the_loss_axis_are_marked_and_listed():
    """The axis leaves the first steps' losses above it (10.84 at step 0 for Shakespeare): each such val point gets
    a ▲ on the top edge, in each loss panel, and a note above the panel says what is left out."""
    pytest.importorskip("matplotlib")
    curves = shakespeare_curves()
    fig = plot.plot_runs([plot.Run(curves, {})])
    top = fig.axes[0].get_ylim()[1]
    val_above = [(s, v) for s, (_, v) in sorted(curves["val_loss"].items()) if v > top]
    train_above = [v for _, v in curves["train_loss"].values() if v > top]
    assert val_above == [(0, 10.84)] and len(train_above) > 20  # in view: 6.11 at step 150 and all after
    assert fig.axes[0].get_title(loc="left") == (f"▲ above the axis: val loss 10.84 at step 0, train loss at "
                                                 f"{len(train_above)} steps (up to {max(train_above):.2f})")
    (ax,) = fig.axes  # the loss against steps, and tokens along its top
    marks = [line for line in ax.get_lines() if line.get_marker() == "^"]
    assert len(marks) == 1 and not marks[0].get_clip_on()  # drawn over the edge, not clipped away
    assert list(marks[0].get_xdata()) == [0] and list(marks[0].get_ydata()) == [top]
    plot.plt.close(fig)

    curves["val_loss"].pop(0)  # nothing above the axis: no note, no mark
    curves["train_loss"] = {s: (s * 1024, 6.5 if s % 2 else 4.0) for s in range(900)}
    fig = plot.plot_runs([plot.Run(curves, {})])
    assert fig.axes[0].get_title(loc="left") == ""
    assert not [line for line in fig.axes[0].get_lines() if line.get_marker() == "^"]
    plot.plt.close(fig)


def test_title_names_the_run_and_its_recipe_not_an_absolute_path(tmp_path, capsys):
    """The title was the log dir's absolute path; it is the run's name, its recipe (from the log's start record,
    else --recipe; a --recipe the log contradicts is refused) and where it ended."""
    pytest.importorskip("matplotlib")
    write_log(tmp_path / "shk", [{"event": "start", "recipe": "modern", "model": "d12"}] + run_log(range(5)))
    write_log(tmp_path / "old", run_log(range(5)))
    for log_dir, recipes, expected in [
        ("shk", None, "shk (recipe modern): 4 steps, 4.1K tokens"),  # step 4: its val line, 4 * 1024 tokens
        ("shk", ["modern"], "shk (recipe modern): 4 steps, 4.1K tokens"),
        ("old", None, "old: 4 steps, 4.1K tokens"),
        ("old", ["gpt2"], "old (recipe gpt2): 4 steps, 4.1K tokens"),
    ]:
        runs = plot.read_runs([str(tmp_path / log_dir)], recipes)
        assert runs[0].bad_lines == []  # the start record has no step, and is no bad line
        fig = plot.plot_runs(runs)
        assert fig.get_suptitle() == expected
        plot.plt.close(fig)
    with pytest.raises(plot.UsageError, match="--recipe gpt2, but .* says the run's recipe is modern"):
        plot.read_runs([str(tmp_path / "shk")], ["gpt2"])
    with pytest.raises(plot.UsageError, match="--recipe given 1 time"):
        plot.read_runs([str(tmp_path / "shk"), str(tmp_path / "old")], ["gpt2"])
    assert plot.run_names(["runs/a/log", "runs/b/log", "/abs/shk"]) == ["runs/a/log", "runs/b/log", "shk"]


def test_tokens_read_as_people_say_them():
    pytest.importorskip("matplotlib")
    for count, said in [(0, "0"), (512, "512"), (200000, "200K"), (921600, "922K"), (999999, "1M"),
                        (1.5e6, "1.5M"), (19073 * 524288, "10B"), (2.5e9, "2.5B"), (3e12, "3T")]:
        assert plot.tokens_label(count) == said
    fig = plot.plot_runs([plot.Run(shakespeare_curves(), {})], ("step",))
    fig.canvas.draw()  # where the tokens axis over the steps takes its limits
    secondary = fig.axes[0].child_axes[0]
    tokens_axis, (left, right) = secondary.xaxis, secondary.get_xlim()
    ticks = [tokens_axis.get_major_formatter()(x, 0) for x in tokens_axis.get_majorticklocs() if left <= x <= right]
    assert ticks == ["0", "200K", "400K", "600K", "800K"]
    plot.plt.close(fig)


def test_train_loss_is_drawn_with_its_running_mean():
    """The noisy train loss (±0.5 on Shakespeare) is drawn faint, with its running mean over 2% of its points on
    top: each point's mean with its neighbours, fewer at the ends; checked against the mean of each slice."""
    pytest.importorskip("matplotlib")
    values = [random.Random(1).random() for _ in range(30)]
    for window in (1, 3, 7):
        half = window // 2
        naive = [sum(values[max(i - half, 0):i + half + 1]) / len(values[max(i - half, 0):i + half + 1])
                 for i in range(len(values))]
        assert plot.running_mean(values, window) == pytest.approx(naive, rel=1e-12)
    assert [plot.smoothing_window(n) for n in (60, 99, 100, 900, 19073)] == [1, 1, 3, 19, 381]

    curves = shakespeare_curves()
    fig = plot.plot_runs([plot.Run(curves, {})])
    raw, mean = drawn(fig, "train loss"), drawn(fig, "train loss, mean of 19 steps")
    assert [x for x, _ in raw] == [x for x, _ in mean] == list(range(900))
    ys = [y for _, y in raw]
    assert [y for _, y in mean] == pytest.approx([sum(ys[max(i - 9, 0):i + 10]) / len(ys[max(i - 9, 0):i + 10])
                                                  for i in range(900)])
    plot.plt.close(fig)
    short = {"train_loss": {s: (s, 11.0 - s / 10) for s in range(60)}, "val_loss": {}, "hellaswag_acc_norm": {},
             "core": {}}
    fig = plot.plot_runs([plot.Run(short, {})])  # too few points to smooth: the raw line alone
    assert [line.get_label() for line in fig.axes[0].get_lines() if line.get_label().startswith("train")] == [
        "train loss"]
    plot.plt.close(fig)


def test_tokens_run_along_the_top_of_the_step_panel(tmp_path):
    """Against steps and against tokens, a run of constant batch drew the same curve twice, in two columns: one
    panel, steps below and the tokens they stand for on an axis above, with the time panel beside it. Runs compared
    that train different batches keep a tokens column of their own, and no tokens axis over their steps."""
    pytest.importorskip("matplotlib")
    write_log(tmp_path / "small", timed_log(range(5)))  # 1024 tokens a step
    runs = plot.read_runs([str(tmp_path / "small")], None)
    assert plot.chosen_x_axes(None, runs) == ("step", "time")
    fig = plot.plot_runs(runs, plot.chosen_x_axes(None, runs))
    loss = fig.axes[0]
    (tokens_axis,) = loss.child_axes
    assert (loss.get_xlabel(), tokens_axis.get_xlabel(), fig.axes[1].get_xlabel()) == (
        "step", "tokens", "training time (min)")
    fig.canvas.draw()
    assert tokens_axis.get_xlim() == pytest.approx([step * 1024 for step in loss.get_xlim()])
    assert drawn(fig, "val loss") == [(0, 10.0), (2, 8.0), (4, 6.0)]
    plot.plt.close(fig)

    write_log(tmp_path / "big", [dict(record, tokens=2 * record["tokens"]) for record in run_log(range(5))])
    runs = plot.read_runs([str(tmp_path / "small"), str(tmp_path / "big")], None)
    assert plot.chosen_x_axes(None, runs) == ("step", "tokens", "time")
    fig = plot.plot_runs(runs, plot.chosen_x_axes(None, runs))
    assert not fig.axes[0].child_axes and fig.axes[1].get_xlabel() == "tokens"
    big_val = next(line for line in fig.axes[1].get_lines() if line.get_label() == "big: val loss")
    assert list(big_val.get_xdata()) == [0, 4096, 8192]
    plot.plt.close(fig)


def timed_log(steps=range(4), dt=40.0):
    """run_log with the training seconds each step line logs at its end: dt a step."""
    records = run_log(steps)
    for record in records:
        if "train_loss" in record:
            record["elapsed_s"] = (record["step"] + 1) * dt
    return records


def test_time_axis_when_the_log_has_training_times(tmp_path):
    """A third column against training time when step lines carry elapsed_s: a point at step s is at the seconds
    logged by step s - 1 (0 at step 0), as its tokens are those trained before step s. Logs without it: two columns,
    and --x time is refused in one line."""
    pytest.importorskip("matplotlib")
    write_log(tmp_path / "timed", timed_log(range(5), dt=40.0))  # 200 s: minutes
    runs = plot.read_runs([str(tmp_path / "timed")], None)
    assert plot.chosen_x_axes(None, runs) == ("step", "time")
    fig = plot.plot_runs(runs, ("step", "tokens", "time"))
    assert fig.axes[2].get_xlabel() == "training time (min)"
    minutes = [0, 40 / 60, 80 / 60, 120 / 60, 160 / 60]
    train = next(line for line in fig.axes[2].get_lines() if line.get_label() == "train loss")
    val = next(line for line in fig.axes[2].get_lines() if line.get_label() == "val loss")
    assert list(train.get_xdata()) == pytest.approx(minutes) and list(val.get_xdata()) == pytest.approx(minutes[::2])
    assert fig.get_suptitle() == "timed: 4 steps, 4.1K tokens, 2.67 min"
    plot.plt.close(fig)
    assert [plot.time_unit(s) for s in (0, 119, 120, 7199, 7200)] == [(1, "s"), (1, "s"), (60, "min"), (60, "min"),
                                                                     (3600, "h")]

    write_log(tmp_path / "untimed", run_log())
    untimed = plot.read_runs([str(tmp_path / "untimed")], None)
    assert plot.chosen_x_axes(None, untimed) == ("step",)
    assert plot.chosen_x_axes("tokens,time", runs) == ("tokens", "time")
    for x, error in [("time", "--x time: no log has training times"), ("steps", "--x steps: a comma-separated")]:
        with pytest.raises(plot.UsageError, match=error):
            plot.chosen_x_axes(x, untimed)


def test_several_runs_share_the_axes_and_one_legend(tmp_path, monkeypatch, capsys):
    """Runs compared are drawn in the same panels, a colour each, under one legend that names each run and recipe;
    the picture goes to compare.png, sized by its columns (time: one of the logs has it) and rows."""
    pytest.importorskip("matplotlib")
    write_log(tmp_path / "gpt2", run_log(range(5)))
    write_log(tmp_path / "modern", [{"event": "start", "recipe": "modern"}] + timed_log(range(5)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["plot.py", "gpt2", "modern", "--recipe", "gpt2", "--recipe", "modern"])
    plot.main()
    assert capsys.readouterr().out.startswith("wrote compare.png (gpt2: 5 train_loss, 3 val_loss, "
                                              "3 hellaswag_acc_norm, 0 core; modern: 5 train_loss")
    assert png_size(tmp_path / "compare.png") == (1400, 900)  # step (tokens along its top) and time

    runs = plot.read_runs(["gpt2", "modern"], ["gpt2", None])
    fig = plot.plot_runs(runs, ("step", "tokens"))
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)
    labels = [text.get_text() for text in fig.legends[0].get_texts()]
    assert labels == [  # filled column by column: a run's, a run's, the references
        "gpt2 (recipe gpt2): train loss", "gpt2 (recipe gpt2): val loss", "gpt2 (recipe gpt2): HellaSwag acc_norm",
        "modern (recipe modern): train loss", "modern (recipe modern): val loss",
        "modern (recipe modern): HellaSwag acc_norm",
        "OpenAI GPT-2 124M HellaSwag acc_norm, published (0.2945)",
        "OpenAI GPT-3 124M HellaSwag acc_norm, published (0.337)", ""]
    assert [len(column) for column in plot.legend_columns(runs, [label for label in labels if label])] == [3, 3, 3]
    assert drawn(fig, "gpt2 (recipe gpt2): val loss") == drawn(fig, "modern (recipe modern): val loss") == [
        (0, 10.0), (2, 8.0), (4, 6.0)]  # the same run twice: the same points in the same panel
    colors = {line.get_label(): line.get_color() for line in fig.axes[0].get_lines()}
    assert colors["gpt2 (recipe gpt2): val loss"] != colors["modern (recipe modern): val loss"]
    assert fig.get_suptitle() == "gpt2 (recipe gpt2) vs modern (recipe modern)"
    plot.plt.close(fig)
