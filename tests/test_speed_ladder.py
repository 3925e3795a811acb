"""benchmarks/: the speed ladder end to end on a tiny CPU model (each rung a real train_gpt2.py run), and the
profiler."""
import json
import os
import sys
import time

import torch

from helpers import REPO, process_stat, run_main, run_script, script_env

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import speed_ladder  # noqa: E402

MUON = hasattr(torch.optim, "Muon")  # the modern recipe's rung needs PyTorch 2.9; before, its row says it failed
CPU_RUNGS = ["1. fp32", "3. bf16 autocast", "5. flash attention", "6. vocab 50304", "8. micro-batch 8",
             "9. chunked loss", "10. trainer defaults"] + (["11. modern recipe"] if MUON else [])
SCRIPTS = os.path.join(REPO, "tests", "scripts")
SKIPPED_RUNGS = ["2. TF32", "4. torch.compile", "7. fused AdamW"]


def run(script, *flags):
    return run_script(flags, REPO, timeout=300, script=os.path.join(REPO, "benchmarks", script))


def test_tiny_ladder_on_cpu(tmp_path, capsys, monkeypatch, forked_python_commands):
    """The ladder, run in this process: each rung's trainer forked by the fork server, in a session of its own."""
    for name in ("PYTHONUNBUFFERED", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"):  # the rungs' environment: the
        monkeypatch.setenv(name, script_env()[name])  # tests' scripts'
    code, out, err = run_main(["--tiny", "--device", "cpu", "--json", str(tmp_path / "ladder.json")], capsys,
                              main=speed_ladder.main)
    assert code == 0, err
    lines = out.splitlines()
    rows = {line[:22].strip(): line[22:] for line in lines if line.split(".")[0].isdigit()}
    assert sorted(rows) == sorted(CPU_RUNGS + SKIPPED_RUNGS + ([] if MUON else ["11. modern recipe"]))
    for name in CPU_RUNGS:  # B, first step ("0.1 s"), ms/step, tok/s, MFU, peak mem, speed-up
        B, first, _, ms, tok_per_sec, mfu, mem, speedup = rows[name].split()
        assert int(B) == (4 if int(name.split(".")[0]) <= 7 else 8), rows[name]  # the lecture's rungs, then ours
        assert float(first) > 0 and float(ms) > 0 and float(tok_per_sec.replace(",", "")) > 0, rows[name]
        assert (mfu, mem) == ("-", "-")  # both need CUDA
        assert speedup == "-" if name == CPU_RUNGS[0] else float(speedup.rstrip("x")) > 0
    for name in SKIPPED_RUNGS:
        assert rows[name].strip().startswith("skipped: "), rows[name]
    assert lines[-1].startswith(f"CPU ({os.cpu_count()} cores) | torch {torch.__version__} | T=32, B as in each row | "
                                f"the ladder took ")

    saved = json.loads((tmp_path / "ladder.json").read_text())
    assert (saved["lecture_batch_size"], saved["batch_size"], saved["seq_len"], saved["n_layer"]) == (4, 8, 32, 2)
    rungs = saved["rungs"]
    assert [rung["status"] for rung in rungs] == ["ok", "skipped", "ok", "skipped", "ok", "ok", "skipped", "ok", "ok",
                                                  "ok", "ok" if MUON else "failed"]
    # cumulative: the vocab rung keeps bf16 and SDPA, and compile stays off on the CPU
    assert rungs[5]["flags"] == ["--dtype", "bf16", "--no-compile", "--attn", "sdpa", "--vocab-size", "50304",
                                 "--no-fused-adamw"]
    assert rungs[8]["flags"] == rungs[5]["flags"] + ["--loss", "chunked"] and rungs[8]["batch_size"] == 8
    assert rungs[9]["flags"] == []  # the trainer's own defaults
    assert rungs[10]["flags"] == ["--recipe", "modern"]  # on top of them
    for rung in rungs[8:]:
        assert len(rung["timed_ms"]) == 2 and rung["ms_per_step"] in rung["timed_ms"] and rung["first_step_s"] > 0
    assert rungs[1]["reason"] == "needs CUDA: TF32 is a mode of NVIDIA tensor cores"


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
    trace = tmp_path / "trace.json"
    result = run("profile_step.py", "--device", "cpu", "--n-layer", "2", "--n-head", "2", "--n-embd", "64",
                 "--batch-size", "2", "--seq-len", "16", "--vocab-size", "50257", "--warmup", "1", "--steps", "2",
                 "--top", "10", "--trace", str(trace))
    assert result.returncode == 0, result.stderr
    assert "sorted by self_cpu_time_total" in result.stdout
    assert "aten::mm" in result.stdout and "Self CPU time total" in result.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(event.get("name") == "train_step" for event in events) == 2  # the profiled steps, marked in the trace


def test_profile_step_reports_bad_flags():
    result = run("profile_step.py", "--device", "cpu", "--n-embd", "65", "--n-head", "2")
    assert result.returncode != 0
    assert result.stderr.strip() == "error: --n-embd 65 must be a multiple of --n-head 2"
