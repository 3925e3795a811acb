"""
A training run of train_gpt2.py, and the only code that changes where it stands. Its parts (the settings, the data,
the model, the optimizers, ...) are what train_gpt2.set_up made; its state (the step, the latest evaluation, a streak
of non-finite steps, the clock, a stop signal) is written here alone, and by checkpoints.restore from a checkpoint.

The training loop (train_gpt2.train) calls it three times, around the lecture's step: before_step (is there a step to
take; a checkpoint due), after_step (the log line, the step counted, a stop signal voted on) and finish (the last
checkpoint, and how the run ended). What keeps a run safe happens there: checkpoints saved and pruned, a signal that
ends the run at the same step on every rank, a run that diverges stopped. It never imports train_gpt2.
"""

import contextlib
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

import checkpoints
import microbatch
import plumbing
import reporting
import run_files
import settings
from plumbing import DataError


@dataclass
class Run:
    """What a training run is made of, and where it stands: saved in its checkpoints."""
    cfg: object  # train_gpt2.TrainConfig, resolved
    env: object  # train_gpt2.Env: this process's rank and device
    recipe: settings.Recipe  # its model, optimizers and schedule
    stream: object  # train_gpt2.TokenStream: the training tokens
    val: np.ndarray  # the fixed validation tokens
    benchmarks: dict  # {hellaswag or core: its examples, read once (load_run)} of those on
    model: nn.Module  # its weights are what checkpoints save and samples come from
    compiled: nn.Module  # the model compiled, and in DDP under torchrun: what trains and evaluates
    optimizers: list
    scaler: torch.amp.GradScaler
    autocast_ctx: object
    log: run_files.RunLog
    micro_batch: int = 0  # sequences per forward pass: --batch-size, or less if that did not fit (microbatch.py)
    step: int = 0  # optimizer steps taken
    evaluated: bool = False  # the evaluations due at step are done
    val_loss: Optional[float] = None  # the latest
    val_step: Optional[int] = None  # the step val_loss was measured at
    nonfinite_since: Optional[int] = None  # the first of the latest steps in a row with a non-finite loss
    resumed_from: Optional[str] = None  # the checkpoint's path
    seconds_before: float = 0.0  # the training time of the launches before this one, as its checkpoint kept it
    first_step: int = 0  # the step this launch began at
    saved_step: Optional[int] = None  # the step of the latest checkpoint this launch wrote or resumed from
    stop_signal: Optional[list] = None  # the stop signals caught (checkpoints.catch_stop_signals)
    stopped: bool = False  # every rank voted to stop on a signal
    launch_start: Optional[float] = None  # when this launch began to train (time.perf_counter())
    step_start: Optional[float] = None  # when the step being taken began
    pace_from: Optional[tuple] = None  # (time, step) at the end of this launch's first step: the pace is since then

    @property
    def master(self):
        return self.env.rank == 0  # only rank 0 prints and writes files

    @property
    def accumulation_steps(self):  # micro-batches per optimizer step, in each process
        return self.cfg.total_batch_size // (self.micro_batch * self.cfg.seq_len * self.env.world_size)

    def seconds_trained(self):  # across its launches: the earlier ones' and this one's so far
        return self.seconds_before + time.perf_counter() - self.launch_start

    # -------------------------------------------------------------------------
    # Setting out

    def launch(self, gradient_sync, trained_with=None):
        """The micro-batch chosen (microbatch.largest_that_fits; trained_with: the resumed checkpoint's), the log
        directory readied and the run's first lines said; from here on a stop signal ends the run with a checkpoint,
        and the launch's clock runs."""
        self.micro_batch, said = microbatch.largest_that_fits(self, gradient_sync, trained_with)
        reporting.start(self, said, self.recipe.named)
        self.first_step, self.saved_step = self.step, self.resumed_from and self.step
        self.stop_signal = None if self.cfg.eval_only else checkpoints.catch_stop_signals()
        self.launch_start = time.perf_counter()

    # -------------------------------------------------------------------------
    # Evaluations

    def begin_evaluation(self, due):
        """Whether to run the evaluations due (due: whether any is) at this step: not twice, and not once a stop
        signal is voted for first (a preempted run saves before a long evaluation, as SIGKILL follows soon)."""
        if self.evaluated or self.stopped:
            return False
        if due:
            self.stopped = plumbing.any_rank(bool(self.stop_signal), self.env.device)
            if self.stopped:
                return False
        self.evaluated = True  # also when none was due: nothing is left to evaluate at this step
        return due

    def validated(self, loss):
        """Records the validation loss of this step's weights, and logs it."""
        self.val_loss, self.val_step = loss, self.step
        reporting.log_evaluation(self, {"val_loss": loss}, f"val loss {loss:.4f}")

    # -------------------------------------------------------------------------
    # The three calls of the training loop

    def before_step(self):
        """Whether to take a step: none at --max-steps, nor once a stop signal is voted for. Saves the checkpoint
        due first, unless the steps are non-finite (their weights may be why): then once they are finite again."""
        if self.stopped or self.step >= self.cfg.max_steps:
            return False
        if self.save_due() and self.nonfinite_since is None:
            self.save()
        self.step_start = time.perf_counter()
        return True

    def save_due(self):
        """Whether a checkpoint fell due (every --checkpoint-every steps) since this launch's last one, or its start."""
        every, last = self.cfg.checkpoint_every, self.first_step if self.saved_step is None else self.saved_step
        return every > 0 and self.step > self.first_step and self.step // every > last // every

    def after_step(self, result):
        """Logs the step just taken (train_gpt2.StepResult), counts it, stops a run whose steps stay non-finite, and
        votes with every rank on a stop signal that came during it."""
        if self.env.device_type == "cuda":
            torch.cuda.synchronize()  # the optimizer's kernels belong to this step's time
        now = time.perf_counter()
        if result.finite:
            self.nonfinite_since = None
            if self.saved_step == self.step:  # the newest checkpoint's weights trained to a finite loss
                checkpoints.prune(self)
        elif self.nonfinite_since is None:
            self.nonfinite_since = self.step
        left = None
        if self.pace_from is None:  # the pace is measured from the end of this launch's first step, which compiles
            self.pace_from = now, self.step
        elif self.step + 1 < self.cfg.max_steps:  # evaluations and checkpoints included, as they will come again
            left = (now - self.pace_from[0]) / (self.step - self.pace_from[1]) * (self.cfg.max_steps - self.step - 1)
        reporting.log_step(self, result, self.optimizers[0].param_groups[0]["lr"], now - self.step_start, left)
        checkpoints.stop_if_diverging(self, self.recipe.rate_flags())
        self.step, self.evaluated = self.step + 1, False
        self.stopped = plumbing.any_rank(bool(self.stop_signal), self.env.device)

    def finish(self):
        """Saves where the run ended (the end, or where a signal stopped it), unless its last steps were non-finite,
        and says how it ended."""
        # the end that a signal saved unevaluated is saved again once evaluated, or every later start would evaluate it
        if (self.step > self.first_step or (self.resumed_from and self.evaluated)) and self.nonfinite_since is None:
            self.save()
            checkpoints.prune(self)  # the run ended on a finite step
        reporting.finish(self, self.stopped)

    def save(self):
        checkpoints.save(self)
        self.saved_step = self.step

    @contextlib.contextmanager
    def running(self):
        """While the run trains or evaluates: its W&B run open (--wandb-project), and its errors ended in one line,
        every rank's: a shard gone bad (after saving the run), running out of memory, a rank that died."""
        with reporting.wandb(self), plumbing.failing_alone(lambda: checkpoints.how_to_resume(self.cfg)), \
                microbatch.out_of_memory_in_one_line(self.cfg, self), self.saved_if_data_fails():
            yield

    @contextlib.contextmanager
    def saved_if_data_fails(self):
        """A shard that turns bad as the stream reaches it (plumbing.DataError, raised on every rank alike, as each
        reads the whole global batch) ends the run after saving it where it stands, before the step, if steps were
        taken since its last checkpoint and they were finite; its line then says how to go on."""
        try:
            yield
        except DataError as e:
            if not (self.step > self.first_step and self.saved_step != self.step and self.nonfinite_since is None):
                raise DataError(f"{e}; once that is mended: {checkpoints.how_to_resume(self.cfg)}") from None
            self.save()
            raise DataError(f"{e}; the run is saved at step {self.step}: once that is mended, "
                            f"{settings.resume_command(self.cfg)} resumes from "
                            f"{run_files.latest_checkpoint(self.cfg.log_dir)}") from None
