"""
The micro-batch a run trains with, for train_gpt2.py: the largest, up to --batch-size, whose training step fits in
the device's memory. Before the first step, a forward and backward pass of B sequences is tried on every rank, with
room kept for the optimizers' state that the first step allocates; B is halved (to the next divisor of the batch) until
every rank's try fits. The ranks try with no gradient reduced, then vote, so that one rank's out-of-memory error never
leaves the others waiting in a collective. The accumulation steps rise to match: the optimizer step takes the same
--total-batch-size tokens (train_gpt2.TokenStream cuts any micro-batch out of the same stream), on the same schedule.
On a CPU, where a step larger than the machine's memory gets the process killed with no error to catch, the memory
model (step_memory.py) chooses first: the largest micro-batch whose estimated step fits in what the machine can give
(within_cpu_memory, memory.available). The tries then run in the heap mode the run keeps (memory.keep_freed_memory):
freed memory kept in the heap (faster) where there is room for it, or given back to the system, as under an
address-space limit.

With --grow-batch-size (on by default on CUDA), a B that fits at once goes up instead, to the next divisor of the batch
at least twice as large, while a try of it fits on every rank: fewer accumulation steps.

Also what a run says when an out-of-memory error (memory.out_of_memory_in) comes later. Such an error (an evaluation,
a fragmented allocator) is recorded in the log directory (RECORD), so that the next start with the same model on no
more memory chooses a smaller micro-batch, not the same one again. It never imports train_gpt2: the run
and the step's pieces are handed over.
"""

import contextlib
import dataclasses
import gc
import json
import os
import time

import torch

from machinery import checkpoints, files, memory, ranks, step_memory
from machinery.errors import UsageError

RECORD = "out_of_memory.json"  # in the log directory: the micro-batches that ran out of memory after they were chosen


