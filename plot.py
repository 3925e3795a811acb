"""
Plots train_gpt2.py runs next to OpenAI's GPT-2 124M:

    python plot.py                  # reads log/log.jsonl (the trainer's default --log-dir), writes log/curves.png
    python plot.py LOG_DIR          # reads LOG_DIR/log.jsonl, writes LOG_DIR/curves.png
    python plot.py LOG_A LOG_B      # both runs on the same axes, with one legend; writes compare.png here
    options: --out PATH, --x step,tokens,time (the columns), --recipe NAME (once per LOG_DIR, for logs that lack it)

Top row: train loss (faint: each step's; solid: its running mean) and val loss. Below it: HellaSwag acc_norm, and
the CORE score (evaluation/core_score.py), each where a run has its points.
Columns: against steps, with the tokens the evaluated weights had trained on along the top (a run of constant batch
is the same curve against either); against tokens, in a column of its own where runs compared train different
batches; and, when the log records it ("elapsed_s"), against the training time they had taken. The loss axis tops
out below the first steps' losses (~11 at init), so that the rest of the run is not squeezed into the bottom of the
panel: ▲ marks the val points above it, and a note lists what it leaves out.
Reference lines: GPT-2 124M's val loss, HellaSwag acc_norm and CORE as measured by an `--eval-only --init-from gpt2`
run logged into the same log.jsonl, else the published HellaSwag acc_norm of GPT-2 124M (0.2945) and its CORE as
nanochat measured it (0.1139); and GPT-3 124M's HellaSwag (0.337) and GPT-2 1.5B's CORE (0.2565, nanochat's).
"""

import argparse
import itertools
import math
import os
import sys
from collections import namedtuple

from machinery.errors import UsageError
from machinery.files import json_records, write_atomically

try:
    import matplotlib
    matplotlib.use("Agg")  # write a file, never open a window
    import matplotlib.pyplot as plt
except ImportError:  # matplotlib is optional for the project: only this script needs it
    plt = None

GPT2_124M_HELLASWAG = 0.2945
GPT3_124M_HELLASWAG = 0.337  # GPT-3 paper, table F: the 125M model, trained on 300B tokens
GPT2_124M_CORE, GPT2_XL_CORE = 0.1139, 0.2565  # as nanochat measured OpenAI's GPT-2 124M and 1.5B (core_score.py)
BENCHMARKS = ("hellaswag_acc_norm", "core")  # a row each, under the losses
# each benchmark's reference lines, (model, value, whose measure): GPT-2 124M's (unless measured in the log), another's
REFERENCES = {
    "hellaswag_acc_norm": (("OpenAI GPT-2 124M", GPT2_124M_HELLASWAG, "published"),
                           ("OpenAI GPT-3 124M", GPT3_124M_HELLASWAG, "published")),
    "core": (("OpenAI GPT-2 124M", GPT2_124M_CORE, "nanochat's"), ("OpenAI GPT-2 1.5B", GPT2_XL_CORE, "nanochat's")),
}
CURVES = ("train_loss", "val_loss", *BENCHMARKS)
SERIES = CURVES + ("elapsed_s",)  # elapsed_s: the training seconds a step line logs, read for the time axis
X_AXES = ("step", "tokens", "time")
SKIP_FRACTION = 0.05  # the loss axis shows the losses after this fraction of the run's steps
SMOOTHING_FRACTION = 0.02  # the train loss' running mean spans this fraction of its points
LABELS = {"train_loss": "train loss", "val_loss": "val loss", "hellaswag_acc_norm": "HellaSwag acc_norm",
          "core": "CORE"}
RUN_COLORS = ("C0", "C1", "C2", "C5", "C6", "C8", "C9", "C7")  # runs compared: not the reference lines' red, purple

# curves: {series: {step: (tokens, value)}}; gpt2: {curve: GPT-2 124M's value}; name: for titles and legends
Run = namedtuple("Run", "curves gpt2 bad_lines recipe name", defaults=((), None, "run"))


