"""
A training run of train_gpt2.py, and the only code that changes where it stands. Its parts (the settings, the data,
the model, the optimizers, ...) are what train_gpt2.set_up made; its state (the step, the latest evaluation, a streak
of non-finite steps, the clock, a stop signal) is written here alone, and by resume.restore from a checkpoint.

The training loop (train_gpt2.train) calls it around the lecture's step: before_step (is there a step to take; a
checkpoint due), read_step (the step's batches, voted on by every rank), after_step (the log line, the step counted, a
stop signal voted on, the end saved) and finish (the last checkpoint, and how the run ended); and its evaluations run
inside evaluating (a stop signal ends them). What keeps a run safe happens there: checkpoints saved and pruned, a
signal or bad data that ends the run at the same step on every rank, a run that diverges stopped, weights that are not
finite never saved. It never imports train_gpt2.
"""

import contextlib
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

from machinery import checkpoints, files, microbatch, ranks, resume, run_log, settings, signals
from machinery.checkpoints import checkpoint_path, latest_checkpoint
from machinery.errors import DataError, UsageError


class StopVoted(Exception):
    """Every rank voted to stop on a signal, before a forward pass of an evaluation (Run.evaluating)."""


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
    log: run_log.RunLog
    micro_batch: int = 0  # sequences per forward pass: --batch-size, or less if that did not fit (microbatch.py);
    # until it is chosen, the one the resumed checkpoint trained with (0: none, or not kept)
    step: int = 0  # optimizer steps taken
    evaluated: bool = False  # the evaluations due at step are done
    val_loss: Optional[float] = None  # the latest
    val_step: Optional[int] = None  # the step val_loss was measured at
    nonfinite_since: Optional[int] = None  # the first of the latest steps in a row with a non-finite loss
    resumed_from: Optional[str] = None  # the checkpoint's path
    seconds_before: float = 0.0  # the training time of the launches before this one, as its checkpoint kept it
    first_step: int = 0  # the step this launch began at
    saved_step: Optional[int] = None  # the step of the latest checkpoint this launch wrote or resumed from
    saved_evaluated: bool = False  # whether that checkpoint holds its step's evaluations
    caught_signals: Optional[list] = None  # the stop signals caught so far (signals.record_stop_signals)
    descriptors: Optional[files.DescriptorReserve] = None  # kept for saving (checkpoints.ready_to_save)
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
    # Setting out (train_gpt2.set_up calls these in this order)

    def choose_micro_batch(self, gradient_sync):
        """Sets the micro-batch that fits (microbatch.largest_that_fits), which it compares with the one the resumed
        checkpoint trained with (as restore set it), and returns the lines that say how it was chosen (or None)."""
        self.micro_batch, said = microbatch.largest_that_fits(self, gradient_sync, self.micro_batch or None)
        return said

    def catch_stop_signals(self):
        """From here on, SIGTERM and SIGINT end the run after its step, with a checkpoint (--eval-only catches none).
        Caught before every rank waits for rank 0 to move an old run aside: a signal then stops the run at its first
        step, or at once where it comes in rank 0's wait for a reader (move_old_run_aside), never with a traceback."""
        self.caught_signals = None if self.cfg.eval_only else signals.record_stop_signals()

    def start_training(self):
        """Notes where this launch starts (its first step, the checkpoint it resumed from), takes what a save needs
        (checkpoints.ready_to_save), and starts the launch's clock."""
        self.first_step, self.saved_step = self.step, self.resumed_from and self.step
        self.saved_evaluated = self.evaluated  # the resumed checkpoint's, as restore set it
        self.descriptors = checkpoints.ready_to_save(self.cfg)
        self.launch_start = time.perf_counter()

    # -------------------------------------------------------------------------
    # Evaluations

    def evaluations_due(self):
        """Whether the validation loss (with samples) is due at this step, and the benchmarks that are, of those on."""
        cfg, step = self.cfg, self.step
        final = cfg.eval_only or step == cfg.max_steps
        return (final or (cfg.eval_every > 0 and step % cfg.eval_every == 0),
                [module for module in self.benchmarks if final or step % getattr(cfg, module.EVERY) == 0])

    def begin_evaluation(self, due):
        """Whether to run the evaluations due (due: whether any is) at this step: not twice, and not once a stop
        signal is voted for first (a preempted run saves before a long evaluation, as SIGKILL follows soon)."""
        if self.evaluated or self.stopped:
            return False
        if due:
            self.stopped = ranks.any_rank(bool(self.caught_signals), self.env.device)
            if self.stopped:
                return False
        self.evaluated = True  # also when none was due: nothing is left to evaluate at this step
        return due

    @contextlib.contextmanager
    def evaluating(self):
        """While inside (the evaluations of a step), every rank votes on a stop signal before each forward pass of
        the model that evaluates (self.compiled; each rank runs as many): one ends the evaluations there, left for the
        resumed run. The final ones (HellaSwag, CORE) take minutes, longer than a cluster's grace period between
        SIGTERM and SIGKILL."""
        if self.caught_signals is None:  # --eval-only catches no signal
            yield
            return

        def vote(module, args):
            if ranks.any_rank(bool(self.caught_signals), self.env.device):
                raise StopVoted

        hook = self.compiled.register_forward_pre_hook(vote, prepend=True)  # before FSDP's, which gathers weights
        try:
            yield
        except StopVoted:
            self.stopped, self.evaluated = True, False
        finally:
            hook.remove()

    def validated(self, loss):
        """Records the validation loss of this step's weights, and logs it."""
        self.val_loss, self.val_step = loss, self.step
        run_log.log_evaluation(self, {"val_loss": loss}, f"val loss {loss:.4f}")

    # -------------------------------------------------------------------------
    # The calls of the training loop

    def before_step(self):
        """Whether to take a step: none at --max-steps, nor once a stop signal is voted for. Saves the checkpoint
        due first, unless the steps are non-finite (their weights may be why): then once they are finite again."""
        if self.stopped or self.step >= self.cfg.max_steps:
            return False
        if self.save_due() and self.nonfinite_since is None:
            self.save()
        self.step_start = time.perf_counter()
        return True

    def read_step(self):
        """This rank's micro-batches of the step (TokenStream.next_step). The ranks vote on their reads, a flag
        all-reduced: a shard that one rank alone cannot read (its node's I/O error, its open-file limit) stops every
        rank here with that rank's line, rather than leaving the others waiting in the step's all-reduce."""
        cfg, env, stream = self.cfg, self.env, self.stream
        position, error = (stream.epoch, stream.index, stream.offset), None
        try:
            batches = stream.next_step(self.micro_batch, cfg.seq_len, self.accumulation_steps, env.rank,
                                       env.world_size, cfg.vocab_size)
        except DataError as e:
            error = str(e)
        if ranks.any_rank(error is not None, env.device):
            stream.epoch, stream.index, stream.offset = position  # where the ranks that read it were: it is not taken
            errors = ranks.every_rank(error)
            failed = [rank for rank, line in enumerate(errors) if line is not None]
            raise DataError(("" if len(failed) == len(errors) else f"rank {failed[0]}: ") + errors[failed[0]])
        return batches

    def save_due(self):
        """Whether a checkpoint fell due (every --checkpoint-every steps) since this launch's last one, or its start."""
        every, last = self.cfg.checkpoint_every, self.first_step if self.saved_step is None else self.saved_step
        return every > 0 and self.step > self.first_step and self.step // every > last // every

    def after_step(self, result):
        """Logs the step just taken (train_gpt2.StepResult), counts it, stops a run whose steps stay non-finite,
        votes with every rank on a stop signal that came during it, and saves the end before its evaluations."""
        if self.env.device_type == "cuda":
            torch.cuda.synchronize()  # the optimizer's kernels belong to this step's time
        now = time.perf_counter()
        if result.finite:
            self.nonfinite_since = None
            if self.saved_step == self.step:  # the newest checkpoint's weights trained to a finite loss
                self.prune()
        elif self.nonfinite_since is None:
            self.nonfinite_since = self.step
        left = None
        if self.pace_from is None:  # the pace is measured from the end of this launch's first step, which compiles
            self.pace_from = now, self.step
        elif self.step + 1 < self.cfg.max_steps:  # evaluations and checkpoints included, as they will come again
            left = (now - self.pace_from[0]) / (self.step - self.pace_from[1]) * (self.cfg.max_steps - self.step - 1)
        run_log.log_step(self, result, self.optimizers[0].param_groups[0]["lr"], now - self.step_start, left)
        self.stop_if_diverging()
        self.step, self.evaluated = self.step + 1, False
        self.stopped = ranks.any_rank(bool(self.caught_signals), self.env.device)
        if self.step == self.cfg.max_steps:  # the final evaluations can outlast a preemption's grace period
            self.save_where_it_stops()

    def stop_if_diverging(self):
        """After --max-bad-steps non-finite steps in a row, stops the run, saying what to do (go_back)."""
        in_a_row = 0 if self.nonfinite_since is None else self.step - self.nonfinite_since + 1
        if in_a_row >= self.cfg.max_bad_steps:
            raise UsageError(f"{in_a_row} steps in a row had a non-finite loss or gradient norm (last: step "
                             f"{self.step}); stopping. {self.go_back()}")

    def go_back(self):
        """What to do about steps gone non-finite, in words: lower the recipe's learning rates, and resume from the
        latest checkpoint from before them, as the weights that made them non-finite came later."""
        rate_flags = self.recipe.rate_flags()
        good = latest_checkpoint(self.cfg.log_dir, before_step=self.nonfinite_since)
        later = good != latest_checkpoint(self.cfg.log_dir)
        resume = (f"resume from {good}" + (f" (--resume {good}: the later checkpoints hold the weights that went "
                                           f"non-finite)" if later else "")) if good else "start again"
        return f"Lower the learning rate{'s' if len(rate_flags) > 1 else ''} ({', '.join(rate_flags)}) and {resume}"

    def finish(self):
        """Saves where the run ended (the end, evaluated since it was saved, or where a signal stopped it) and says
        how it ended; a UsageError instead where its weights are not finite (save_if_moved)."""
        self.save_where_it_stops()
        run_log.finish(self, self.stopped)

    # -------------------------------------------------------------------------
    # Checkpoints

    def save(self):
        with self.descriptors.released():  # for the files it writes, also at the open-file limit
            checkpoints.save(self)
        self.saved_step, self.saved_evaluated = self.step, self.evaluated

    def prune(self):
        with self.descriptors.released():
            checkpoints.prune(self)

    def unsaved(self):
        """Whether the run moved on since its latest checkpoint (this launch's, or the one it resumed from): a step,
        or the evaluations of the step saved (or every later start would do them again). A fresh start that took no
        step has nothing to save."""
        if self.saved_step is None:
            return self.step > self.first_step
        return self.step != self.saved_step or (self.evaluated and not self.saved_evaluated)

    def weights_finite(self):
        """Whether every parameter is finite, on every rank (under FSDP each holds slices of them)."""
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]
        finite = bool(torch.stack([torch.isfinite(p).all() for p in local]).all())
        return not ranks.any_rank(not finite, self.env.device)

    def save_if_moved(self):
        """Saves the run where it stands if it moved on since its latest checkpoint, and says whether it did. After
        non-finite steps (their updates skipped, which leaves the weights as the last finite step made them) only if
        every weight is finite: if not, a UsageError says so and what to do, as nothing trustworthy is left to save."""
        if not self.unsaved():
            return False
        if self.nonfinite_since is not None and not self.weights_finite():
            raise UsageError(f"the run is not saved at step {self.step}: its weights are not finite (the steps since "
                             f"{self.nonfinite_since} were non-finite, their updates skipped). "
                             f"{self.go_back()}")
        self.save()
        return True

    def save_where_it_stops(self):
        """Saves where the run stops (save_if_moved); after a finite step, prunes past --keep-checkpoints."""
        if self.save_if_moved() and self.nonfinite_since is None:
            self.prune()

    @contextlib.contextmanager
    def errors_in_one_line(self):
        """While the run trains or evaluates, its errors end in one line, every rank's: a shard gone bad (after saving
        the run), running out of memory, a rank that died. The descriptors kept for saving are let go after."""
        with contextlib.closing(self.descriptors), ranks.failing_alone(lambda: resume.how_to_resume(self.cfg)), \
                microbatch.out_of_memory_in_one_line(self.cfg, self), self.saved_if_data_fails():
            yield

    @contextlib.contextmanager
    def saved_if_data_fails(self):
        """A shard that turns bad as the stream reaches it (errors.DataError, raised on every rank at once by
        read_step) ends the run after saving it where it stands, before the step (save_if_moved); its line then says
        how to go on, or names both causes where the save fails too (a full disk, weights that are not finite)."""
        try:
            yield
        except DataError as e:
            try:
                saved = self.save_if_moved()
            except UsageError as failed:
                raise DataError(f"{e}; saving the run failed too: {failed}") from None
            # the checkpoint is named by its step, or as rank 0 lists it: a rank out of file descriptors cannot
            if saved:
                raise DataError(f"{e}; the run is saved at step {self.step}: once that is mended, "
                                f"{settings.resume_command(self.cfg)} resumes from "
                                f"{checkpoint_path(self.cfg.log_dir, self.step, self.cfg.fsdp)}") from None
            how = ranks.every_rank(resume.how_to_resume(self.cfg) if self.master else None)[0]
            raise DataError(f"{e}; once that is mended: {how}") from None
