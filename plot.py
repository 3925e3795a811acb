"""
Plots a train_gpt2.py run next to OpenAI's GPT-2 124M:

    python plot.py LOG_DIR      # reads LOG_DIR/log.jsonl, writes LOG_DIR/curves.png

Top row: train and val loss. Bottom row: HellaSwag acc_norm. Left against steps, right against the tokens the
evaluated weights had trained on. The loss axis starts below the first steps' losses (~11 at init), so that the
rest of the run is not squeezed into the bottom of the panel.
Reference lines: GPT-2 124M's val loss and HellaSwag acc_norm as measured by an `--eval-only --init-from gpt2` run
logged into the same log.jsonl, else the published HellaSwag acc_norm of GPT-2 124M (0.2945); and GPT-3 124M's (0.337).
"""

import argparse
import json
import math
import os
import sys

from plumbing import UsageError, write_atomically

try:
    import matplotlib
    matplotlib.use("Agg")  # write a file, never open a window
    import matplotlib.pyplot as plt
except ImportError:  # matplotlib is optional for the project: only this script needs it
    plt = None

GPT2_124M_HELLASWAG = 0.2945
GPT3_124M_HELLASWAG = 0.337  # GPT-3 paper, table F: the 125M model, trained on 300B tokens
CURVES = ("train_loss", "val_loss", "hellaswag_acc_norm")
SKIP_FRACTION = 0.05  # the loss axis shows the losses after this fraction of the run's steps


def finite(value):
    """
    value if it is a finite number, else None. A diverging run may have logged NaN or inf, which json.loads reads
    (NaN, Infinity, -Infinity): such a point has nothing to show, and a single one makes the axis limits NaN or inf,
    on which matplotlib raises.
    """
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def read_log(path):
    """
    The run's curves from log.jsonl: ({name: {step: (tokens, value)}}, {name: GPT-2 124M's value}, bad line count).
    A resumed run logs steps again: the last line of a step wins, and a resume drops the steps after it.
    tokens are those the evaluated weights had trained on, step * batch for every curve: a train line logs the
    tokens through its own step, (step + 1) * batch, but its loss is that of the weights before the step's update.
    """
    curves = {name: {} for name in CURVES}
    gpt2, bad_lines = {}, 0
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
                if record.get("init_from") == "gpt2":
                    references = {name: finite(record.get(name)) for name in ("val_loss", "hellaswag_acc_norm")}
                    gpt2.update((name, value) for name, value in references.items() if value is not None)
                continue
            if record.get("event") == "resume":  # the steps after the checkpoint are being trained again
                for curve in curves.values():
                    for later_step in [s for s in curve if s > step]:
                        del curve[later_step]
            for name, curve in curves.items():
                value = finite(record.get(name))  # per curve: a NaN val_loss leaves the line's other curves drawn
                if value is not None:  # None: another curve's line, or a skipped step with a non-finite loss
                    tokens = finite(record.get("tokens"))
                    if name == "train_loss" and tokens is not None:
                        tokens = tokens // (step + 1) * step
                    curve[step] = (tokens, value)
    return curves, gpt2, bad_lines


def points(curve, x_axis):
    """A curve's (x, y) lists, x being the step or the tokens seen (lines without tokens are left out there)."""
    steps = sorted(curve)
    if x_axis == "tokens":
        steps = [step for step in steps if curve[step][0] is not None]
    return [step if x_axis == "step" else curve[step][0] for step in steps], [curve[step][1] for step in steps]


def loss_axis_limits(curves, reference):
    """
    The loss axis' (bottom, top), or None for no loss points. The losses of the first steps (~11 at init, falling
    fast) would squeeze the rest of the run into the bottom of the panel, so the range is that of the losses after
    the first 5% of the steps: the 900-step CPU default, falling to ~5.1, shows ~6.7 and below, a 19073-step GPU run
    falling to ~3.1 shows ~4 and below. The top is their 99th percentile, not their maximum, so that a late loss spike
    does not undo the cut. The reference line is always in view.
    """
    losses = [(step, value) for name in ("train_loss", "val_loss") for step, (_, value) in curves[name].items()]
    if not losses:
        return None
    first_kept = SKIP_FRACTION * max(step for step, _ in losses)
    kept = sorted(value for step, value in losses if step >= first_kept)
    bottom, top = kept[0], kept[int(0.99 * (len(kept) - 1))]
    if reference is not None:
        bottom, top = min(bottom, reference), max(top, reference)
    margin = 0.05 * max(top - bottom, 0.1)  # as matplotlib's own: no point on the edge, a flat curve gets a range
    return bottom - margin, top + margin