def finite(value):
    """
    value if it is a finite number, else None. A diverging run may have logged NaN or inf, which json.loads reads
    (NaN, Infinity, -Infinity): such a point has nothing to show, and a single one makes the axis limits NaN or inf,
    on which matplotlib raises. A damaged line may hold an integer past a float's range.
    """
    try:
        return value if isinstance(value, (int, float)) and math.isfinite(value) else None
    except OverflowError:  # an integer past a float's range
        return None


def read_log(path, name="run"):
    """
    A run's log.jsonl as a Run: its curves, GPT-2 124M's values, the numbers of its lines that are not records, and
    the recipe that a line names (the trainer's first line, when it writes one).
    A resumed run logs steps again: the last line of a step wins, and a resume drops the steps after it.
    tokens are those the evaluated weights had trained on, step * batch for every curve: a train line logs the
    tokens through its own step, (step + 1) * batch, but its loss is that of the weights before the step's update.
    """
    curves = {series: {} for series in SERIES}
    gpt2, bad_lines, recipe = {}, [], None
    for number, record in json_records(path):
        if record is None:  # not JSON (the last line of a run killed mid-write), or damaged
            bad_lines.append(number)
            continue
        if isinstance(record.get("recipe"), str) and not record.get("eval_only"):
            recipe = record["recipe"]
        step = record.get("step")
        if not (isinstance(step, int) and step >= 0):  # a negative one only in a damaged line
            if "event" not in record:  # an event (the run's start) need not have a step
                bad_lines.append(number)
            continue
        if record.get("eval_only"):  # evaluations of other models: references, not points of this run
            if record.get("init_from") == "gpt2":
                references = {curve: finite(record.get(curve)) for curve in ("val_loss", *BENCHMARKS)}
                gpt2.update((curve, value) for curve, value in references.items() if value is not None)
            continue
        if record.get("event") == "resume":  # the steps after the checkpoint are being trained again
            for points_of in curves.values():
                for later_step in [s for s in points_of if s > step]:
                    del points_of[later_step]
        for series, points_of in curves.items():
            value = finite(record.get(series))  # per curve: a NaN val_loss leaves the line's other curves drawn
            if value is not None:  # None: another curve's line, or a skipped step with a non-finite loss
                tokens = finite(record.get("tokens"))
                if series == "train_loss" and tokens is not None:
                    tokens = tokens // (step + 1) * step
                points_of[step] = (tokens, value)
    return Run(curves, gpt2, bad_lines, recipe, name)


def seconds_before(run, step):
    """The training seconds before step's update, when the evaluated weights of step were those of the step line
    before it; None where the log does not say (one without elapsed_s)."""
    elapsed = run.curves.get("elapsed_s", {})
    if step == 0:
        return 0.0 if elapsed else None
    return elapsed[step - 1][1] if step - 1 in elapsed else None


def points(run, curve, x_axis, values=None, seconds_per_unit=1):
    """
    The (x, y) lists of a run's curve, x being the step, the tokens, or the training time in seconds_per_unit; y its
    values, or values (one per point, in step order, e.g. a running mean). Points without that x are left out.
    """
    steps = sorted(run.curves[curve])
    ys = [run.curves[curve][step][1] for step in steps] if values is None else values
    if x_axis == "step":
        xs = steps
    elif x_axis == "tokens":
        xs = [run.curves[curve][step][0] for step in steps]
    else:
        xs = [seconds_before(run, step) for step in steps]
        xs = [None if x is None else x / seconds_per_unit for x in xs]
    kept = [(x, y) for x, y in zip(xs, ys) if x is not None]
    return [x for x, _ in kept], [y for _, y in kept]


def running_mean(values, window):
    """Each value's mean with its neighbours: window values centred on it, fewer at the ends (those there are)."""
    sums, half = list(itertools.accumulate(values, initial=0)), window // 2
    spans = [(max(i - half, 0), min(i + half + 1, len(values))) for i in range(len(values))]
    return [(sums[end] - sums[start]) / (end - start) for start, end in spans]


