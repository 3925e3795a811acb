"""benchmarks/: the speed ladder end to end on a tiny CPU model (each rung a real train_gpt2.py run), and the
profiler."""
import json
import os
import re
import sys
import time
import types

import pytest
import torch

from helpers import REPO, process_stat, run_main, run_script, script_env

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import speed_ladder  # noqa: E402

MUON = hasattr(torch.optim, "Muon")  # the modern recipe's rung needs PyTorch 2.9; before, its row says it failed
CPU_RUNGS = ["1. fp32", "3. bf16 autocast", "5. flash attention", "6. vocab 50304", "8. micro-batch 8",
             "9. trainer defaults", "10. full loss", "11. micro-batch as given",
             *(["13. modern recipe"] if MUON else [])]
SCRIPTS = os.path.join(REPO, "tests", "scripts")
SKIPPED_RUNGS = ["2. TF32", "4. torch.compile", "7. fused AdamW", "12. FP8 head", "14. coordinate descent",
                 "15. max-autotune", "16. CUDA graphs"]


def run(script, *flags):
    return run_script(flags, REPO, timeout=300, script=os.path.join(REPO, "benchmarks", script))


def test_tiny_ladder_on_cpu(tmp_path, capsys, monkeypatch, forked_python_commands):
    """The whole ladder, run in this process: each rung's trainer forked by the fork server, in a session of its own;
    the rungs the CPU cannot run say why. The rungs past the defaults run on the defaults alone, ranked against them:
    on a CPU, the full loss and the micro-batch as given are its defaults, to the same losses."""
    for name in ("PYTHONUNBUFFERED", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"):  # the rungs' environment: the
        monkeypatch.setenv(name, script_env()[name])  # tests' scripts'
    code, out, err = run_main(["--tiny", "--device", "cpu", "--compile-modes", "--json", str(tmp_path / "ladder.json")],
                              capsys, main=speed_ladder.main)
    assert code == 0, err
    lines = out.splitlines()
    rows = {line[:26].strip(): line[26:] for line in lines if line.split(".")[0].isdigit()}
    assert sorted(rows) == sorted(CPU_RUNGS + SKIPPED_RUNGS + ([] if MUON else ["13. modern recipe"]))
    for name in CPU_RUNGS:  # B, launch ("3 s"), first step ("0.1 s"), ms/step, tok/s, MFU, peak GiB, speed-up, loss, Δ
        B, launch, _, first, _, ms, tok_per_sec, mfu, mem, speedup, loss, change = rows[name].split()
        number = int(name.split(".")[0])
        assert int(B) == (4 if number <= 7 else 8), rows[name]  # the lecture's, then ours
        assert float(launch) > 0 and float(first) > 0 and float(ms) > 0, rows[name]
        assert float(tok_per_sec.replace(",", "")) > 0 and 9 < float(loss) < 12, rows[name]
        assert (mfu, mem) == ("-", "-")  # both need CUDA
        assert speedup == "-" if name == CPU_RUNGS[0] else float(speedup.rstrip("x")) > 0
        assert (change == "-") == (number not in (10, 11)), rows[name]
    for name in SKIPPED_RUNGS:
        assert rows[name].strip().startswith("skipped: "), rows[name]
    assert lines[-1].startswith(f"CPU ({os.cpu_count()} cores) | torch {torch.__version__} | T=32, B as in each row | "
                                f"the ladder took ")

    saved = json.loads((tmp_path / "ladder.json").read_text())
    assert (saved["lecture_batch_size"], saved["batch_size"], saved["seq_len"], saved["n_layer"]) == (4, 8, 32, 2)
    rungs = {rung["key"]: rung for rung in saved["rungs"]}
    assert [rung["key"] for rung in saved["rungs"]] == speed_ladder.KEYS
    assert [key for key, rung in rungs.items() if rung["status"] == "skipped"] == [
        "tf32", "compile", "fused-adamw", "fp8-head", "coordinate-descent", "max-autotune", "cuda-graphs"]
    assert rungs["modern"]["status"] == ("ok" if MUON else "failed")
    # the lecture's rungs cumulative, compile staying off on the CPU; the speed-ups each on the defaults alone
    assert rungs["vocab"]["flags"] == ["--dtype", "bf16", "--no-compile", "--attn", "sdpa", "--vocab-size", "50304",
                                       "--no-fused-adamw", "--loss", "full"]
    assert rungs["micro-batch"]["flags"] == rungs["vocab"]["flags"] and rungs["defaults"]["flags"] == []
    assert rungs["full-loss"]["flags"] == ["--loss", "full"]
    assert rungs["given-batch"]["flags"] == ["--no-grow-batch-size"]
    assert rungs["modern"]["flags"] == ["--recipe", "modern"]
    for key in ("full-loss", "given-batch"):
        assert rungs[key]["loss_change"] == 0, rungs[key]
        assert rungs[key]["speedup"] == rungs[key]["tok_per_sec"] / rungs["defaults"]["tok_per_sec"]
    for rung in saved["rungs"][7:]:
        if rung["status"] == "ok":
            assert len(rung["timed_ms"]) == 2 and rung["ms_per_step"] in rung["timed_ms"] and rung["first_step_s"] > 0
    assert rungs["tf32"]["reason"] == "needs CUDA: TF32 is a mode of NVIDIA tensor cores"


def test_the_rungs_named_and_the_time_budget(tmp_path, capsys, monkeypatch):
    """--rungs runs those named, in the ladder's order; a rung starts only while --time-budget has time left, and
    gets what is left as its timeout. (The trainer is replaced: each run takes 1.1 s here.)"""
    timeouts = []

    def one_second_and_a_bit(settings, B, micro_batches, args, data_dir, log_dir, timeout, fit):
        timeouts.append(timeout)
        time.sleep(1.1)
        return {"micro_batch": B, "ms_per_step": 1.0, "tok_per_sec": 1.0, "mfu": None, "peak_mem_gib": None,
                "first_step_s": 1.0, "launch_s": 1.1, "timed_ms": [1.0], "loss": 10.0}

    monkeypatch.setattr(speed_ladder, "run_rung", one_second_and_a_bit)
    code, out, err = run_main(["--tiny", "--device", "cpu", "--rungs", "modern,defaults,fp8-head", "--time-budget",
                               "1"], capsys, main=speed_ladder.main)
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.split(".")[0].isdigit()]
    assert [row[:26].strip() for row in rows] == ["9. trainer defaults", "12. FP8 head", "13. modern recipe"]
    assert rows[1].endswith("skipped: needs CUDA: a GPU of compute capability 8.9 or later")
    assert rows[2].endswith("skipped: no time left of --time-budget 1 s") and timeouts == [1]
    code, _, err = run_main(["--tiny", "--rungs", "defaults,turbo"], capsys, main=speed_ladder.main)
    assert code == 2 and err.startswith("error: --rungs turbo: no such rung; the rungs are fp32, tf32, ")


