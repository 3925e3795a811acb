"""benchmarks/memory.py: the parameters counted on the meta device against a hand count, how DDP and FSDP lay out
the model state, the activations against a count of what the compiled step saves, the table it prints, and its one-line
errors; no GPU (--measure is refused without one). benchmarks/muon_overhead.py, which times what sharding costs Muon,
end to end. benchmarks/small_cards.py's run and its reading of a recorded memory history."""
import json
import os
import sys

import pytest
import torch

from helpers import REPO, TINY, check_usage_error, needs_muon, run_main, run_script

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import memory  # noqa: E402
import small_cards  # noqa: E402

V, BLOCK = 50304, 1024
SHARDED = ("weights", "gradients", "optimizer")


def gpt2_by_hand(n_layer, C):
    """(block parameters, the rest) of the GPT-2 recipe: per block, attention's qkv (3C^2 + 3C) and projection
    (C^2 + C), the MLP's (4C^2 + 4C) and (4C^2 + C), two LayerNorms (4C); the rest, the token and position embeddings
    and the final LayerNorm, the head tied to the token embedding."""
    return n_layer * (12 * C * C + 13 * C), V * C + BLOCK * C + 2 * C


def rows(model="gpt2", world=8, recipe="gpt2", accumulation=1):
    return memory.model_state(memory.count_parameters(model, recipe), world, memory.RECIPES[recipe].memory,
                              accumulation)


def run_memory(argv, capsys):
    return run_main(argv, capsys, memory.main)


def test_gpt2_parameters_are_counted_as_by_hand():
    params = memory.count_parameters("gpt2", "gpt2")
    blocks, rest = gpt2_by_hand(12, 768)
    assert (memory.numel(params.blocks), memory.numel(params.rest)) == (blocks, rest)
    assert blocks + rest == 124_475_904 and params.n_layer == 12
    xl_blocks, xl_rest = gpt2_by_hand(48, 1600)
    xl = memory.count_parameters("gpt2-xl", "gpt2")
    assert (memory.numel(xl.blocks), memory.numel(xl.rest)) == (xl_blocks, xl_rest)


def test_one_rank_of_fsdp_holds_what_ddp_does():
    one = rows(world=1)
    for key in SHARDED:
        assert one[key][0] == one[key][1] > 0, key
    assert one["ddp_buckets"] == (0, None)  # a single process gets no DDP wrapper, so no buckets