def next_smaller(batch_size, sequences_per_step):
    """The largest micro-batch at most half of batch_size that cuts a rank's sequences_per_step exactly."""
    return max(b for b in range(1, batch_size // 2 + 1) if sequences_per_step % b == 0)


@contextlib.contextmanager
def optimizer_state_held(optimizers, device):
    """Inside, the optimizers' state as their first step allocates it on device, made by such a step at a learning
    rate of 0 (no weight moves), whatever the optimizer, and gone again after; where an optimizer has its state
    already (a resumed run), one more copy of its weights for the temporaries of its update."""
    fresh = [optimizer for optimizer in optimizers if not optimizer.state]
    rates = [[group["lr"] for group in optimizer.param_groups] for optimizer in fresh]
    held = sum(p.numel() * p.element_size() for optimizer in optimizers if optimizer.state
               for group in optimizer.param_groups for p in group["params"])
    try:
        for optimizer in fresh:
            for group in optimizer.param_groups:
                group["lr"] = 0.0
            optimizer.step()
        room = torch.empty(held, dtype=torch.uint8, device=device)
        yield
        del room
    finally:
        for optimizer, lrs in zip(fresh, rates):
            optimizer.state.clear()
            for group, lr in zip(optimizer.param_groups, lrs):
                group["lr"] = lr


def try_step(run, batch_size, gradient_sync):
    """A training step of batch_size sequences on this rank that changes nothing, with no gradient reduced
    (gradient_sync: train_gpt2's): its forward and backward passes; on a GPU, or under an address-space limit, then
    the optimizers' step (optimizer_state_held) and the passes again with its state held, as every later step holds
    it. For --eval-only, a forward pass."""
    cfg, env = run.cfg, run.env
    tokens = torch.zeros((batch_size, cfg.seq_len), dtype=torch.long, device=env.device)  # (B, T)
    if cfg.eval_only:
        with torch.no_grad(), run.autocast_ctx:
            run.compiled(tokens, tokens)
        return

    def forward_and_backward():
        with gradient_sync(run.compiled, on=env.world_size == 1):
            with run.autocast_ctx:
                _, loss = run.compiled(tokens, tokens)
            loss.backward()

    forward_and_backward()
    if env.device_type == "cpu" and not memory.address_space_limited():
        return  # only an allocation larger than the system grants fails there, and the first pass made the largest
    with optimizer_state_held(run.optimizers, env.device):
        for p in run.model.parameters():
            p.grad = None  # as the next step's zero_grad leaves them
        forward_and_backward()


def step_fits(run, batch_size, gradient_sync):
    """Whether try_step fits on this rank: only an out-of-memory error gives False. Its gradients are thrown away."""
    try:
        try_step(run, batch_size, gradient_sync)
        fits = True
    except Exception as e:  # any allocator's error: see memory.is_out_of_memory
        if not memory.is_out_of_memory(e):
            raise
        fits = False
    for p in run.model.parameters():
        p.grad = None  # a failed pass's
    return fits


def forget_try(run):
    """Frees what a try of a micro-batch that some rank could not fit holds on this rank: its traceback's frames
    (cycles), the graphs compiled for its shape (with CUDA graphs, a memory pool each), the allocator's cached
    blocks."""
    if run.cfg.compile:
        torch._dynamo.reset()
    gc.collect()
    if run.env.device_type == "cuda":
        torch.cuda.empty_cache()


def largest_that_fits(run, gradient_sync, trained_with=None):
    """The micro-batch to train with, and the lines that say how it was chosen (None when it is --batch-size, as
    given): --batch-size if a step of it fits on every rank, else the largest smaller one that does, and one below
    any that ran out of memory later before (RECORD), but 1, which is tried again. trained_with: the resumed
    checkpoint's, if it kept one. Raises UsageError if not even one sequence fits."""
    batch_size, said = search(run, gradient_sync)
    if run.env.device_type == "cuda":  # the peak the log reports is the training's, not a failed try's
        torch.cuda.reset_peak_memory_stats(run.env.device)
    if trained_with not in (None, batch_size) and not run.cfg.eval_only:
        said.append(f"the run trained with micro-batch {trained_with} before, {batch_size} now: the same tokens "
                    f"and schedule, their gradients summed in other parts (equal up to rounding)")
    return batch_size, "\n".join(said) or None


def search(run, gradient_sync):
    """The micro-batch (--batch-size, or less), and the lines that say why it is less."""
    cfg, env = run.cfg, run.env
    if env.device_type == "cpu":
        memory.keep_freed_memory(not memory.address_space_limited())
    if not cfg.fit_batch_size:
        return cfg.batch_size, []
    sequences_per_step = cfg.total_batch_size // (cfg.seq_len * env.world_size)
    # an evaluation's forward passes need less than the training steps that RECORD is of
    record = None if cfg.eval_only else recorded_on_some_rank(run)
    batch_size, said = below_recorded(cfg, record, sequences_per_step)
    if env.device_type == "cpu" and not cfg.eval_only:  # an evaluation's forward passes hold far less
        batch_size, said = within_cpu_memory(run, batch_size, sequences_per_step, said)
    if cfg.fsdp and env.world_size > 1:  # its forward pass gathers weights from every rank: a rank that stopped in it
        # would leave the others waiting, so the micro-batch given is trained as it is
        return batch_size, said + [f"micro-batch {batch_size}, as given: under --fsdp on several processes it is not "
                                   f"tried first (if a step does not fit, pass a smaller --batch-size)"]
    too_large, t0 = [], time.perf_counter()
    while (where := where_it_does_not_fit(run, batch_size, gradient_sync)) is not None:
        too_large.append(batch_size)
        if batch_size == 1:
            raise UsageError(nothing_fits(cfg, env, where))
        batch_size, last_where = next_smaller(batch_size, sequences_per_step), where
    if too_large:
        tried = ", ".join(map(str, too_large[:-1])) + (" and " if len(too_large) > 1 else "") + str(too_large[-1])
        said.append(f"micro-batch {batch_size}, as {tried} did not fit in {last_where}: found in "
                    f"{time.perf_counter() - t0:.1f} s; --batch-size {batch_size} starts there")
    elif cfg.grow_batch_size:  # --batch-size fits: a larger one may too
        ceiling = sequences_per_step + 1 if record is None else record["micro_batch"]
        batch_size, said = grow(run, batch_size, sequences_per_step, ceiling, gradient_sync, said)
    return batch_size, said


def next_larger(batch_size, sequences_per_step):
    """The smallest micro-batch at least twice batch_size that cuts a rank's sequences_per_step exactly, or None."""
    return min((b for b in range(2 * batch_size, sequences_per_step + 1) if sequences_per_step % b == 0), default=None)


def grow(run, batch_size, sequences_per_step, ceiling, gradient_sync, said):
    """--grow-batch-size: the micro-batch from batch_size (which fits) up, to a rank's sequences_per_step, while a try
    fits on every rank and stays below ceiling (one that ran out of memory after it was chosen, RECORD); and said,
    with the line that says so. Fewer accumulation steps, the same tokens a step."""
    grown, where, t0 = batch_size, None, time.perf_counter()
    while (larger := next_larger(grown, sequences_per_step)) is not None and larger < ceiling:
        where = where_it_does_not_fit(run, larger, gradient_sync)
        if where is not None:
            break
        grown = larger
    failed = f"{larger} did not fit in {where}" if where is not None else ""
    if grown > batch_size:
        return grown, said + [f"micro-batch {grown}, up from {batch_size} (--grow-batch-size): a step of it fits"
                              f"{'; ' + failed if failed else ''}; found in {time.perf_counter() - t0:.1f} s"]
    return batch_size, said + ([f"micro-batch {batch_size}, as given: {failed} (--grow-batch-size)"] if failed else [])


def where_it_does_not_fit(run, batch_size, gradient_sync):
    """None if a try of batch_size fits on every rank; else, on every rank, the memory of the first rank it did not
    fit on, in words. The ranks vote, so that none is left waiting in a collective."""
    fits = step_fits(run, batch_size, gradient_sync)
    where = ranks.first_error_of_any_rank(None if fits else memory.in_words(run.env.device))
    if where is not None:
        forget_try(run)  # on every rank, the ranks whose own try fitted too
    return where


def nothing_fits(cfg, env, where):
    """What to do when not even one sequence's step fits in where (a rank's memory, in words)."""
    return (f"out of memory: not even a micro-batch of 1 sequence of {cfg.seq_len} tokens fits a training step of "
            f"this {cfg.n_layer}-layer, width-{cfg.n_embd} model in {where}; {smaller_step(cfg, env)}")


def smaller_step(cfg, env):
    """What makes a step of one sequence take less memory, in words."""
    shard = "" if cfg.fsdp or env.device_type != "cuda" else ", shard it over several GPUs with --fsdp"
    chunked = "" if cfg.loss == "chunked" else ", --loss chunked (never all the logits at once)"
    return f"train a smaller model (--model, --n-layer, --n-embd), a shorter --seq-len{chunked}{shard}"


# -----------------------------------------------------------------------------
# A CPU's step, estimated before any try: there the kernel's out-of-memory killer ends a process that takes more memory
# than the machine has, with no error to catch (only an address-space limit makes the allocator refuse)

HEAP_KEPT = 2.5  # freed memory kept in the heap took up to 2.2 times the step's own (docs/LOG.md, 2026-11-29)


def cpu_step(run, batch_size, seq_len=None):
    """What a training step of batch_size sequences (of seq_len tokens, the run's if None) adds to this process's
    memory: the memory model's eager step (step_memory.eager_step_bytes)."""
    cfg = run.cfg if seq_len is None else dataclasses.replace(run.cfg, seq_len=seq_len)
    held = any(optimizer.state for optimizer in run.optimizers)  # a resumed run's, in memory already
    return step_memory.eager_step_bytes(step_memory.parameters_of(run.model), cfg, run.recipe.memory,
                                        run.env.world_size, batch_size, held)


def heap_for(step, room):
    """Whether freed memory is kept in the heap (faster) for a step of step bytes in room: True where HEAP_KEPT times
    it fits, and no address-space limit counts the heap's free blocks; False where only the step fits; None if not."""
    if HEAP_KEPT * step <= room and not memory.address_space_limited():
        return True
    return False if step <= room else None


def within_cpu_memory(run, batch_size, sequences_per_step, said):
    """The largest micro-batch up to batch_size, halved as the tries halve it, whose step fits in the memory this CPU
    can give (memory.available), the least of every rank's, and said with the line that says why if it is less; the
    heap's way set for it (heap_for). Raises UsageError on every rank, naming the flags that fit, where not even one
    sequence's step fits on some rank. Where the machine says nothing of its memory, batch_size."""
    room, where = memory.available(run.env)
    fits, why = batch_size, None
    while room is not None and heap_for(cpu_step(run, fits), room) is None and fits > 1:
        larger, fits = fits, next_smaller(fits, sequences_per_step)
        why = (f"micro-batch {fits} on this CPU: a step of {larger} needs about {memory.gib(cpu_step(run, larger))} "
               f"more (the memory model), and {where}; --batch-size {fits} starts there")
    refusal = None
    if room is not None and heap_for(cpu_step(run, fits), room) is None:
        refusal = nothing_fits_this_cpu(run, where, room)
    refusal = ranks.first_error_of_any_rank(refusal)
    if refusal is not None:
        raise UsageError(refusal)
    batch_size, why = min(ranks.every_rank((fits, why)), key=lambda fit: fit[0])  # the rank's line with the least
    if room is None:
        return batch_size, said
    step = cpu_step(run, batch_size)
    keep = heap_for(step, room)
    memory.keep_freed_memory(keep)
    said = said + ([why] if why else [])
    if not keep and not memory.address_space_limited():
        said = said + [f"freed memory is given back to the system (slower): kept in the heap, it can take "
                       f"{HEAP_KEPT:g} times the step's {memory.gib(step)}, more than the {where}"]
    return batch_size, said


def nothing_fits_this_cpu(run, where, room):
    """The refusal where not even one sequence's step fits in room (where, in words): the estimate, the memory, and the
    flags that fit."""
    cfg = run.cfg
    shorter = next((seq_len for seq_len in (cfg.seq_len >> k for k in range(1, 16)) if seq_len >= 1 and
                    heap_for(cpu_step(run, 1, seq_len), room) is not None), None)
    fit = f"--seq-len {shorter} fits (about {memory.gib(cpu_step(run, 1, shorter))}); or " if shorter else ""
    return (f"out of memory: a training step of this {cfg.n_layer}-layer, width-{cfg.n_embd} model needs about "
            f"{memory.gib(cpu_step(run, 1))} more at micro-batch 1 of {cfg.seq_len} tokens (the memory model, "
            f"docs/memory.md), and {where}; {fit}train a smaller model: --preset shakespeare (the quick start's), "
            f"or --model, --n-layer, --n-embd")


# -----------------------------------------------------------------------------
# Out-of-memory errors past the micro-batch's choice, and their record in the log directory


def step_shape(run):
    """What a training step's memory depends on, as JSON reads it back: a record in RECORD holds for runs of the
    same shape (same_step)."""
    cfg, env = run.cfg, run.env
    shape = {"model": dataclasses.asdict(run.model.config), "seq_len": cfg.seq_len, "dtype": cfg.dtype,
             "compile": cfg.compile, "compile_mode": cfg.compile_mode, "fused_adamw": cfg.fused_adamw,
             "fsdp": cfg.fsdp, "device": env.device_type, "world_size": env.world_size,
             "speedups": {f.name: getattr(cfg, f.name) for f in memory_settings(cfg)}}
    return json.loads(json.dumps(shape))


def memory_settings(cfg):
    """The speed-ups' settings that change a step's memory (declared with memory=True)."""
    return [f for f in dataclasses.fields(cfg) if f.metadata.get("memory")]


def step_defaults(run):
    """The defaults of step_shape's settings that a record older than them may not name: the model's, the speed-ups'.
    Such a record was written by a run that had them at these values."""
    return {"model": {f.name: f.default for f in dataclasses.fields(run.model.config)},
            "speedups": {f.name: f.default for f in memory_settings(run.cfg)}}


NOT_NAMED = object()  # a setting that a record does not name and that has no default: no value equals it


def same_step(recorded, shape, defaults):
    """Whether a record's step shape (recorded) is shape, on the settings shape names: one the record does not name
    (added since) at its default, one it names that is gone (a7f4ffe's --sdpa-backend, --grow-batch-size,
    --recompute-pointwise) at any value. A record that holds wrongly costs a smaller micro-batch, said in a line;
    one ignored wrongly, the same out-of-memory error mid-run."""
    if not isinstance(recorded, dict):
        return False
    for key, value in shape.items():
        if isinstance(value, dict):
            if not same_step(recorded.get(key, {}), value, defaults.get(key, {})):
                return False
        elif (recorded[key] if key in recorded else defaults.get(key, NOT_NAMED)) != value:
            return False
    return True


def read_records(log_dir):
    """The records of RECORD in log_dir that could be true; [] if there is none, or it cannot be read (at worst, a
    micro-batch that ran out of memory is chosen again)."""
    try:
        with open(os.path.join(log_dir, RECORD)) as f:
            records = files.parse_json(f.read())
    except (OSError, ValueError):
        return []
    return [r for r in records if possible(r)] if isinstance(records, list) else []


def possible(record):
    """Whether a record read from RECORD could be one that record_out_of_memory wrote: a micro-batch of 1 or more, a
    step of 0 or more, a memory of 1 byte to 16 EiB and its words (JSON reads Infinity, and integers of any size)."""
    def whole(value, least):  # True is an int to Python
        return isinstance(value, int) and not isinstance(value, bool) and value >= least

    memory = record.get("memory") if isinstance(record, dict) else None
    return (isinstance(memory, (int, float)) and not isinstance(memory, bool) and 1 <= memory < 2**64
            and whole(record.get("micro_batch"), 1) and whole(record.get("step"), 0)
            and isinstance(record.get("memory_words"), str))


def recorded_on_this_rank(run):
    """The record of the smallest micro-batch that ran out of memory in a run of this step shape, on as much memory
    as this rank's or more (to the 0.1 GiB its words give), in this rank's view of the log directory; or None."""
    shape, defaults, size = step_shape(run), step_defaults(run), memory.of_device(run.env.device)[0]
    held = [r for r in read_records(run.cfg.log_dir) if same_step(r.get("shape"), shape, defaults)
            and round(size / memory.GIB, 1) <= round(r["memory"] / memory.GIB, 1)]
    return min(held, key=lambda r: r["micro_batch"], default=None)


def recorded_on_some_rank(run):
    """The record of the smallest micro-batch that ran out of memory, of those that hold on each rank
    (recorded_on_this_rank), on every rank; or None. All ranks must call it."""
    records = [r for r in ranks.every_rank(recorded_on_this_rank(run)) if r is not None]
    return min(records, key=lambda r: r["micro_batch"], default=None)


def below_recorded(cfg, record, sequences_per_step):
    """--batch-size, or the largest micro-batch below record's (recorded_on_some_rank: the smallest that ran out of
    memory after it was chosen), or 1 again where that was 1 (a hint, which the try of 1 then checks), with the line
    that says so."""
    if record is None or record["micro_batch"] > cfg.batch_size or cfg.batch_size == 1:
        return cfg.batch_size, []
    failed, path = record["micro_batch"], os.path.join(cfg.log_dir, RECORD)
    why = f"ran out of memory in {record['memory_words']} at step {record['step']}, after it was chosen"
    if failed == 1:
        return 1, [f"micro-batch 1 again, as none is smaller: it {why} ({path} says so; delete it to start from "
                   f"--batch-size {cfg.batch_size} again)"]
    batch_size = next_smaller(failed, sequences_per_step)
    return batch_size, [f"micro-batch at most {batch_size}: {failed} {why} ({path} says so; delete it to try {failed} "
                        f"again)"]


def record_out_of_memory(run):
    """Adds run's micro-batch to RECORD in the log directory, with this rank's memory and the step shape, so that the
    next start of such a step on no more memory starts below it: the path, or None if it cannot be written. The rank
    that ran out of memory writes it (rank 0 may be waiting in a collective with it), and every rank reads it."""
    path = os.path.join(run.cfg.log_dir, RECORD)
    size, words = memory.of_device(run.env.device)
    records = read_records(run.cfg.log_dir) + [{"micro_batch": run.micro_batch, "step": run.step, "memory": size,
                                               "memory_words": words, "shape": step_shape(run)}]
    try:
        files.write_atomically(path, lambda f: f.write(json.dumps(records, indent=1).encode()),
                                  f"{path}.{os.getpid()}.tmp", lambda: "")
    except (OSError, UsageError):  # the out-of-memory line matters more: it says to pass a smaller --batch-size
        return None
    return path


@contextlib.contextmanager
def out_of_memory_in_one_line(cfg, run=None):
    """An out-of-memory error raised inside (a training step that the allocator's fragments no longer fit, an
    evaluation, samples, a command) becomes a UsageError: one line that names the memory, the checkpoint kept and
    what to do. Past the micro-batch's choice (run given), the micro-batch is recorded (RECORD): the same command then
    chooses a smaller one."""
    try:
        yield
    except Exception as e:  # any allocator's error: see memory.is_out_of_memory
        if isinstance(e, UsageError) or not memory.is_out_of_memory(e):  # a UsageError: an inner one's line already
            raise
        raise UsageError(out_of_memory_later(e, cfg, run)) from None


def out_of_memory_later(error, cfg, run):
    """out_of_memory_in_one_line's line."""
    error = memory.out_of_memory_in(error)
    device = f"cuda:{torch.cuda.current_device()}" if isinstance(error, torch.cuda.OutOfMemoryError) else (
        "mps" if "MPS" in str(error) else "cpu")
    reason = files.first_line(error)
    what = f"out of memory in {memory.in_words(device)}" + (f" ({reason})" if reason else "")
    if cfg.sample or cfg.export_hf:  # --sample draws its samples --batch-size at a time
        return f"{what}; pass a smaller --batch-size" if cfg.sample else what
    latest = checkpoints.latest_checkpoint(cfg.log_dir)
    what += f"; the latest checkpoint, {latest}, is kept" if latest else "; no checkpoint was written yet"
    if run is None:  # before the micro-batch was chosen: the model, its checkpoint, the data
        return what
    if cfg.eval_only:  # it reads no record, so it writes none
        return what + (f"; pass a --batch-size below {run.micro_batch}" if run.micro_batch > 1 else "")
    recorded = record_out_of_memory(run)
    if run.micro_batch == 1:
        return f"{what}; no micro-batch is smaller than 1: {smaller_step(cfg, run.env)}"
    if not cfg.fit_batch_size:
        return (f"{what}; pass a --batch-size below {run.micro_batch}, or drop --no-fit-batch-size (a step is then "
                f"tried first)")
    if recorded is None:
        return f"{what}; pass a --batch-size below {run.micro_batch}"
    return f"{what}; run the same command again: it chooses a micro-batch below {run.micro_batch} ({recorded} says why)"