def smoothing_window(count):
    """The running mean's width for count train losses: 2% of them, odd so that it is centred (1: no smoothing)."""
    return max(1, int(SMOOTHING_FRACTION * count)) | 1


def loss_axis_limits(runs_curves, reference):
    """
    The loss axis' (bottom, top) for the curves of the runs drawn, or None for no loss points. The losses of the
    first steps (~11 at init, falling fast) would squeeze the rest of the run into the bottom of the panel, so the
    range is that of each run's losses after its first 5% of steps: the 900-step CPU default, falling to ~5.1, shows
    ~6.7 and below, a 19073-step GPU run falling to ~3.1 shows ~4 and below. The top is their 99th percentile, not
    their maximum, so that a late loss spike does not undo the cut. The reference line is always in view.
    """
    kept = []
    for curves in runs_curves:
        losses = [(step, value) for name in ("train_loss", "val_loss") for step, (_, value) in curves[name].items()]
        if losses:
            first_kept = SKIP_FRACTION * max(step for step, _ in losses)
            kept += [value for step, value in losses if step >= first_kept]
    if not kept:
        return None
    kept.sort()
    bottom, top = kept[0], kept[int(0.99 * (len(kept) - 1))]
    if reference is not None:
        bottom, top = min(bottom, reference), max(top, reference)
    margin = 0.05 * max(top - bottom, 0.1)  # as matplotlib's own: no point on the edge, a flat curve gets a range
    return bottom - margin, top + margin


def above_axis_note(runs, top):
    """The loss points above the axis' top, in words, a line per run: e.g. 'val loss 10.84 at step 0, train loss at
    50 steps (up to 10.95)'; None when there are none."""
    lines = []
    for run in runs:
        parts = []
        for curve in ("val_loss", "train_loss"):
            above = sorted((step, value) for step, (_, value) in run.curves[curve].items() if value > top)
            if len(above) == 1:
                parts.append(f"{LABELS[curve]} {above[0][1]:.2f} at step {above[0][0]}")
            elif above:
                parts.append(f"{LABELS[curve]} at {len(above)} steps (up to {max(v for _, v in above):.2f})")
        if parts:
            lines.append(("" if len(runs) == 1 else f"{display_name(run)}: ") + ", ".join(parts))
    return None if not lines else "▲ above the axis:" + (" " if len(runs) == 1 else "\n") + "\n".join(lines)


def tokens_label(count):
    """A token count as people say it, to 3 significant digits: 200000 -> 200K, 1.5e9 -> 1.5B, 0 -> 0."""
    count = float(f"{count:.3g}")  # first, so that 999999 reads 1M, not 1e+03K
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(count) >= scale:
            return f"{count / scale:g}{suffix}"
    return f"{count:g}"


def time_unit(seconds):
    """(seconds per unit, its name) for times up to seconds: hours past 2 hours, minutes past 2 minutes."""
    return next(((size, name) for size, name in ((3600, "h"), (60, "min")) if seconds >= 2 * size), (1, "s"))


def batches(runs):
    """The tokens a step that the runs' points say (tokens = step * batch): one batch for runs that all train the
    same, whose tokens axis is then their step axis scaled; none if no point has tokens past step 0."""
    return {tokens / step for run in runs for curve in CURVES for step, (tokens, _) in run.curves[curve].items()
            if step and tokens is not None}


def display_name(run):
    return run.name + (f" (recipe {run.recipe})" if run.recipe else "")


def run_names(log_dirs):
    """Each run's name in titles and legends: its directory's own name, or the path given where two share it."""
    names = [os.path.basename(os.path.abspath(log_dir)) for log_dir in log_dirs]
    return [name if names.count(name) == 1 else os.path.normpath(log_dir) for name, log_dir in zip(names, log_dirs)]


