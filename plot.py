"""
Plots a train_gpt2.py run next to OpenAI's GPT-2 124M:

    python plot.py LOG_DIR      # reads LOG_DIR/log.jsonl, writes LOG_DIR/curves.png

Top row: train and val loss. Bottom row: HellaSwag acc_norm. Left against steps, right against tokens.
Reference lines: GPT-2 124M's val loss on the same data, when an `--eval-only --init-from gpt2` run logged
it into the same log.jsonl, and the HellaSwag acc_norm of GPT-2 124M (0.2945) and GPT-3 124M (0.337).
"""

import argparse
import json
import os
import sys
import tempfile

try:
    import matplotlib
    matplotlib.use("Agg")  # write a file, never open a window
    import matplotlib.pyplot as plt
except ImportError:  # matplotlib is optional for the project: only this script needs it
    plt = None

GPT2_124M_HELLASWAG = 0.2945
GPT3_124M_HELLASWAG = 0.337  # GPT-3 paper, table F: the 125M model, trained on 300B tokens
CURVES = ("train_loss", "val_loss", "hellaswag_acc_norm")


def read_log(path):
    """
    The run's curves from log.jsonl: ({name: {step: (tokens, value)}}, GPT-2's val loss or None, bad line count).
    A resumed run logs steps again: the last line of a step wins, and a resume drops the steps after it.
    """
    curves = {name: {} for name in CURVES}
    gpt2_val_loss, bad_lines = None, 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # e.g. the last line of a run killed mid-write
                bad_lines += 1
                continue
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                bad_lines += 1
                continue
            step = record["step"]
            if record.get("eval_only"):  # evaluations of other models: references, not points of this run
                if record.get("init_from") == "gpt2" and record.get("val_loss") is not None:
                    gpt2_val_loss = record["val_loss"]
                continue
            if record.get("event") == "resume":  # the steps after the checkpoint are being trained again
                for curve in curves.values():
                    for later_step in [s for s in curve if s > step]:
                        del curve[later_step]
            for name, curve in curves.items():
                if record.get(name) is not None:  # None: a skipped step with a non-finite loss
                    curve[step] = (record.get("tokens"), record[name])
    return curves, gpt2_val_loss, bad_lines


def points(curve, x_axis):
    """A curve's (x, y) lists, x being the step or the tokens seen (lines without tokens are left out there)."""
    steps = sorted(curve)
    if x_axis == "tokens":
        steps = [step for step in steps if curve[step][0] is not None]
    return [step if x_axis == "step" else curve[step][0] for step in steps], [curve[step][1] for step in steps]


def plot_curves(curves, gpt2_val_loss, title):
    rows = 2 if curves["hellaswag_acc_norm"] else 1  # a run without HellaSwag (the CPU default) gets the loss row only
    fig, axes = plt.subplots(rows, 2, figsize=(14, 4.5 * rows), sharex="col", sharey="row", squeeze=False)
    for column, x_axis in enumerate(["step", "tokens"]):
        loss_ax = axes[0][column]
        loss_ax.plot(*points(curves["train_loss"], x_axis), lw=0.8, alpha=0.7, label="train loss")
        loss_ax.plot(*points(curves["val_loss"], x_axis), lw=2, marker=".", label="val loss")
        if gpt2_val_loss is not None:
            loss_ax.axhline(gpt2_val_loss, color="red", ls="--", label=f"OpenAI GPT-2 124M val loss ({gpt2_val_loss:.4f})")
        panels = [(loss_ax, "loss")]
        if rows == 2:
            hellaswag_ax = axes[1][column]
            hellaswag_ax.plot(*points(curves["hellaswag_acc_norm"], x_axis), lw=2, marker=".", color="green", label="HellaSwag acc_norm")
            hellaswag_ax.axhline(GPT2_124M_HELLASWAG, color="red", ls="--", label=f"OpenAI GPT-2 124M ({GPT2_124M_HELLASWAG})")
            hellaswag_ax.axhline(GPT3_124M_HELLASWAG, color="purple", ls="--", label=f"OpenAI GPT-3 124M ({GPT3_124M_HELLASWAG})")
            panels.append((hellaswag_ax, "HellaSwag acc_norm"))
        for ax, y_label in panels:
            ax.set_xlabel(x_axis)
            ax.set_ylabel(y_label)
            ax.grid(alpha=0.3)
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def main():
    parser = argparse.ArgumentParser(description="Plot the loss and HellaSwag curves of a train_gpt2.py run.")
    parser.add_argument("log_dir", help="the --log-dir of the run: holds log.jsonl; curves.png is written there")
    args = parser.parse_args()
    log_path = os.path.join(args.log_dir, "log.jsonl")
    if plt is None:
        print("error: plot.py needs matplotlib, which is not installed: pip install matplotlib", file=sys.stderr)
        sys.exit(2)
    if not os.path.isfile(log_path):
        print(f"error: {log_path} not found: pass the --log-dir of a train_gpt2.py run", file=sys.stderr)
        sys.exit(2)
    curves, gpt2_val_loss, bad_lines = read_log(log_path)
    if bad_lines:
        print(f"warning: skipped {bad_lines} line(s) of {log_path} that are not log records")
    if not any(curves.values()):
        print(f"error: {log_path} has no train_loss, val_loss or hellaswag_acc_norm lines to plot", file=sys.stderr)
        sys.exit(2)

    fig = plot_curves(curves, gpt2_val_loss, os.path.abspath(args.log_dir))
    out_path = os.path.join(args.log_dir, "curves.png")
    # a temp file and a rename: whoever is looking at curves.png never sees half a picture
    with tempfile.NamedTemporaryFile(dir=args.log_dir, prefix="curves.", suffix=".png.tmp", delete=False) as f:
        fig.savefig(f, format="png", dpi=100)
    os.chmod(f.name, 0o644)  # NamedTemporaryFile makes it private; a plot is for sharing
    os.replace(f.name, out_path)
    counts = ", ".join(f"{len(curves[name])} {name}" for name in CURVES)
    print(f"wrote {out_path} ({counts}{'' if gpt2_val_loss is None else f', GPT-2 val loss {gpt2_val_loss:.4f}'})")


if __name__ == "__main__":
    main()
