"""The micro-batch that fits (microbatch.py), under a real memory limit: the trainer runs in a child process whose
address space is limited (RLIMIT_AS, tests/scripts/limited_memory.py), as on a small machine. A --batch-size whose step
does not fit trains with a smaller micro-batch that the run names, on the same tokens and schedule; a micro-batch that
fits its try trains; the ranks of a run agree on the smallest, and name the rank it did not fit on; an out-of-memory
error later, or when nothing fits, is one line on every rank, and no file is lost; the next start after one chooses a
smaller micro-batch (or tries 1 again); a rank killed outright leaves the other one line."""
import copy
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess

import pytest
import torch

import train_gpt2
from helpers import (
    REPO,
    TINY,
    check_usage_error,
    checkpoint_path,
    load_ckpt,
    process_stat,
    read_log,
    run_main,
    run_script,
    run_source,
    script_command,
    script_env,
    start_command,
    train_records,
    val_records,
    wait_for_step,
    write_shards,
)
from machinery import checkpoints, memory, microbatch
from variations import speedups

LIMITED = os.path.join(REPO, "tests", "scripts", "limited_memory.py")
# GPT-2's whole vocabulary on a tiny model: a step's memory is mostly the logits and their gradient, 6.4 MB a sequence
# of 32 tokens each, so 32 sequences need most of a GiB and 8 a fifth of it
WIDE = TINY + ["--vocab-size", "50257", "--batch-size", "32", "--total-batch-size", "1024", "--val-tokens", "256",
               "--warmup-steps", "1"]
HEADROOM = 350  # MiB past what importing the trainer takes: a step of 8 of these sequences fits, one of 16 does not
# a step of 32 fits with freed memory given back to the system, not with it kept in the heap (as a CPU run keeps it
# where memory allows), which took 1.2 to 1.3 GiB
ROOM_FOR_32 = 1000
# the line of a micro-batch below 16 that the memory model chose on a CPU, where a step of 16 does not fit (on rank r)
MICRO_BATCH_LINE = (r"^micro-batch (\d+) on this CPU: a step of 16 needs about [\d.]+ GiB more \(the memory model\), "
                    r"and [\d.]+ GiB of address space left \(ulimit -v\){on_rank}; --batch-size \1 starts there$")


def run_limited(args, cwd, headroom=HEADROOM, nproc=1, limited_rank=-1, **env):
    # one malloc arena: glibc reserves 64 MiB of address space for each thread's own (gloo's threads would have one
    # each), which this limit would count as if it were memory
    return run_script([REPO, limited_rank, headroom, *args], cwd=cwd, nproc=nproc, script=LIMITED,
                      MALLOC_ARENA_MAX="1", **env)


@pytest.fixture(scope="module")
def ran_out_at_1(tmp_path_factory):
    """A run whose micro-batch of 1 fitted its try, then ran out of memory in step 0, as 240 MiB of its 300 were taken
    after the choice: (its flags but for --log-dir and --batch-size, its log directory, where RECORD holds micro-batch
    1, its CompletedProcess)."""
    root = tmp_path_factory.mktemp("ran_out_at_1")
    args = WIDE + ["--data", write_shards(root / "data"), "--max-steps", "1", "--total-batch-size", "256"]
    result = run_limited(args + ["--log-dir", root / "log", "--batch-size", "1"], root, headroom=300,
                         TAKEN_LATER_MIB="240")
    return args, root / "log", result


def the_one_line_of_every_rank(result):
    """The one error line that every one of 2 ranks ended with, exit 2 and no traceback."""
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 2 and len(set(errors)) == 1, errors
    return errors[0]


def test_next_smaller_cuts_the_step_exactly():
    assert microbatch.next_smaller(64, 64) == 32
    assert microbatch.next_smaller(12, 48) == 6
    assert microbatch.next_smaller(6, 48) == 3
    assert microbatch.next_smaller(3, 48) == 1
    assert microbatch.next_smaller(10, 30) == 5  # not 4: 30 sequences are no whole number of micro-batches of 4