def title(runs, unit):
    """One run: its name and recipe, and its last point's step, tokens and training time. Several: their names and
    recipes."""
    if len(runs) > 1:
        return " vs ".join(display_name(run) for run in runs)
    run = runs[0]
    last = max(step for curve in CURVES for step in run.curves[curve])
    extent = [f"{last} steps"]
    tokens = [run.curves[curve][last][0] for curve in CURVES if last in run.curves[curve]]
    if any(count is not None for count in tokens):
        extent.append(f"{tokens_label(max(count for count in tokens if count is not None))} tokens")
    seconds = seconds_before(run, last)
    if seconds is not None:
        extent.append(f"{seconds / unit[0]:.3g} {unit[1]}")
    return f"{display_name(run)}: {', '.join(extent)}"


def styles(runs, index):
    """{curve: (colour, label)} for runs[index]: one run gets a colour per curve; several, a colour per run, and
    labels that name the run."""
    if len(runs) == 1:
        colors = {"train_loss": "C0", "val_loss": "C1", "hellaswag_acc_norm": "green", "core": "C9"}
        return {curve: (colors[curve], LABELS[curve]) for curve in CURVES}
    color = RUN_COLORS[index % len(RUN_COLORS)]
    return {curve: (color, f"{display_name(runs[index])}: {LABELS[curve]}") for curve in CURVES}


def draw_losses(ax, runs, x_axis, gpt2, top, seconds_per_unit):
    for index, run in enumerate(runs):
        style = styles(runs, index)
        (train_color, train_label), (val_color, val_label) = style["train_loss"], style["val_loss"]
        losses = [value for _, (_, value) in sorted(run.curves["train_loss"].items())]
        window = smoothing_window(len(losses))
        faint = {"lw": 0.6, "alpha": 0.3} if window > 1 else {"lw": 1}  # behind its running mean, or alone
        ax.plot(*points(run, "train_loss", x_axis, None, seconds_per_unit), color=train_color, label=train_label,
                **faint)
        if window > 1:
            ax.plot(*points(run, "train_loss", x_axis, running_mean(losses, window), seconds_per_unit),
                    color=train_color, lw=1.5, label=f"{train_label}, mean of {window} steps")
        xs, ys = points(run, "val_loss", x_axis, None, seconds_per_unit)
        ax.plot(xs, ys, color=val_color, lw=2, marker=".", ms=8, ls="-" if len(runs) == 1 else "--", label=val_label)
        above = [x for x, y in zip(xs, ys) if top is not None and y > top]
        if above:  # on the top edge, where the points left the panel (unclipped: an empty line would stretch layout)
            ax.plot(above, [top] * len(above), ls="", marker="^", ms=9, color=val_color, clip_on=False,
                    label="_above the axis")
    if "val_loss" in gpt2:
        ax.axhline(gpt2["val_loss"], color="red", ls="--", label=f"OpenAI GPT-2 124M val loss ({gpt2['val_loss']:.4f})")


def draw_benchmark(ax, runs, curve, x_axis, gpt2, seconds_per_unit):
    """A benchmark's row (curve: HellaSwag's acc_norm, or CORE): each run's points, and its REFERENCES."""
    for index, run in enumerate(runs):
        color, label = styles(runs, index)[curve]
        ax.plot(*points(run, curve, x_axis, None, seconds_per_unit), lw=2, marker=".", color=color, label=label)
    for (model, value, source), color in zip(REFERENCES[curve], ("red", "purple")):
        if model == "OpenAI GPT-2 124M" and curve in gpt2:
            value, source = gpt2[curve], "measured"
        ax.axhline(value, color=color, ls="--", label=f"{model} {LABELS[curve]}, {source} ({value:.4g})")


