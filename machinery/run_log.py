"""
What a run of train_gpt2.py says and records: its first lines (what it runs, the model, the data), each record's line
in log.jsonl and W&B (run_log.RunLog), MFU, and how the run ended. Only rank 0 prints and writes. It never imports
train_gpt2: the run is handed over.
"""

import contextlib
import functools
import json
import math
import os
import shlex
import sys
import time
from dataclasses import asdict

import torch
import torch.nn as nn

from machinery import checkpoints, files, settings
from machinery.checkpoints import latest_checkpoint
from machinery.errors import UsageError
from machinery.ranks import failing_together
from machinery.tokenizer import GPT2_VOCAB

LOG_FILE = "log.jsonl"  # the run's record (RunLog), in its log directory


def report(run, record, line=None):
    """Prints line, then appends record to log.jsonl and the W&B run, on rank 0: a result reaches the terminal even if
    its record cannot be written (a full disk)."""
    if run.master:
        if line:
            print(line, flush=True)
        run.log.write(record)


def log_evaluation(run, results, line):
    """One line and one log.jsonl record for an evaluation at run.step: with --eval-only, marked as such and with
    what was evaluated, as such lines may sit in the log of the run they evaluate."""
    cfg, step = run.cfg, run.step
    extra = {"eval_only": True, "init_from": run.resumed_from or cfg.init_from} if cfg.eval_only else {}
    report(run, {"step": step, "tokens": step * cfg.total_batch_size, **results, **extra}, f"step {step:5d} | {line}")