def test_what_runs_out_of_memory():
    def raised(error, cause):
        try:
            raise error from cause
        except Exception as e:
            return e

    assert memory.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert memory.is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to ..."))
    assert memory.is_out_of_memory(RuntimeError("MPS backend out of memory (MPS allocated: 1.2 GB)"))
    # on an H100 capped to 37 GiB, the search's try of 64 (the backward's first cuBLAS handle)
    assert memory.is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                                                    "`cublasCreate(handle)`"))
    assert memory.is_out_of_memory(raised(RuntimeError("compiled graph failed"), MemoryError()))
    assert memory.is_out_of_memory(OSError(12, "Cannot allocate memory"))
    assert not memory.is_out_of_memory(RuntimeError("shape '[4, 32]' is invalid for input of size 100"))
    assert not memory.is_out_of_memory(OSError(28, "No space left on device"))


def test_a_batch_that_does_not_fit_trains_smaller_on_the_same_tokens(shards, tmp_path, capsys):
    """A step where memory is plenty; then, under the limit, --batch-size 32 forced (--no-fit-batch-size) runs out of
    memory in its first step: one line, the checkpoint kept. The same command without the flag finds a smaller
    micro-batch (the memory model's, whose step fits in the address space left), names it, and trains to the end; its
    losses are those of a run given that micro-batch from the start, to float rounding (another cut of the same
    tokens)."""
    log = tmp_path / "log"
    args = WIDE + ["--data", shards, "--log-dir", log, "--max-steps", "2"]
    code, out, err = run_main(args + ["--max-steps", "1", "--batch-size", "8"], capsys)
    assert code == 0, err

    forced = run_limited(args + ["--no-fit-batch-size"], tmp_path)
    check_usage_error(forced.returncode, forced.stdout, forced.stderr, "out of memory in",
                      f"the latest checkpoint, {checkpoint_path(log, 1)}, is kept",
                      "; pass a --batch-size below 32, or drop --no-fit-batch-size")  # no choice to make again
    assert sorted(os.listdir(log)) == [".lock", "ckpt_000001.pt", "log.jsonl", "out_of_memory.json"]

    fitted = run_limited(args, tmp_path)  # 32, recorded, is not tried again
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    assert re.search(r"^micro-batch at most 16: 32 ran out of memory in [\d.]+ GiB of address space \(ulimit -v\) at "
                     r"step 1, after it was chosen", fitted.stdout, re.M), fitted.stdout
    chosen = int(re.search(MICRO_BATCH_LINE.format(on_rank=""), fitted.stdout, re.M).group(1))
    assert chosen < 32 and f"batch 1,024 tokens = {chosen} x 32 x {32 // chosen} accumulation steps" in fitted.stdout
    assert [r["micro_batch"] for r in read_log(log) if "event" in r] == [8, 32, chosen]  # each launch's start record
    assert load_ckpt(checkpoint_path(log, 2))["micro_batch"] == chosen

    code, _, err = run_main(args + ["--batch-size", chosen, "--log-dir", tmp_path / "given"], capsys)
    assert code == 0, err
    given, limited = read_log(tmp_path / "given"), read_log(log)
    assert {step: r["train_loss"] for step, r in train_records(limited).items()} == \
        pytest.approx({step: r["train_loss"] for step, r in train_records(given).items()}, rel=1e-5)
    assert val_records(limited)[2]["val_loss"] == pytest.approx(val_records(given)[2]["val_loss"], rel=1e-5)


def test_the_ranks_train_with_the_micro_batch_that_fits_on_every_one(shards, tmp_path, capsys):
    """Two processes (gloo), only rank 1 limited: the micro-batch that fits there is the one both train with (another
    would cut the global batch otherwise, and the ranks' gradient reductions would not pair up). The losses are those
    of one process at the micro-batch given."""
    args = WIDE + ["--data", shards, "--max-steps", "1", "--batch-size", "16"]  # 16 sequences a step on each rank
    two = run_limited(args + ["--log-dir", tmp_path / "two"], tmp_path, nproc=2, limited_rank=1)
    assert two.returncode == 0, two.stderr[-3000:]
    line = re.search(MICRO_BATCH_LINE.format(on_rank=" on rank 1"), two.stdout, re.M)  # rank 1's memory, not rank 0's
    chosen = int(line.group(1))
    assert chosen < 16 and f"{chosen} x 32 x {16 // chosen} accumulation steps x 2 process(es)" in two.stdout
    code, _, err = run_main(args + ["--log-dir", tmp_path / "one"], capsys)
    assert code == 0, err
    one = {step: r["train_loss"] for step, r in train_records(read_log(tmp_path / "one")).items()}
    assert {step: r["train_loss"] for step, r in train_records(read_log(tmp_path / "two")).items()} == \
        pytest.approx(one, rel=1e-5)
    assert val_records(read_log(tmp_path / "two"))[1]["val_loss"] == \
        pytest.approx(val_records(read_log(tmp_path / "one"))[1]["val_loss"], rel=1e-5)