def plot_runs(runs, x_axes=("step",)):
    """
    The figure: a loss row, a row for HellaSwag and one for CORE when a run has their points, and a column per x
    axis; the tokens along the top of the step column where the runs all train one batch. Runs compared share the
    panels (and so their axes), each in its colour, and one legend below them. GPT-2's measured values come from the
    first log that has them.
    """
    benchmarks = [curve for curve in BENCHMARKS if any(run.curves[curve] for run in runs)]  # none by CPU default
    rows = 1 + len(benchmarks)
    # one column is wider than a column of several: the legend below spans it
    fig, axes = plt.subplots(rows, len(x_axes), figsize=(max(7 * len(x_axes), 10), 4.5 * rows), sharex="col",
                             sharey="row", squeeze=False, layout="constrained")
    gpt2 = {curve: value for run in reversed(runs) for curve, value in run.gpt2.items()}
    limits = loss_axis_limits([run.curves for run in runs], gpt2.get("val_loss"))
    top = None if limits is None else limits[1]
    unit = time_unit(max((s for run in runs for _, s in run.curves.get("elapsed_s", {}).values()), default=0))
    found = batches(runs)
    batch = found.pop() if len(found) == 1 else None  # None: no tokens axis over the steps
    for column, x_axis in enumerate(x_axes):
        if x_axis == "step" and batch:  # along the top of the figure
            tokens_axis = axes[0][column].secondary_xaxis("top", functions=(lambda s: s * batch, lambda t: t / batch))
            tokens_axis.set_xlabel("tokens")
            tokens_axis.xaxis.set_major_formatter(lambda x, _: tokens_label(x))
        draw_losses(axes[0][column], runs, x_axis, gpt2, top, unit[0] if x_axis == "time" else 1)
        for row, curve in enumerate(benchmarks, start=1):
            draw_benchmark(axes[row][column], runs, curve, x_axis, gpt2, unit[0] if x_axis == "time" else 1)
        for ax, y_label in zip([row[column] for row in axes], ["loss", *(LABELS[curve] for curve in benchmarks)]):
            ax.set_xlabel(f"training time ({unit[1]})" if x_axis == "time" else x_axis)
            ax.set_ylabel(y_label)
            ax.grid(alpha=0.3)
            if x_axis == "tokens":
                ax.xaxis.set_major_formatter(lambda x, _: tokens_label(x))
    if limits is not None:
        axes[0][0].set_ylim(*limits)  # the row shares its y axis: every loss panel
        note = above_axis_note(runs, top)
        if note:  # above the panel, where it covers no curve
            axes[0][0].set_title(note, loc="left", fontsize=9)
    handles = {}  # one legend for every panel: the first column holds every curve
    for ax in [row[0] for row in axes]:
        handles.update((line.get_label(), line) for line in ax.get_lines() if not line.get_label().startswith("_"))
    columns = legend_columns(runs, list(handles), 4 if len(x_axes) > 1 else 3)  # as many as the width holds
    blank = matplotlib.lines.Line2D([], [], alpha=0)
    labels = [label for column in columns for label in column]
    fig.legend([handles.get(label, blank) for label in labels], labels, loc="outside lower center",
               ncols=len(columns), fontsize=9)
    fig.suptitle(title(runs, unit))
    return fig