def test_a_rung_is_stopped_once_its_steps_are_logged(tmp_path):
    log = tmp_path / "log.jsonl"
    command = [sys.executable, os.path.join(SCRIPTS, "trainer_that_logs_then_hangs.py"), str(log), "5"]
    t0 = time.perf_counter()
    steps = speed_ladder.train_until_logged(command, str(log), 5, str(tmp_path / "out.txt"), timeout=30)
    assert [r["step"] for r in steps] == [0, 1, 2, 3, 4] and time.perf_counter() - t0 < 15
    pids = [int(pid) for pid in (tmp_path / "log.jsonl.pids").read_text().split()]
    deadline = time.monotonic() + 5
    while any(process_stat(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(process_stat(pid) for pid in pids)  # the trainer and the workers it started: gone, or zombies
    log.unlink()
    steps = speed_ladder.train_until_logged(command, str(log), 6, str(tmp_path / "out.txt"), timeout=2)
    assert steps == "timed out after 2 s, at 5 of 6 steps"
    failing = [sys.executable, os.path.join(SCRIPTS, "trainer_out_of_memory.py")]
    assert speed_ladder.train_until_logged(failing, str(tmp_path / "none.jsonl"), 5, str(tmp_path / "out.txt"),
                                           timeout=30) == "CUDA out of memory. Tried to allocate 1 GiB"


def test_ladder_rejects_bad_input():
    result = run("speed_ladder.py", "--tiny", "--batch-size", "0")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --batch-size must be positive, not 0"


def test_profile_step_on_cpu(tmp_path):
    """Both recipes in one process (GPT-2's alone where torch has no Muon): a table and a trace of each, then a line of
    each whose shares are the table's own Self CPU column."""
    recipes = ["gpt2", "modern"] if MUON else ["gpt2"]
    result = run("profile_step.py", "--device", "cpu", "--n-layer", "2", "--n-head", "2", "--n-embd", "64",
                 "--batch-size", "2", "--seq-len", "16", "--vocab-size", "50257", "--warmup", "1", "--steps", "2",
                 "--top", "10", "--trace", str(tmp_path / "trace.json"), "--recipes", *recipes)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("sorted by self_cpu_time_total") == len(recipes)
    assert "aten::mm" in result.stdout and "Self CPU time total" in result.stdout
    for recipe in recipes:
        trace = tmp_path / (f"trace.{recipe}.json" if len(recipes) > 1 else "trace.json")
        events = json.loads(trace.read_text())["traceEvents"]
        assert sum(event.get("name") == "train_step" for event in events) == 2  # the profiled steps, marked
    summaries = result.stdout.strip().splitlines()[-len(recipes):]
    assert [line.split(":")[0] for line in summaries] == recipes
    table_mm = re.search(r"^ +aten::mm +([\d.]+)%", result.stdout, re.M).group(1)  # GPT-2's table comes first
    summed_up = re.search(r" ms a step; the most: .*aten::mm ([\d.]+)%", summaries[0]).group(1)
    assert abs(float(summed_up) - float(table_mm)) <= 0.056  # one rounded to 0.1, the other to 0.01


def test_the_profiles_summary_on_a_gpu_counts_the_kernels_alone():
    """With CUDA, kineto gives a CPU operation its kernels' device time, and each kernel is an event of its own: the
    summary's total and ranking are the kernels' alone (as the table's own total is), not each kernel twice."""
    import profile_step
    from torch.autograd import DeviceType

    def event(key, device, us, annotation=False):
        return types.SimpleNamespace(key=key, device_type=device, self_device_time_total=us,
                                     is_user_annotation=annotation)

    averages = [event("aten::mm", DeviceType.CPU, 600), event("sm90_gemm", DeviceType.CUDA, 600),
                event("train_step", DeviceType.CUDA, 1000, annotation=True),
                event("triton_fused", DeviceType.CUDA, 200)]
    line = profile_step.largest_shares(averages, "self_device_time_total", steps=2)
    assert line == "0.4 ms a step; the most: sm90_gemm 75.0%, triton_fused 25.0%"  # 800 us over 2 steps


def test_profile_step_reports_bad_flags():
    result = run("profile_step.py", "--device", "cpu", "--n-embd", "65", "--n-head", "2")
    assert result.returncode != 0
    assert result.stderr.strip() == "error: --n-embd 65 must be a multiple of --n-head 2"


def test_the_gpu_check_plans_its_parts_and_tables_what_they_measured(tmp_path, capsys, monkeypatch):
    """benchmarks/gpu_check.py: its commands in order (--dry-run); refused without CUDA; and on a GPU (its parts
    replaced by their outputs' shapes, each taking 100 s of a clock of its own), one table of what each measured,
    the parts with no time left named for the next call."""
    import gpu_check

    code, out, _ = run_main(["--dry-run"], capsys, main=gpu_check.main)
    first_call = ["tests", "ladder", "modern-peak", "profiles", "core-all", "compile-modes"]
    assert code == 0 and [line.split(" ")[0] for line in out.splitlines()] == first_call
    assert "--rungs defaults,full-loss,given-batch,fp8-head" in out.splitlines()[1]
    code, out, _ = run_main(["--dry-run", "--parts", "recipes-124m"], capsys, main=gpu_check.main)
    assert code == 0 and out.startswith("recipes-124m (at most 300 s): ") and "recipes_124m.py --budget 280" in out
    if not torch.cuda.is_available():
        code, _, err = run_main([], capsys, main=gpu_check.main)
        assert code == 2 and err.startswith("error: gpu_check.py measures a CUDA GPU, and PyTorch sees none here")
    now = [0.0]
    outputs = {
        "tests": "...........\n10 passed in 61.02s\n",
        "ladder": "the ladder's table\n",
        "core-all": "gpt2 shapes\nours, 91,037 examples (all a task), 65,536 tokens a pass: first 30.0 s, then 90.0 s: "
                    "1,011.5 examples/s; CORE 0.0100\nplain, ...\n",
        "modern-peak": "the card's table\n",
        "profiles": "modern's table\nmodern: 152.0 ms a step; the most: aten::mm 41.0%, triton_red_fused 9.0%\n"
                    "gpt2's table\ngpt2: 120.5 ms a step; the most: aten::mm 50.0%\n"  # each line, then both again
                    "modern: 152.0 ms a step; the most: aten::mm 41.0%, triton_red_fused 9.0%\n"
                    "gpt2: 120.5 ms a step; the most: aten::mm 50.0%\n",
        "recipes-124m": "the curves\nGPT-2's final val loss 3.2000: the modern recipe reaches it after 20,000,000 "
                        "tokens (64% of GPT-2's)\n",
    }
    modern_peak = {"rows": [{"cap_gib": 0, "micro_batch": 64, "search_s": None, "first_step_s": 30.5,
                             "tok_per_sec": 416480.0, "mfu": 0.36, "peak_gib": 31.25}]}
    ladder = {"rungs": [
        {"rung": "9. trainer defaults", "status": "ok", "micro_batch": 64, "tok_per_sec": 466568.0, "mfu": 0.403,
         "peak_mem_gib": 28.95, "launch_s": 35.2, "first_step_s": 21.0, "loss": 10.9794, "speedup": None,
         "loss_change": None},
        {"rung": "12. FP8 head", "status": "failed", "reason": "CUDA out of memory"}]}

    def part_run(part, out, seconds, cpu):
        now[0] += 100
        if part.name == "ladder":
            (tmp_path / "ladder.json").write_text(json.dumps(ladder))
        if part.name == "modern-peak":
            (tmp_path / "modern_peak.json").write_text(json.dumps(modern_peak))
        return ("failed: exit 1" if part.name == "core-all" else "done"), 100.0, outputs[part.name]

    monkeypatch.setattr(gpu_check, "run_part", part_run)
    monkeypatch.setattr(gpu_check, "time", type("Clock", (), {"monotonic": staticmethod(lambda: now[0])}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    code, out, err = run_main(["--out", tmp_path, "--budget", "520"], capsys, main=gpu_check.main)
    assert code == 0, err
    table = out.splitlines()[-9:]
    assert table[0].startswith(f"NVIDIA H100 80GB HBM3, torch {torch.__version__}, commit ") and \
        table[0].endswith(": 500 s of --budget 520")
    assert [line.split("  ")[0].strip() for line in table[1:]] == [
        "tests/test_cuda.py", "ladder: 9. trainer defaults", "ladder: 12. FP8 head", "modern recipe, whole card",
        "profile, modern", "profile, gpt2", "CORE, every example", "compile modes"], table
    assert table[1].endswith("10 passed in 61.02s [100 s]")
    assert "B 64 | 466,568 tok/s | MFU 40.3% | 28.95 GiB | launch 35 s, 1st step 21.0 s | loss 10.9794" in table[2]
    assert table[3].endswith("failed: CUDA out of memory")
    assert table[4].endswith("B 64 | 416,480 tok/s | MFU 36.0% | 31.25 GiB | 1st step 30.5 s [100 s]")
    assert table[5].endswith("  152.0 ms a step; the most: aten::mm 41.0%, triton_red_fused 9.0% [100 s]")
    assert table[6].endswith("  120.5 ms a step; the most: aten::mm 50.0%")  # each recipe's row once
    assert "  failed: exit 1: ours, 91,037 examples (all a task)" in table[7]  # what it printed, with its status
    assert table[8].endswith("not run: no time left of --budget 520 s (--parts compile-modes)")
    assert (tmp_path / "table.txt").read_text().splitlines() == table
    code, out, err = run_main(["--out", tmp_path, "--parts", "recipes-124m"], capsys, main=gpu_check.main)
    assert code == 0 and out.splitlines()[-1].startswith("GPT-2 against the modern recipe at 124M  GPT-2's final val "
                                                         "loss 3.2000: the modern recipe reaches it after 20,000,000 ")


def test_every_part_of_the_gpu_check_starts_alone_on_the_cpu(tmp_path, capsys, forked_python_commands):
    """gpu_check.py --cpu: each part's command as the GPU call runs it, in a process of its own that imports this
    project's modules afresh (forked by the tests' fork server, which holds torch, numpy and tiktoken imported, but
    nothing of ours: a module of ours that fails to import, alone, fails here), with the flags of its CPU pass; each
    ends well."""
    import gpu_check

    code, out, err = run_main(["--cpu", "--out", tmp_path], capsys, main=gpu_check.main)
    assert code == 0, out + err
    table = (tmp_path / "table.txt").read_text().splitlines()
    assert table[0].startswith("CPU pass, torch "), table
    assert not [line for line in table if "failed" in line or "timed out" in line or "not run" in line], table
    parts = {line.split("  ")[0].split(":")[0].strip() for line in table[1:]}
    assert parts == {"tests/test_cuda.py", "ladder", "CORE, every example", "modern recipe, whole card",
                     "profile", "compile modes"}, table
    assert re.search(r"tests/test_cuda.py +\d+ skipped in", table[1]), table[1]  # every CUDA test collected, skipped
    for part in ("ladder", "modern recipe", "compile modes"):  # each run's command, read by the trainer's parser
        assert any(line.startswith(part) and "python train_gpt2.py --data" in line for line in table), table
    assert sum("dry run: gpt2 shapes" in line for line in table) == 1, table
    profiles = (tmp_path / "profiles.txt").read_text()  # both recipes' flags read
    assert re.search(r"dry run: recipe modern, 12 layers.*dry run: recipe gpt2, 12 layers", profiles, re.S), profiles


def test_loss_memory_on_cpu(capsys):
    """benchmarks/loss_memory.py, eager on a small case (its peaks, a few MiB, are noise here): a line for each loss,
    and the same loss."""
    import loss_memory

    code, out, err = run_main(["--device", "cpu", "--no-compile", "--rows", "1024", "--width", "16", "--vocab", "2048",
                               "--chunk-rows", "512", "--steps", "1"], capsys, main=loss_memory.main)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("1024 rows x width 16 x vocab 2048, chunks of 512 rows, bf16 autocast, compile False")
    losses = {line.split()[0]: float(line.split()[-1]) for line in lines[1:]}
    assert list(losses) == ["full", "chunked"] and losses["chunked"] == pytest.approx(losses["full"], rel=1e-6)