def test_nothing_fits_is_one_line_on_every_rank_and_moves_no_file(shards, tmp_path):
    """Not even one sequence's step fits on rank 1 (the optimizers' state of a wider model does not, the memory model
    says before any try): every rank stops with one line that names rank 1's memory and what to change, exit 2, and
    the earlier run that a fresh start would have moved aside is where it was."""
    log = tmp_path / "log"
    log.mkdir()
    (log / "log.jsonl").write_text('{"step": 0, "val_loss": 10.9}\n')
    (log / "notes.txt").write_text("mine")
    args = WIDE + ["--n-embd", "256", "--batch-size", "1", "--total-batch-size", "64", "--data", shards, "--log-dir",
                   log, "--max-steps", "1", "--no-resume"]
    error = the_one_line_of_every_rank(run_limited(args, tmp_path, headroom=250, nproc=2, limited_rank=1))
    assert re.fullmatch(r"error: out of memory: a training step of this 2-layer, width-256 model needs about "
                        r"[\d.]+ GiB more at micro-batch 1 of 32 tokens \(the memory model, docs/memory.md\), and "
                        r"[\d.]+ GiB of address space left \(ulimit -v\) on rank 1; train a smaller model: "
                        r"--preset shakespeare \(the quick start's\), or --model, --n-layer, --n-embd", error), error
    assert sorted(os.listdir(log)) == [".lock", "log.jsonl", "notes.txt"]
    assert (log / "log.jsonl").read_text() == '{"step": 0, "val_loss": 10.9}\n'


def test_gpt2_on_ones_own_data_is_refused_where_it_does_not_fit_and_the_small_preset_trains(tmp_path):
    """`python train_gpt2.py --data mycode` on a CPU takes GPT-2 124M's defaults; where the machine could not give its
    step's memory, the kernel's out-of-memory killer ended it with no word. Here the machine is an address space of
    1.5 GiB past the trainer's import: the run stops before any step in one line that names the memory model's
    estimate, the memory left and the flag that fits, and touches no log directory. With that flag, --preset
    shakespeare, the same data trains in the same memory. (Before, a try of each micro-batch from 64 down to 1 ran out
    of memory, and the line named neither.)"""
    shards = write_shards(tmp_path / "mycode", train_lengths=(270000, 270000), val_length=20000, vocab=50257)
    args = ["--data", shards, "--device", "cpu"]
    refused = run_limited(args + ["--log-dir", tmp_path / "log"], tmp_path, headroom=1500)
    check_usage_error(refused.returncode, refused.stdout, refused.stderr, "error: out of memory: a training step of "
                      "this 12-layer, width-768 model needs about 2.54 GiB more at micro-batch 1 of 1024 tokens (the "
                      "memory model, docs/memory.md), and ", " GiB of address space left (ulimit -v); train a smaller "
                      "model: --preset shakespeare (the quick start's)")
    assert not (tmp_path / "log").exists() and "step" not in refused.stdout
    small = args + ["--preset", "shakespeare", "--log-dir", tmp_path / "small", "--max-steps", "1",
                    "--num-samples", "0", "--val-tokens", "1024"]
    trained = run_limited(small, tmp_path, headroom=1500)
    assert trained.returncode == 0 and "micro-batch" not in trained.stdout, trained.stderr[-3000:]
    assert [r["micro_batch"] for r in read_log(tmp_path / "small") if "event" in r] == [8]