def plot_curves(curves, gpt2, title):
    rows = 2 if curves["hellaswag_acc_norm"] else 1  # a run without HellaSwag (the CPU default) gets the loss row only
    fig, axes = plt.subplots(rows, 2, figsize=(14, 4.5 * rows), sharex="col", sharey="row", squeeze=False)
    for column, x_axis in enumerate(["step", "tokens"]):
        loss_ax = axes[0][column]
        loss_ax.plot(*points(curves["train_loss"], x_axis), lw=0.8, alpha=0.7, label="train loss")
        loss_ax.plot(*points(curves["val_loss"], x_axis), lw=2, marker=".", label="val loss")
        if "val_loss" in gpt2:
            loss_ax.axhline(gpt2["val_loss"], color="red", ls="--",
                            label=f"OpenAI GPT-2 124M val loss ({gpt2['val_loss']:.4f})")
        panels = [(loss_ax, "loss")]
        if rows == 2:
            hellaswag_ax = axes[1][column]
            hellaswag_ax.plot(*points(curves["hellaswag_acc_norm"], x_axis), lw=2, marker=".", color="green",
                              label="HellaSwag acc_norm")
            if "hellaswag_acc_norm" in gpt2:
                gpt2_label = f"OpenAI GPT-2 124M, measured ({gpt2['hellaswag_acc_norm']:.4f})"
            else:
                gpt2_label = f"OpenAI GPT-2 124M, published ({GPT2_124M_HELLASWAG})"
            hellaswag_ax.axhline(gpt2.get("hellaswag_acc_norm", GPT2_124M_HELLASWAG), color="red", ls="--",
                                 label=gpt2_label)
            hellaswag_ax.axhline(GPT3_124M_HELLASWAG, color="purple", ls="--",
                                 label=f"OpenAI GPT-3 124M, published ({GPT3_124M_HELLASWAG})")
            panels.append((hellaswag_ax, "HellaSwag acc_norm"))
        for ax, y_label in panels:
            ax.set_xlabel(x_axis)
            ax.set_ylabel(y_label)
            ax.grid(alpha=0.3)
            ax.legend()
    limits = loss_axis_limits(curves, gpt2.get("val_loss"))
    if limits is not None:
        axes[0][0].set_ylim(*limits)  # the row shares its y axis: both loss panels
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
    curves, gpt2, bad_lines = read_log(log_path)
    if bad_lines:
        print(f"warning: skipped {bad_lines} line(s) of {log_path} that are not log records")
    if not any(curves.values()):
        print(f"error: {log_path} has no train_loss, val_loss or hellaswag_acc_norm lines to plot", file=sys.stderr)
        sys.exit(2)

    fig = plot_curves(curves, gpt2, os.path.abspath(args.log_dir))
    out_path = os.path.join(args.log_dir, "curves.png")
    try:  # whoever is looking at curves.png never sees half a picture, nor a temp file left over
        write_atomically(out_path, lambda f: fig.savefig(f, format="png", dpi=100), f"{out_path}.{os.getpid()}.tmp",
                         lambda: f"make room in {args.log_dir}")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        print(f"error: cannot write {out_path} ({e}); check that {args.log_dir} is writable and has space",
              file=sys.stderr)
        sys.exit(2)
    counts = ", ".join(f"{len(curves[name])} {name}" for name in CURVES)
    references = "".join(f", GPT-2 {name} {value:.4f}" for name, value in gpt2.items())
    print(f"wrote {out_path} ({counts}{references})")


if __name__ == "__main__":
    main()