def test_eight_ranks_of_fsdp_hold_an_eighth_each():
    n = sum(gpt2_by_hand(12, 768))
    eight = rows(world=8)
    assert eight["weights"] == eight["gradients"] == (4 * n, 4 * n // 8)
    assert eight["optimizer"] == (8 * n, 8 * n // 8)  # AdamW's two moments
    assert eight["ddp_buckets"] == (4 * n, None)
    blocks, rest = gpt2_by_hand(12, 768)
    assert eight["fsdp_gathered"] == (None, 4 * rest + 2 * 2 * blocks // 12)  # the root in fp32, two blocks in bf16
    assert eight["bf16_copies"] == (2 * n, 2 * rest)  # autocast's, of every weight; under FSDP the root's alone
    assert eight["model_state"] == (22 * n, 2 * n + 6 * rest + 4 * blocks // 12)


def test_the_modern_recipe_keeps_one_state_per_block_parameter_and_two_per_embedding_and_head_parameter():
    params = memory.count_parameters("gpt2", "modern")
    blocks, rest = 12 * 12 * 768 * 768, 2 * V * 768  # no biases, norms without gains, no position table; untied head
    assert (memory.numel(params.blocks), memory.numel(params.rest)) == (blocks, rest)
    modern = rows(recipe="modern")
    assert modern["optimizer"] == (4 * blocks + 8 * rest, (4 * blocks + 8 * rest) // 8)
    assert modern["weights"][0] == 4 * (blocks + rest)


def test_accumulation_adds_the_unsharded_gradients_to_fsdp_only():
    n = sum(gpt2_by_hand(12, 768))
    single, accumulating = rows(accumulation=1), rows(accumulation=8)
    assert single["fsdp_accumulation"] == (None, 0) and accumulating["fsdp_accumulation"] == (None, 4 * n)
    assert accumulating["model_state"] == (single["model_state"][0], single["model_state"][1] + 4 * n)
    assert {k: v for k, v in single.items() if k not in ("fsdp_accumulation", "model_state")} == \
        {k: v for k, v in accumulating.items() if k not in ("fsdp_accumulation", "model_state")}


@pytest.mark.parametrize("recipe", ["gpt2", pytest.param("modern", marks=needs_muon)])
def test_the_activations_are_what_the_compiled_step_saves(recipe):
    """The recipe's saved_per_token, the activation estimate's bytes per token, against a count of what the compiled
    bf16 step saves for its backward (saved_per_token: AOTAutograd's partitioner, as inductor's, on a small model);
    and its saved_per_token_eager, the CPU's estimate's, against what the eager fp32 step saves."""
    figures = memory.RECIPES[recipe].memory
    assert memory.saved_per_token(recipe) == pytest.approx(figures.saved_per_token, abs=0.5)
    assert memory.saved_per_token(recipe, compiled=False) == pytest.approx(figures.saved_per_token_eager, abs=0.5)


def test_the_estimate_of_the_default_step_is_within_5_percent_of_its_measured_peaks():
    """GPT-2 124M at B=64 on one H100 80GB (torch 2.11, the README's Speed section): 28.95 GiB measured with DDP's
    layout (one process, the loss's gradient written over the logits), 27.93 with --fsdp (measured before that
    change, which --fsdp's graphs did not need: they held no second copy)."""
    _, rows = memory.memory_rows(memory.parse_args(["--model", "gpt2", "--world-size", "1", "--batch-size", "64",
                                                    "--accumulation-steps", "8"]))
    ddp, fsdp = (total / 2**30 for total in rows["total"])
    assert ddp == pytest.approx(28.95, rel=0.05) and fsdp == pytest.approx(27.93, rel=0.05)


def test_prints_the_table_for_gpt2_xl_on_eight_gpus(capsys, tmp_path):
    code, out, err = run_memory(["--json", tmp_path / "memory.json"], capsys)  # the defaults: gpt2-xl, 8 ranks, B=2
    assert code == 0 and err == "", err
    lines = out.splitlines()
    assert lines[0].startswith("gpt2-xl, --recipe gpt2: 1,557,686,400 parameters, 1,475,558,400 in 48 blocks")
    table = {line[:44].strip(): line[44:].split() for line in lines[lines.index("") + 1:] if line[:44].strip()}
    n = sum(gpt2_by_hand(48, 1600))
    assert table["GiB per rank"] == ["DDP", "FSDP"]
    assert table["weights (fp32)"] == [f"{4 * n / 2**30:.2f}", f"{4 * n / 8 / 2**30:.2f}"] == ["5.80", "0.73"]
    assert table["DDP's gradient buckets (fp32)"] == ["5.80", "-"]
    # 36*C bytes per token per layer and 6*C outside them, the same for both
    assert table["activations saved for the backward"] == [f"{(36 * 48 + 6) * 1600 * 2 * 1024 / 2**30:.2f}"] * 2
    bf16_logits = 2 * 1024 * V * 2
    assert table["bf16 logits (modern's DDP: and gradient)"] == [f"{bf16_logits / 2**30:.2f}"] * 2
    ddp, fsdp = (float(x) for x in table["total (estimate)"])
    assert 30 < ddp < 40 and fsdp < ddp / 3
    assert " ".join(table["fits in 40 GiB?"]) == f"yes, {40 - ddp:.1f} left yes, {40 - fsdp:.1f} left"
    saved = json.loads((tmp_path / "memory.json").read_text())
    assert saved["rows_bytes"]["weights"] == {"ddp": 4 * n, "fsdp": 4 * n // 8}
    assert saved["parameters"] == dict(zip(("blocks", "rest"), gpt2_by_hand(48, 1600)))
    assert saved["measured"] is None


def test_the_checkpoint_each_rank_writes_is_its_weights_and_optimizer_state(capsys, tmp_path):
    """GPT-2 124M's 12 bytes a parameter, counted by hand (fp32 weights and AdamW's two moments, the tied embedding
    once): all of them from DDP's rank 0, an eighth from each of FSDP's 8 ranks, a half from each rank of HSDP 4 x 2's
    first replica."""
    code, out, err = run_memory(["--model", "gpt2", "--shards", "2", "--json", tmp_path / "memory.json"], capsys)
    assert code == 0 and err == "", err
    lines = out.splitlines()
    table = {line[:44].strip(): line[44:].split() for line in lines[lines.index("") + 1:] if line[:44].strip()}
    n = sum(gpt2_by_hand(12, 768))
    assert table["checkpoint written per rank"] == [f"{12 * n / shards / 2**30:.2f}" for shards in (1, 8, 2)]
    saved = json.loads((tmp_path / "memory.json").read_text())["checkpoint_bytes_per_rank"]
    assert saved == {"ddp": 12 * n, "fsdp": 12 * n // 8, "hsdp": 12 * n // 2}


def test_the_trainer_runs_are_torchrun_commands_with_the_same_batch():
    args = memory.parse_args(["--model", "gpt2", "--world-size", "2", "--batch-size", "4", "--accumulation-steps", "3",
                              "--recipe", "modern"])
    ddp, fsdp = (memory.trainer_command(args, "data", "log", fsdp) for fsdp in (False, True))
    assert ddp[:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                       os.path.join(REPO, "train_gpt2.py")]
    assert fsdp == ddp + ["--fsdp"]
    flags = {flag: value for flag, value in zip(ddp, ddp[1:]) if flag.startswith("--")}  # each flag's next word
    assert flags["--total-batch-size"] == str(4 * 1024 * 2 * 3) and flags["--recipe"] == "modern"
    assert flags["--max-steps"] == str(memory.MEASURED_STEPS) and flags["--checkpoint-every"] == "0"


def test_the_peak_is_the_highest_of_the_logged_steps(tmp_path):
    log = tmp_path / "log.jsonl"
    records = [{"step": 0, "dt_ms": 1.0, "peak_mem_gb": 3.5}, {"step": 1, "dt_ms": 1.0, "peak_mem_gb": 4.25},
               {"step": 2, "dt_ms": 1.0, "peak_mem_gb": 4.0}, {"step": 3, "val_loss": 9.0}]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert memory.peak_from_log(str(log)) == 4.25
    assert memory.peak_from_log(str(tmp_path / "none.jsonl")) is None


def test_the_speed_is_the_median_step_after_the_untimed_ones(tmp_path):
    log = tmp_path / "log.jsonl"
    tok_per_sec = [10.0, 500.0, 90.0, 70.0, 80.0, 60.0]  # steps 0 and 1 (compiling, settling) are not timed
    records = [{"step": step, "dt_ms": 1.0, "tok_per_sec": t, "mfu": t / 1000} for step, t in enumerate(tok_per_sec)]
    log.write_text("".join(json.dumps(r) + "\n" for r in records + [{"step": 6, "val_loss": 9.0}]))
    assert memory.speed_from_log(str(log)) == {"tok_per_sec": 70.0, "mfu": 0.07}  # the lower median of 60-90
    assert memory.speed_from_log(str(tmp_path / "none.jsonl")) is None


def test_measured_lines_give_fsdps_speed_over_ddps_and_a_failed_runs_output():
    _, rows = memory.memory_rows(memory.parse_args(["--model", "gpt2", "--world-size", "1"]))
    ddp = {"peak_gib": 20.5, "tok_per_sec": 500_000.0, "mfu": 0.4}
    lines = memory.measured_lines(rows, {"ddp": ddp, "fsdp": {**ddp, "tok_per_sec": 480_000.0, "peak_gib": 21.25}})
    assert lines[2].split()[-2:] == ["20.50", "21.25"] and lines[3].split()[-2:] == ["500,000", "480,000"]
    assert lines[4].split()[-2:] == ["40.0%", "40.0%"] and lines[5] == "FSDP's tok/s over DDP's: 0.960"
    failed = memory.measured_lines(rows, {"ddp": ddp, "fsdp": "Traceback\ntorch.OutOfMemoryError: CUDA out of memory"})
    assert failed[2].split()[-2:] == ["20.50", "-"] and failed[5] == ""
    assert failed[-1] == "FSDP failed:\nTraceback\ntorch.OutOfMemoryError: CUDA out of memory"


def test_measure_without_cuda_is_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = check_usage_error(*run_memory(["--measure"], capsys), "--measure needs CUDA")
    assert "drop --measure" in line


@pytest.mark.parametrize("argv, fragment", [
    (["--world-size", "0"], "error: --world-size must be positive, not 0"),
    (["--model", "gpt3"], "argument --model: invalid choice: 'gpt3'"),
    (["--batch-size", "two"], "argument --batch-size: invalid int value: 'two'"),
    (["--seq-len", "2048"], "error: --seq-len 2048 is longer than the model's 1024 positions"),
])
def test_bad_flags_get_one_line_errors(argv, fragment, capsys):
    check_usage_error(*run_memory(argv, capsys), fragment)


@needs_muon
def test_muon_overhead_times_both_optimizers_under_torchrun(tmp_path):
    """benchmarks/muon_overhead.py on 2 CPU processes: a row for each optimizer and their difference, from rank 0."""
    result = run_script(["--device", "cpu", "--matrices", "3", "--shape", "8", "16", "--warmup-steps", "1",
                         "--timed-steps", "2"], cwd=tmp_path, nproc=2, timeout=120,
                        script=os.path.join(REPO, "benchmarks", "muon_overhead.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("3 matrices of 8 x 16 on 2 cpu process(es)") and len(lines) == 4
    whole, sharded, cost = (float(line.split()[-4]) for line in lines[1:])  # "... 1.23 ms per step"
    assert lines[1].startswith("torch.optim.Muon") and lines[2].startswith("ShardedMuon")
    # each of the three printed to 0.01 ms, so rounded by up to 0.005
    assert whole > 0 and sharded > 0 and cost == pytest.approx(sharded - whole, abs=0.0151)


# -----------------------------------------------------------------------------
# benchmarks/small_cards.py: the default run capped to smaller cards' memory, and where its memory goes



def test_the_blocks_alive_at_the_peak_are_summed_by_the_line_that_allocated_them():
    """A recorded history, written by hand: the peak is the most bytes alive at once (a block freed before it is not
    there), and each block counts for the deepest line of this repository that allocated it."""
    ours = [{"filename": os.path.join(REPO, "train_gpt2.py"), "line": 300, "name": "forward"}]
    theirs = [{"filename": "/torch/_inductor/output.py", "line": 9, "name": "call"}]
    frames = {"logits": theirs + ours, "grad": theirs, "weights": ours[:0] + [
        {"filename": os.path.join(REPO, "train_gpt2.py"), "line": 570, "name": "make_model"}]}
    trace = [{"action": "alloc", "addr": 1, "size": 100, "frames": frames["weights"]},
             {"action": "alloc", "addr": 2, "size": 60, "frames": frames["logits"]},
             {"action": "alloc", "addr": 3, "size": 50, "frames": frames["logits"]},
             {"action": "free_requested", "addr": 3},
             {"action": "free_completed", "addr": 3},
             {"action": "alloc", "addr": 4, "size": 70, "frames": frames["grad"]},  # the peak: 100 + 60 + 70
             {"action": "free_completed", "addr": 2},
             {"action": "alloc", "addr": 5, "size": 80, "frames": frames["logits"]}]  # 250, but 2 was freed first
    peak, blocks = small_cards.blocks_at_peak({"device_traces": [trace]})
    assert peak == 250
    trace.insert(7, {"action": "free_completed", "addr": 4})  # now 100 + 60 + 70 = 230 is the peak, before the free
    peak, blocks = small_cards.blocks_at_peak({"device_traces": [trace]})
    assert peak == 230
    assert blocks == [(100, "train_gpt2.py:570 make_model", 1), (70, "/torch/_inductor/output.py:9 call", 1),
                      (60, "train_gpt2.py:300 forward", 1)]


def test_small_cards_runs_the_trainer_and_reads_its_row(shards, tmp_path, capsys, forked_python_commands):
    """One run through the child that caps the memory (here the whole of a CPU, as only CUDA can be capped), read back
    as its row: the micro-batch from the log's start record, the median speed and first step from its steps."""
    args = small_cards.parse_args(["--run-capped", "0", "--steps", "3"])  # the child's parsing: no GPU needed
    args.trainer_args = TINY  # its flags after small_cards' own, so that they win
    row = small_cards.measure(0, shards, str(tmp_path), args)
    assert row["micro_batch"] == 4 and row["search_s"] is None and row["first_step_s"] > 0 and row["tok_per_sec"] > 0
    assert row["mfu"] is None  # a CPU's peak FLOPs are not known
    lines = small_cards.table([row, {"cap_gib": 22.0, "failed": "error: out of memory"}])
    assert lines[1].split()[:4] == ["the", "whole", "card", "4"] and lines[1].split()[-2] == "-"
    assert small_cards.table([{**row, "mfu": 0.375}])[1].split()[-2] == "37.5%"
    assert lines[2] == f"{'22 GiB (a 24 GB RTX 3090/4090)':<32} failed:\nerror: out of memory"


def test_small_cards_without_cuda_is_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_usage_error(*run_main([], capsys, small_cards.main), "caps a CUDA GPU's memory", "run it on a GPU machine")