def test_the_memory_a_cpu_can_give_is_the_machines_available_memory(tmp_path):
    """With no limit of its own (no address-space limit, no cgroup's here), what the trainer compares a CPU step with is
    the machine's available memory, as `free` reads it (to 64 MiB: other processes allocate meanwhile)."""
    if memory.address_space_limited() or memory.cgroup_room()[0] is not None or not shutil.which("free"):
        pytest.skip("this machine limits the process itself, or has no free(1)")
    room, where = memory.available(train_gpt2.Env(0, 0, 1, "cpu", "cpu"))
    free = subprocess.run(["free", "-b"], capture_output=True, text=True, check=True).stdout.splitlines()
    available = int(free[1].split()[6])  # Mem: total used free shared buff/cache available
    assert abs(room - available) < 64 << 20 and where.endswith("available (MemAvailable in /proc/meminfo)"), where


def test_a_micro_batch_whose_try_fits_trains(shards, tmp_path, capsys):
    """Where a step of 32 fits with freed memory given back to the system but not with it kept in the heap, the run
    trains 32 as its try did. Before, the try gave freed memory back and the run then kept it: the chosen 32 ran out of
    memory in step 0, and again at every start. The try's optimizer step, at a learning rate of 0, moved no weight and
    left no state: the run's losses are, bitwise, those of a run with no limit, whose try takes no such step."""
    args = WIDE + ["--data", shards, "--max-steps", "1"]
    result = run_limited(args + ["--log-dir", tmp_path / "log"], tmp_path, headroom=ROOM_FOR_32)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "micro-batch" not in result.stdout and "32 x 32 x 1 accumulation steps" in result.stdout
    code, _, err = run_main(args + ["--log-dir", tmp_path / "unlimited"], capsys)
    assert code == 0, err
    limited, unlimited = read_log(tmp_path / "log"), read_log(tmp_path / "unlimited")
    assert train_records(limited)[0]["train_loss"] == train_records(unlimited)[0]["train_loss"]
    assert val_records(limited)[1]["val_loss"] == val_records(unlimited)[1]["val_loss"]


def test_an_out_of_memory_error_later_makes_the_next_start_choose_smaller(shards, tmp_path, capsys):
    """Memory taken after the micro-batch was chosen (450 MiB, as fragments or another library may take it): step 0
    of 32 runs out of it, in one line that says what the next start does. The same command then starts below 32, says
    why, and trains. A start with more memory (no limit) tries 32 again."""
    args = WIDE + ["--data", shards, "--log-dir", tmp_path / "log", "--max-steps", "1"]
    first = run_limited(args, tmp_path, headroom=ROOM_FOR_32, TAKEN_LATER_MIB="450")
    check_usage_error(first.returncode, first.stdout, first.stderr, "out of memory in",
                      "no checkpoint was written yet; run the same command again: it chooses a micro-batch below 32 (",
                      f"{tmp_path / 'log' / 'out_of_memory.json'} says why)")
    again = run_limited(args, tmp_path, headroom=ROOM_FOR_32, TAKEN_LATER_MIB="450")
    assert again.returncode == 0, again.stderr[-3000:]
    assert re.search(r"^micro-batch at most 16: 32 ran out of memory in [\d.]+ GiB of address space \(ulimit -v\) at "
                     r"step 0, after it was chosen \(.*out_of_memory.json says so; delete it to try 32 again\)$",
                     again.stdout, re.M), again.stdout
    assert [r["micro_batch"] for r in read_log(tmp_path / "log") if "event" in r] == [16]
    code, out, err = run_main(args + ["--no-resume"], capsys)
    assert code == 0 and "micro-batch" not in out, err
    assert [r["micro_batch"] for r in read_log(tmp_path / "log") if "event" in r] == [32]


def test_an_out_of_memory_error_on_one_rank_ends_every_rank_in_its_line(shards, tmp_path):
    """Two processes (gloo), only rank 1 limited, --no-fit-batch-size: rank 1 runs out of memory in step 0 while rank
    0 waits for its gradients in the all-reduce. Every rank ends with rank 1's line, which names rank 1 and its memory,
    and says what helps: before, rank 0 died in a traceback (gloo's "Connection closed by peer")."""
    args = WIDE + ["--data", shards, "--log-dir", tmp_path / "log", "--max-steps", "1", "--total-batch-size", "2048",
                   "--no-fit-batch-size"]
    error = the_one_line_of_every_rank(run_limited(args, tmp_path, headroom=500, nproc=2, limited_rank=1))
    assert re.fullmatch(r"error: out of memory in [\d.]+ GiB of address space \(ulimit -v\) on rank 1 \(.*\); no "
                        r"checkpoint was written yet; pass a --batch-size below 32, or drop --no-fit-batch-size \(a "
                        r"step is then tried first\)", error), error


