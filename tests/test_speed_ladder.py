"""benchmarks/: the speed ladder end to end on a tiny CPU model (each rung a real train_gpt2.py run), and the profiler."""
import json
import os
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_RUNGS = ["1. fp32", "3. bf16 autocast", "5. flash attention", "6. vocab 50304"]
SKIPPED_RUNGS = ["2. TF32", "4. torch.compile", "7. fused AdamW"]


def run(script, *flags):
    return subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", script), *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_tiny_ladder_on_cpu(tmp_path):
    result = run("speed_ladder.py", "--tiny", "--device", "cpu", "--json", str(tmp_path / "ladder.json"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    rows = {line[:20].strip(): line[20:] for line in lines if line[:2] in {f"{n}." for n in range(1, 8)}}
    assert list(rows) == sorted(CPU_RUNGS + SKIPPED_RUNGS)
    for name in CPU_RUNGS:  # ms/step, tok/s, MFU, peak mem, speed-up
        ms, tok_per_sec, mfu, mem, speedup = rows[name].split()
        assert float(ms) > 0 and float(tok_per_sec.replace(",", "")) > 0, rows[name]
        assert (mfu, mem) == ("-", "-")  # both need CUDA
        assert speedup == "-" if name == CPU_RUNGS[0] else float(speedup.rstrip("x")) > 0
    for name in SKIPPED_RUNGS:
        assert rows[name].strip().startswith("skipped: "), rows[name]
    assert lines[-1] == f"CPU ({os.cpu_count()} cores) | torch {torch.__version__} | batch 4 x 32 = 128 tokens per step"

    saved = json.loads((tmp_path / "ladder.json").read_text())
    assert (saved["batch_size"], saved["seq_len"], saved["n_layer"]) == (4, 32, 2)
    statuses = [rung["status"] for rung in saved["rungs"]]
    assert statuses == ["ok", "skipped", "ok", "skipped", "ok", "ok", "skipped"]
    last = saved["rungs"][5]  # cumulative: the vocab rung keeps bf16 and SDPA, and compile stays off on the CPU
    assert last["flags"] == ["--dtype", "bf16", "--no-compile", "--attn", "sdpa", "--vocab-size", "50304", "--no-fused-adamw"]
    assert len(last["timed_ms"]) == 2 and last["ms_per_step"] in last["timed_ms"]


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