def legend_columns(runs, labels, most=4):
    """The legend's columns of labels: one run's, up to `most` columns; several runs', a column per run and one for
    the reference lines, padded with blank labels so that each column holds one run (the legend fills column by
    column)."""
    if len(runs) == 1:
        columns = min(len(labels), most)
        depth = -(-len(labels) // columns)
        return [labels[i * depth:(i + 1) * depth] for i in range(columns)]
    columns = [[label for label in labels if label.startswith(f"{display_name(run)}: ")] for run in runs]
    columns.append([label for label in labels if not any(label in column for column in columns)])
    depth = max(len(column) for column in columns)
    return [column + [""] * (depth - len(column)) for column in columns if column]


def read_runs(log_dirs, recipes):
    """A Run per log directory (named by run_names), its recipe from the log or else from --recipe (which may not
    contradict the log); prints a warning for a log's lines that are not records."""
    if recipes and len(recipes) != len(log_dirs):
        raise UsageError(f"--recipe given {len(recipes)} time(s) for {len(log_dirs)} log dir(s): once per LOG_DIR")
    runs = []
    for log_dir, recipe, name in zip(log_dirs, recipes or [None] * len(log_dirs), run_names(log_dirs)):
        log_path = os.path.join(log_dir, "log.jsonl")
        if not os.path.isfile(log_path):
            raise UsageError(f"{log_path} not found: pass the --log-dir of a train_gpt2.py run")
        run = read_log(log_path, name)
        if run.bad_lines:
            numbers = ", ".join(map(str, run.bad_lines[:5])) + ", ..." * (len(run.bad_lines) > 5)
            print(f"warning: skipped {len(run.bad_lines)} line(s) of {log_path} that are not log records (line "
                  f"{numbers})")
        if not any(run.curves[curve] for curve in CURVES):
            raise UsageError(f"{log_path} has no {', '.join(CURVES[:-1])} or {CURVES[-1]} lines to plot")
        if recipe and run.recipe and recipe != run.recipe:
            raise UsageError(f"--recipe {recipe}, but {log_path} says the run's recipe is {run.recipe}")
        runs.append(run._replace(recipe=run.recipe or recipe))
    return runs


def chosen_x_axes(x, runs):
    """The columns' x axes: --x's, else step (tokens along its top), tokens where the runs' batches differ, and time
    when a log records it."""
    timed = [run for run in runs if run.curves["elapsed_s"]]
    if x is None:
        return ("step",) + ("tokens",) * (len(batches(runs)) > 1) + ("time",) * bool(timed)
    x_axes = tuple(x.split(","))
    if not x_axes or not set(x_axes) <= set(X_AXES):
        raise UsageError(f"--x {x}: a comma-separated list of {', '.join(X_AXES)}")
    if "time" in x_axes and not timed:
        raise UsageError("--x time: no log has training times (elapsed_s in its step lines; older logs lack them)")
    return x_axes


def default_out(log_dirs):
    """Where the picture goes without --out: beside the run's log, or for several runs, compare.png here."""
    return os.path.join(log_dirs[0], "curves.png") if len(log_dirs) == 1 else "compare.png"


def main(argv=None):
    parser = argparse.ArgumentParser(description="Plot the loss, HellaSwag and CORE curves of train_gpt2.py runs.")
    parser.add_argument("log_dirs", nargs="*", default=["log"], metavar="LOG_DIR",
                        help="a run's --log-dir, holding log.jsonl (default: log); several: drawn on the same axes")
    parser.add_argument("--out", help="the PNG to write (default: LOG_DIR/curves.png; for several runs, compare.png)")
    parser.add_argument("--x", help="the columns: some of step,tokens,time (default: step, with tokens along its top "
                                    "or, where runs' batches differ, in a column of their own, and time when a log "
                                    "has the training times)")
    parser.add_argument("--recipe", action="append", help="the recipe of a run whose log does not name it (gpt2, "
                                                          "modern): once per LOG_DIR, in their order")
    args = parser.parse_args(argv)
    if plt is None:
        print("error: plot.py needs matplotlib, which is not installed: pip install matplotlib", file=sys.stderr)
        sys.exit(2)
    try:
        runs = read_runs(args.log_dirs, args.recipe)
        x_axes = chosen_x_axes(args.x, runs)
        out_path = args.out or default_out(args.log_dirs)
        out_dir = os.path.dirname(out_path) or "."
        fig = plot_runs(runs, x_axes)
        # whoever is looking at the picture never sees half of it, nor a temp file left over
        write_atomically(out_path, lambda f: fig.savefig(f, format="png", dpi=100), f"{out_path}.{os.getpid()}.tmp",
                         lambda: f"make room in {out_dir}")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        print(f"error: cannot write {out_path} ({e}); check that {out_dir} is writable and has space", file=sys.stderr)
        sys.exit(2)
    counts = [", ".join(f"{len(run.curves[curve])} {curve}" for curve in CURVES) for run in runs]
    if len(runs) > 1:
        counts = ["; ".join(f"{run.name}: {run_counts}" for run, run_counts in zip(runs, counts))]
    gpt2 = {curve: value for run in reversed(runs) for curve, value in run.gpt2.items()}
    references = "".join(f", GPT-2 {curve} {value:.4f}" for curve, value in gpt2.items())
    print(f"wrote {out_path} ({counts[0]}{references})")


if __name__ == "__main__":
    main()