def test_a_run_resumed_with_another_micro_batch_says_so_and_trains_on_the_same_tokens(shards, tmp_path, capsys):
    """As on another card: the micro-batch of the resumed run's checkpoint is not the one this launch trains with.
    The line says so, and the run goes on along the same tokens and schedule: its losses are those of a run that kept
    its micro-batch, to float rounding."""
    args = TINY + ["--data", shards, "--max-steps", "4", "--warmup-steps", "1"]
    code, _, err = run_main(args + ["--log-dir", tmp_path / "kept"], capsys)
    assert code == 0, err
    code, _, err = run_main(args + ["--log-dir", tmp_path / "moved", "--max-steps", "2"], capsys)
    assert code == 0, err
    code, out, err = run_main(args + ["--log-dir", tmp_path / "moved", "--batch-size", "2"], capsys)
    assert code == 0, err
    assert "the run trained with micro-batch 4 before, 2 now: the same tokens and schedule" in out
    assert load_ckpt(checkpoint_path(tmp_path / "moved", 4))["micro_batch"] == 2
    code, out, err = run_main(args + ["--log-dir", tmp_path / "moved", "--eval-only", "--batch-size", "1"], capsys)
    assert code == 0 and "trained with micro-batch" not in out, err  # an evaluation sums no gradients
    kept, moved = (train_records(read_log(tmp_path / name)) for name in ("kept", "moved"))
    assert {step: r["train_loss"] for step, r in moved.items()} == \
        pytest.approx({step: r["train_loss"] for step, r in kept.items()}, rel=1e-5)


def test_a_record_of_micro_batch_1_is_tried_again(ran_out_at_1, tmp_path, capsys):
    """Micro-batch 1 ran out of memory in step 0: its line says what helps, not "a micro-batch below 1". RECORD, which
    then holds 1, is a hint, not a verdict: on the same memory, 1 is tried again and trains, with a line that names
    the file and what deleting it does. --eval-only, whose forward passes need less, reads no record: it tries 8, and
    when its evaluation then runs out of memory (memory taken after the choice), it writes none either and says what
    helps. More memory (no limit) is not bound by the record. Before, every start, --eval-only's too, stopped on "not
    even a micro-batch of 1 sequence fits" without a try, and without the file's name."""
    args, recorded, first = ran_out_at_1
    check_usage_error(first.returncode, first.stdout, first.stderr, "out of memory in",
                      "no checkpoint was written yet; no micro-batch is smaller than 1: train a smaller model")
    log = tmp_path / "log"
    log.mkdir()
    shutil.copy(recorded / microbatch.RECORD, log)
    args = args + ["--log-dir", log, "--batch-size", "2"]
    again = run_limited(args, tmp_path, headroom=300)
    assert again.returncode == 0, again.stderr[-3000:]
    line = (r"^micro-batch 1 again, as none is smaller: it ran out of memory in [\d.]+ GiB of address space \(ulimit "
            r"-v\) at step 0, after it was chosen \(" + re.escape(str(log / microbatch.RECORD)) +
            r" says so; delete it to start from --batch-size 2 again\)$")
    assert re.search(line, again.stdout, re.M), again.stdout
    record = (log / microbatch.RECORD).read_text()
    evaluated = run_limited(args + ["--eval-only", "--batch-size", "8"], tmp_path, headroom=300, TAKEN_LATER_MIB="240")
    check_usage_error(evaluated.returncode, evaluated.stdout, evaluated.stderr, "out of memory in",
                      f"the latest checkpoint, {checkpoint_path(log, 1)}, is kept; pass a --batch-size below 8")
    assert (log / microbatch.RECORD).read_text() == record
    code, out, err = run_main(args + ["--max-steps", "2"], capsys)
    assert code == 0 and "trained with micro-batch 1 before, 2 now" in out and microbatch.RECORD not in out, err
    assert [r["micro_batch"] for r in read_log(log) if "event" in r] == [1, 2]