def log_step(run, result, lr, dt, seconds_left):
    """One line and one log.jsonl record for the step just taken: the step out of the total, and the time left
    (seconds_left, None where not known yet); the record keeps the run's training time so far (elapsed_s), across its
    launches."""
    cfg, env, step = run.cfg, run.env, run.step
    tok_per_sec = cfg.total_batch_size / dt
    record = {"step": step, "tokens": (step + 1) * cfg.total_batch_size,
              "train_loss": result.loss if result.finite else None, "lr": lr, "grad_norm": result.grad_norm,
              "dt_ms": dt * 1000, "tok_per_sec": tok_per_sec, "elapsed_s": run.seconds_trained()}
    line = (f"step {step:5d}/{cfg.max_steps} | loss {result.loss:.6f} | lr {lr:.4e} | norm {result.grad_norm:.4f} | "
            f"{dt * 1000:.1f} ms | {tok_per_sec:,.0f} tok/s")
    mfu = model_flops_utilization(run.model, cfg.seq_len, tok_per_sec, env)
    if mfu is not None:
        record["mfu"] = mfu
        line += f" | mfu {100 * mfu:.1f}%"
    if env.device_type == "cuda":
        record["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    if not result.finite:
        record["skipped"] = True
        line += f" | non-finite: update skipped ({step - run.nonfinite_since + 1} in a row)"
    elif not math.isfinite(result.grad_norm):  # fp16 gradients overflowed: the scaler skipped the update
        record["skipped"] = True
    if seconds_left is not None:
        line += f" | {duration(seconds_left)} left"
    report(run, record, line)


def duration(seconds):
    """seconds in words a glance reads: 45s, 12m 05s, 3h 20m, 2d 04h."""
    seconds = round(seconds)
    for unit, size, smaller, smaller_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if seconds >= size:
            return f"{seconds // size}{unit} {seconds % size // smaller_size:02d}{smaller}"
    return f"{seconds}s"


def what_runs(run):
    """What this run does, in words: the first line it prints."""
    cfg = run.cfg
    if cfg.eval_only:
        if run.resumed_from:
            return f"evaluating {run.resumed_from} (step {run.step})"
        if cfg.init_from != "scratch":
            return f"evaluating {settings.pretrained_in_words(cfg.init_from)}"
        return "evaluating the initial model: random weights (no checkpoint in --log-dir)"
    if run.resumed_from:
        return f"resuming from the checkpoint of step {run.step} ({run.resumed_from}), training to step {cfg.max_steps}"
    start = ("training from scratch" if cfg.init_from == "scratch"
             else f"fine-tuning {settings.pretrained_in_words(cfg.init_from)}")
    return f"{start} for {cfg.max_steps} steps"


def first_lines(run, micro_batch_said):
    """Says what is being run (the model, with what its recipe adds, run.recipe.named; the data), and how its
    micro-batch was chosen (micro_batch_said: microbatch.largest_that_fits's line, if any)."""
    cfg, env = run.cfg, run.env
    if not run.master:
        return
    print(what_runs(run))
    padding = max(0, cfg.vocab_size - GPT2_VOCAB)
    padded = f" (and {padding} rows of vocabulary padding, never predicted)" if padding else ""
    named = f", {run.recipe.named}" if run.recipe.named else ""
    compiled = "on" if cfg.compile else "off"
    print(f"model: {cfg.n_layer} layers, {cfg.n_head} heads, width {cfg.n_embd}, {parameters(run.model) / 1e6:.2f}M "
          f"parameters{padded}{named} | {env.world_size} process(es) on {env.device_type}, {cfg.dtype}, "
          f"compile {compiled}")
    if cfg.eval_only:
        print(f"data: {cfg.data}, {len(run.val):,} validation tokens | micro-batch {run.micro_batch} x {cfg.seq_len}")
    else:
        train_tokens = sum(run.stream.lengths)
        print(f"data: {cfg.data}, {train_tokens:,} training tokens | batch {cfg.total_batch_size:,} tokens = "
              f"{run.micro_batch} x {cfg.seq_len} x {run.accumulation_steps} accumulation steps x {env.world_size} "
              f"process(es)")
    if micro_batch_said:
        print(micro_batch_said)


def sample_notes(model, prompt, recipe):
    """Whether a model can sample after prompt (token ids), and the lines that go before its samples: why there are
    none (a --vocab-size below GPT-2's cannot embed the prompt's tokens), or what to know of them. recipe: the words
    that name the model's recipe, for a head it starts at zero."""
    block_size = model.config.block_size
    if max(prompt) >= model.n_tokens:
        return False, [f"no samples: the prompt needs token ids up to {max(prompt)}, beyond this model's "
                       f"{model.n_tokens}"]
    notes = []
    if len(prompt) > block_size:
        notes.append(f"the prompt's {len(prompt)} tokens outgrow the block of {block_size}: each token is sampled "
                     f"from the last {block_size} before it")
    head = model.lm_head.weight  # under FSDP, this rank's rows of it
    if not (head.to_local() if hasattr(head, "to_local") else head).any():
        notes.append(f"(the output layer is all zeros, as {recipe} starts it: every token is as likely, and top-k "
                     "sampling keeps the first ids: punctuation, digits, capitals)")
    return True, notes


@contextlib.contextmanager
def wandb(run):
    """With --wandb-project, rank 0 logs log.jsonl's records to a W&B run as well while inside, from the launch's
    first (start_record, logged here: W&B gets it too), then ends it, failed if an error is on its way out. A resumed
    run continues the W&B run of its checkpoint; --eval-only gets one of its own (restore leaves it no id), as the
    training's may still be going on."""
    cfg = run.cfg
    try:
        if cfg.wandb_project:
            with failing_together():
                if run.master:
                    run.log.start_wandb(cfg.wandb_project, cfg.wandb_run_name, asdict(cfg))
        if not cfg.eval_only:
            report(run, start_record(run))
        yield
    finally:
        run.log.finish(failed=sys.exc_info()[0] is not None)  # in a finally, exc_info is the error on its way out


def parameters(model):
    """The model's parameters but the rows of a padded vocabulary (--vocab-size 50304), which no token uses: as OpenAI
    counts GPT-2 124M, and as an export of the same model counts them, whether it was trained padded or not."""
    padding = max(0, model.config.vocab_size - GPT2_VOCAB)
    return sum(p.numel() - (padding * p.size(1) if p.dim() == 2 and p.size(0) == model.config.vocab_size else 0)
               for p in model.parameters())


def start_record(run):
    """The first record of a launch, for plot.py and W&B: what runs; and a resume's, after which the points logged
    past its checkpoint are dropped, as they are trained again."""
    cfg, env = run.cfg, run.env
    return {"step": run.step, "event": "resume" if run.resumed_from else "start", "recipe": cfg.recipe,
            "max_steps": cfg.max_steps, "total_batch_size": cfg.total_batch_size, "micro_batch": run.micro_batch,
            "n_params": parameters(run.model), "world_size": env.world_size,
            "device": torch.cuda.get_device_name() if env.device_type == "cuda" else env.device_type}


def finish(run, stopped_by_signal):
    """Says how the run ended and what to do next. What it calls saved is what --log-dir's latest checkpoint holds,
    the step the run ended at, not what the run meant to save."""
    cfg = run.cfg
    if not run.master:
        return
    last = checkpoints.latest_checkpoint(cfg.log_dir)
    saved = last is not None and checkpoints.checkpoint_step(last) == run.step
    skipped = ""
    if saved and run.nonfinite_since is not None:
        skipped = f" ({skipped_in_words(run.nonfinite_since, run.step - 1)})"
    if stopped_by_signal and not saved:
        print("stopped by signal before the first step: nothing to save")
    elif stopped_by_signal:
        left = " (the last: only its final evaluation is left)" if run.step == cfg.max_steps else ""
        print(f"stopped by signal at step {run.step}{left}, checkpoint saved{skipped}; resume with "
              f"{settings.resume_command(cfg)} (it picks up {cfg.log_dir})")
    else:
        hint = f"; for more samples: {shlex.join(['python', 'train_gpt2.py', '--sample', last])}" if last else ""
        launch = f" ({duration(time.perf_counter() - run.launch_start)} in this launch)" if run.resumed_from else ""
        print(f"done: step {run.step}, val loss {run.val_loss:.4f}, trained for {duration(run.seconds_trained())}"
              f"{launch}{skipped}{hint}")


def skipped_in_words(first, last):
    """The last steps of a run, first to last, that were non-finite (their updates skipped), in words."""
    steps = f"step {first} was" if first == last else f"steps {first} to {last} were"
    return f"{steps} non-finite, skipped: the weights saved are step {first}'s"


# -----------------------------------------------------------------------------
# MFU: the model's FLOPs per second against the GPUs' peak


PEAK_FLOPS = {  # dense bf16/fp16 tensor-core peak, by a part of the GPU's name, for MFU
    "H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12, "A10G": 70e12, "L40S": 362e12,
    "L40": 181e12, "L4": 121e12, "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12, "T4": 65e12,
}


@functools.cache
def peak_flops(device_type):
    if device_type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((flops for part, flops in PEAK_FLOPS.items() if part in name), None)


def flops_per_token(model, seq_len):
    """6N for the matmuls' forward and backward, plus attention's 12*L*C*T (PaLM's appendix B). N counts every
    parameter but the embeddings that are only looked up: GPT-2's position table, or an untied token embedding
    (a tied one is the output layer's matmul)."""
    config = model.config
    lookups = sum(module.weight.numel() for module in model.modules()
                  if isinstance(module, nn.Embedding) and module.weight is not model.lm_head.weight)
    n_params = sum(p.numel() for p in model.parameters()) - lookups
    return 6 * n_params + 12 * config.n_layer * config.n_embd * seq_len


def model_flops_utilization(model, seq_len, tok_per_sec, env):
    """The model FLOPs utilization of all the processes' GPUs; None where their peak is unknown."""
    peak = peak_flops(env.device_type)
    return None if peak is None else flops_per_token(model, seq_len) * tok_per_sec / (peak * env.world_size)
def finite_only(record):
    """record with null for each NaN or infinity, which JSON has no words for (strict parsers, jq, refuse them)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


def check_settings(cfg, env):
    """Refuses --wandb-project in one line where the wandb package is missing: before the set-up, which takes time."""
    if cfg.wandb_project:
        import_wandb(cfg.wandb_project)


def import_wandb(project):
    """wandb, an optional dependency: imported only when --wandb-project asks for it."""
    try:
        import wandb
    except ImportError:
        raise UsageError(f"--wandb-project {project} needs the wandb package: pip install wandb "
                         f"(or leave out --wandb-project)") from None
    return wandb


class RunLog:
    """Rank 0's record of a run: lines appended to <log-dir>/log.jsonl (never truncated), and the same records in a
    W&B run with --wandb-project."""

    def __init__(self, log_dir):
        self.log_dir, self.path = log_dir, os.path.join(log_dir, LOG_FILE)
        self.wandb, self.wandb_step = None, 0
        self.wandb_id = None  # kept in the checkpoints: a resumed run continues the same W&B run

    def write(self, record):
        record = finite_only(record)
        files.append_line(self.path, json.dumps(record, allow_nan=False), lambda: (
            f"make room, then run the same command again: it resumes from "
            f"{latest_checkpoint(self.log_dir) or 'the start'}"))
        if self.wandb:
            self.wandb.log(record, step=self.wandb_step)
            self.wandb_step += 1

    def start_wandb(self, project, name, config):
        """Starts logging to W&B, under <log-dir>/wandb (where WANDB_MODE=offline leaves it, for `wandb sync`),
        continuing the W&B run of wandb_id if set."""
        wandb = import_wandb(project)
        try:
            self.wandb = wandb.init(project=project, name=name or None, id=self.wandb_id, resume="allow",
                                    dir=self.log_dir, config=config)
        except wandb.errors.Error as e:  # not logged in, no network, ...
            reason = str(e).strip().partition("\n")[0]  # its hints run over several lines
            raise UsageError(f"--wandb-project {project}: W&B cannot start the run ({reason}); log in with "
                             f"`wandb login`, or set WANDB_MODE=offline on a machine with no internet (and "
                             f"`wandb sync` later)") from None
        # W&B's step only goes up, but a resumed run logs the steps after its checkpoint again: W&B's step is the
        # record's line in log.jsonl, which only grows, across resumes and offline runs alike, and every chart's x-axis
        # is the training step, so a step trained again is drawn again rather than refused as a step back in time.
        with open(self.path, "a+") as f:
            f.seek(0)
            self.wandb_step = sum(1 for _ in f)
        self.wandb.define_metric("*", step_metric="step")
        self.wandb_id = self.wandb.id

    def finish(self, failed):
        """Ends the W&B run, if one started: failed, if an error stopped the run."""
        if self.wandb is not None:
            self.wandb.finish(exit_code=1 if failed else 0)