def test_an_impossible_record_is_ignored(ran_out_at_1, tmp_path, capsys):
    """RECORD damaged where its step shape still matches: a micro-batch of 0, below 0 or true; a memory past any
    machine's, infinite or true. Each is ignored, as a truncated file is: the run trains --batch-size, and no line
    speaks of the record. Before, next_smaller's max() of an empty sequence, or an int too large for a float, ended
    the run in a traceback."""
    args, recorded, _ = ran_out_at_1
    real = json.loads((recorded / microbatch.RECORD).read_text())[0]
    log = tmp_path / "log"
    log.mkdir()
    damaged = [dict(real, micro_batch=0, memory=2**40), dict(real, micro_batch=-1, memory=2**40),
               dict(real, micro_batch=True, memory=2**40), dict(real, micro_batch=1, memory=10**400),
               dict(real, micro_batch=1, memory=float("inf")), dict(real, micro_batch=1, memory=True)]
    (log / microbatch.RECORD).write_text(json.dumps(damaged))
    code, out, err = run_main(args + ["--log-dir", log, "--batch-size", "2"], capsys)
    assert code == 0 and "micro-batch" not in out, err
    assert [r["micro_batch"] for r in read_log(log) if "event" in r] == [2]
    (log / microbatch.RECORD).write_text("[" * 200000 + "]" * 200000)  # json's RecursionError, a traceback before
    code, out, err = run_main(args + ["--log-dir", log, "--batch-size", "2", "--max-steps", "2"], capsys)
    assert code == 0 and "micro-batch" not in out, err


def test_a_record_holds_for_the_speed_ups_it_was_made_with_alone(ran_out_at_1, tmp_path, capsys):
    """A step's memory depends on the speed-ups (--fp8-head keeps bf16 copies of the head's inputs for its backward):
    RECORD's step shape holds their settings, and a record made with others says nothing of this run. The real record
    (made with none), as if of a machine with more memory than this one, holds here: micro-batch 1 again; the same
    record of a run with --fp8-head (which needs a GPU of compute capability 8.9) is ignored: 2, as given."""
    args, recorded, _ = ran_out_at_1
    real = json.loads((recorded / microbatch.RECORD).read_text())[0]
    assert real["shape"].get("speedups") == {f.name: f.default for f in dataclasses.fields(speedups.Settings)}
    held = dict(real, memory=2**62)  # more than this machine's: what the record says holds for it
    fp8_head = copy.deepcopy(held)
    fp8_head["shape"]["speedups"]["fp8_head"] = True
    for name, record, micro_batch in (("held", held, 1), ("fp8_head", fp8_head, 2)):
        log = tmp_path / name
        log.mkdir()
        (log / microbatch.RECORD).write_text(json.dumps([record]))
        code, out, err = run_main(args + ["--log-dir", log, "--batch-size", "2"], capsys)
        assert code == 0, err
        assert ("micro-batch 1 again, as none is smaller" in out) == (micro_batch == 1), out
        assert [r["micro_batch"] for r in read_log(log) if "event" in r] == [micro_batch]


# out_of_memory.json as a7f4ffe (the code before machinery/ and variations/) wrote it, when micro-batch 8 of WIDE's
# model ran out of memory in step 0 under an address-space limit; its speed-ups name three settings since gone
A7F4FFE_RECORD = {
    "micro_batch": 8, "step": 0, "memory": 1730768896, "memory_words": "1.6 GiB of address space (ulimit -v)",
    "shape": {"model": {"block_size": 32, "vocab_size": 50257, "n_layer": 2, "n_head": 4, "n_embd": 64, "attn": "sdpa",
                        "recipe": "gpt2", "loss": "full", "logit_softcap": 15.0},
              "seq_len": 32, "dtype": "fp32", "compile": False, "compile_mode": "default", "fused_adamw": True,
              "fsdp": False, "device": "cpu", "world_size": 1,
              "speedups": {"sdpa_backend": "auto", "grow_batch_size": False, "recompute_pointwise": False,
                           "coordinate_descent": False, "fp8_head": False}}}


def test_a_record_written_before_the_move_holds(ran_out_at_1, tmp_path, capsys):
    """A7F4FFE_RECORD, as if of a machine with more memory than this one: its run was told "it chooses a micro-batch
    below 8", and the same command takes 4. Before, the three settings it names that are gone (--sdpa-backend,
    --grow-batch-size, --recompute-pointwise) matched no run, and 8 was tried again. It holds with --recompute-pointwise
    on too (which kept less: 8 runs out without it as well), and so does a record that names no speed-ups at all (as
    before a81035a), a run at their defaults."""
    args, _, _ = ran_out_at_1
    recomputed, older = copy.deepcopy(A7F4FFE_RECORD), copy.deepcopy(A7F4FFE_RECORD)
    recomputed["shape"]["speedups"]["recompute_pointwise"] = True
    del older["shape"]["speedups"]
    for name, record in (("a7f4ffe", A7F4FFE_RECORD), ("recomputed", recomputed), ("older", older)):
        log = tmp_path / name
        log.mkdir()
        (log / microbatch.RECORD).write_text(json.dumps([dict(record, memory=2**62)], indent=1))
        code, out, err = run_main(args + ["--log-dir", log, "--batch-size", "8"], capsys)
        assert code == 0, err
        assert re.search(r"^micro-batch at most 4: 8 ran out of memory in 1\.6 GiB of address space \(ulimit -v\) at "
                         r"step 0, after it was chosen", out, re.M), (name, out)
        assert [r["micro_batch"] for r in read_log(log) if "event" in r] == [4], name


ROOM_MEASURED = """
import json, sys
sys.path.insert(0, sys.argv[1])
import train_gpt2
from machinery import microbatch

def address_space(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(field + ":"))

choose, seen = microbatch.largest_that_fits, {}

def measured(run, *args):
    before = address_space("VmSize")
    chosen = choose(run, *args)
    seen.update(grown=address_space("VmPeak") - before, weights=sum(p.nbytes for p in run.model.parameters()))
    return chosen

microbatch.largest_that_fits = measured
train_gpt2.main(sys.argv[2:])
print(json.dumps(seen))
"""


def test_a_try_of_one_pass_holds_no_room_for_the_optimizers(shards, tmp_path):
    """On a CPU with no address-space limit the try is one forward and backward pass, and no second pass follows
    that the optimizers' room (3 times the weights' bytes, allocated untouched) would be held for: the process's
    address space grows by the gradients and the pass's own memory (with the tied embedding's two gradients summed,
    about 3 times the weights' bytes), not by the room besides. Before, the room was allocated after the pass all the
    same."""
    args = WIDE + ["--n-embd", "512", "--batch-size", "1", "--total-batch-size", "32", "--val-tokens", "32", "--data",
                   shards, "--log-dir", tmp_path / "log", "--max-steps", "0"]
    result = run_source(ROOM_MEASURED, tmp_path, args, MALLOC_ARENA_MAX="1")  # the fork server of run_limited's runs
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["grown"] < 4 * seen["weights"], seen


def test_a_rank_killed_outright_leaves_the_other_one_line(shards, tmp_path):
    """kill -9 of rank 1 mid-training, as the kernel's out-of-memory killer kills: rank 0, whose collective broke as
    rank 1 died, ends in one line that names rank 1, the checkpoint kept and what to do. Before, it died in gloo's
    traceback ("Connection reset by peer")."""
    log = tmp_path / "log"
    args = TINY + ["--data", shards, "--log-dir", log, "--max-steps", "100000", "--checkpoint-every", "1"]
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:  # run_limited's fork server
        ranks = start_command(script_command(args, nproc=2), tmp_path, script_env(MALLOC_ARENA_MAX="1"), stdout=out,
                              stderr=err)
    try:
        wait_for_step(ranks, log, 1)  # and so the checkpoint of step 1 is written
        rank_0 = int(re.search(r"pid (\d+)", (log / ".lock").read_text()).group(1))  # rank 0 holds the log dir
        rank_1 = next(int(pid) for pid in filter(str.isdigit, os.listdir("/proc"))
                      if int(pid) != rank_0 and (process_stat(pid) or (None, None))[1] == ranks.pid)
        os.kill(rank_1, signal.SIGKILL)
        code = ranks.wait(60)
    finally:
        ranks.kill()
    latest = checkpoints.latest_checkpoint(log)
    check_usage_error(code, open(tmp_path / "out.txt").read(), open(tmp_path / "err.txt").read(), "error: rank 1 died",
                      f"the latest checkpoint, {latest}, is kept: run the same command again to resume from it")
