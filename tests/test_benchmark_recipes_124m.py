"""benchmarks/recipes_124m.py: the packages' text as jsonl, the curves read from a log by hand, a trainer stopped by
the budget, and the whole path at a tiny size: fineweb.py's shards, then both recipes trained on them."""
import json
import math
import os
import re
import signal
import sys

import pytest

from helpers import REPO, needs_muon, run_main

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import recipes_124m  # noqa: E402


def test_the_packages_text_is_written_as_jsonl_in_a_fixed_random_order(tmp_path, monkeypatch):
    sources = tmp_path / "sources"
    sources.mkdir()
    texts = {f"m{i:02d}.py": f"def f{i}():\n    return {i}\n" * (i + 1) for i in range(30)}
    for name, text in texts.items():
        (sources / name).write_text(text)
    (sources / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))  # not UTF-8: left out
    monkeypatch.setattr(recipes_124m, "package_files", lambda: sorted(str(p) for p in sources.iterdir()))
    monkeypatch.setattr(recipes_124m, "JSONL_BYTES", 200)  # several jsonl files

    def written(directory, max_bytes):
        files, size = recipes_124m.write_text(directory, max_bytes)
        lines = [json.loads(line) for path in sorted(directory.iterdir()) for line in path.read_text().splitlines()]
        return files, size, [line["text"] for line in lines], len(list(directory.iterdir()))

    files, size, order, parts = written(tmp_path / "all", 10**9)
    assert files == 30 and sorted(order) == sorted(texts.values()) and size == sum(map(len, texts.values()))
    assert order != list(texts.values()) and parts > 1  # shuffled, and split across files
    assert written(tmp_path / "again", 10**9)[2] == order  # the same order each time
    files, size, some, _ = written(tmp_path / "some", 300)
    assert some == order[:files] and size >= 300 and size - len(some[-1]) < 300  # stops once max_bytes is written


def write_log(log_dir, records):
    log_dir.mkdir()
    (log_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 9, "tr')


def test_a_curve_is_read_from_the_log_with_the_first_step_at_the_median_steps_time(tmp_path):
    steps = [dict(step=s, tokens=(s + 1) * 100, train_loss=5.0, dt_ms=ms, tok_per_sec=100_000 / ms, mfu=m,
                  peak_mem_gb=g) for s, ms, m, g in ((0, 30000, 0.01, 1.5), (1, 100, 0.4, 2.0), (2, 300, 0.2, 2.5),
                                                     (3, 200, 0.3, 3.0))]
    vals = [dict(step=0, tokens=0, val_loss=10.8), dict(step=2, tokens=200, val_loss=7.0),
            dict(step=4, tokens=400, val_loss=6.0)]
    write_log(tmp_path / "log", [vals[0], *steps[:2], vals[1], *steps[2:], vals[2]])  # then a half-written line
    curve = recipes_124m.read_curve(tmp_path / "log" / "log.jsonl")
    # steps 1-3 took 0.1, 0.3 and 0.2 s: the median 0.2 s stands for step 0's 30 s of compiling
    assert curve["vals"] == [(0, 0, 0.0, 10.8), (2, 200, pytest.approx(0.3), 7.0), (4, 400, pytest.approx(0.8), 6.0)]
    # the median step's speed and MFU, step 0's left out; the peak memory the run's, the last step's running maximum
    assert (curve["tok_per_sec"], curve["mfu"], curve["peak_gib"]) == (500, 0.3, 3.0)


def test_the_modern_recipes_share_of_tokens_and_seconds_by_hand():
    gpt2 = dict(vals=[(0, 0, 0.0, 11.0), (10, 1000, 10.0, 6.0), (20, 2000, 20.0, 5.0)])
    modern = dict(vals=[(0, 0, 0.0, 10.8), (10, 1000, 12.0, 5.5), (20, 2000, 24.0, 4.5)])
    c = recipes_124m.compare(gpt2, modern)
    # 5.0 is half-way from 5.5 (1000 tokens, 12 s) to 4.5 (2000 tokens, 24 s)
    assert (c["target"], c["tokens"], c["seconds"]) == (5.0, 1500, 18.0)
    # at GPT-2's 2000 tokens: 4.5; at its 20 s, 2/3 of the way from 12 s to 24 s: 5.5 - 2/3
    assert c["loss_at_tokens"] == 4.5 and c["loss_at_seconds"] == pytest.approx(5.5 - 2 / 3)
    slower = dict(vals=[(0, 0, 0.0, 10.8), (10, 1000, 30.0, 5.5)])
    c = recipes_124m.compare(gpt2, slower)
    assert (c["tokens"], c["seconds"], c["loss_at_tokens"]) == (None, None, None)
    assert c["loss_at_seconds"] == pytest.approx(10.8 - 5.3 * 20 / 30)  # 20 s of its 0 to 30 s
    lines = recipes_124m.report(dict(gpt2=dict(gpt2, tok_per_sec=100.0, mfu=None, peak_gib=None),
                                     modern=dict(slower, tok_per_sec=80.0, mfu=0.25, peak_gib=3.5)), c,
                                dict(fineweb="done", gpt2="done", modern="stopped after 30 s"))
    assert lines[-1] == "GPT-2's final val loss 5.0000: the modern recipe does not reach it in its run; its val loss " \
                        "is 7.2667 at GPT-2's seconds"
    assert lines[-2] == "modern (stopped after 30 s): val loss 5.5000 at step 10 (1,000 tokens, 30.0 s of " \
                        "training); 80 tok/s, MFU 25.0%, peak 3.50 GiB"
    assert lines[3] == "   20        2,000      5.0000      20.0                      "


def test_a_command_past_its_time_is_stopped_as_ctrl_c_stops_it(tmp_path):
    script = "import signal, sys, time\nsignal.signal(signal.SIGINT, lambda *_: sys.exit(7))\ntime.sleep(60)\n"
    status = recipes_124m.run_command([sys.executable, "-c", script], tmp_path / "out.txt", 1)
    assert status == "stopped after 1 s"
    assert recipes_124m.run_command([sys.executable, "-c", "exit(3)"], tmp_path / "out.txt", 30) == "failed: exit 3"


def test_a_command_goes_with_the_benchmark_interrupted(tmp_path, monkeypatch):
    """Ctrl-C to this script (or gpu_check.py's stop of its part, which reaches this process's group, not the
    command's session) kills the command at once: no trainer is left holding the GPU."""
    script = "import os, time\nopen(os.environ['PID_FILE'], 'w').write(str(os.getpid()))\ntime.sleep(60)\n"
    monkeypatch.setenv("PID_FILE", str(tmp_path / "pid"))

    def ctrl_c(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, ctrl_c)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        with pytest.raises(KeyboardInterrupt):
            recipes_124m.run_command([sys.executable, "-c", script], tmp_path / "out.txt", 30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    with pytest.raises(ProcessLookupError):  # killed, and reaped
        os.kill(int((tmp_path / "pid").read_text()), 0)


@needs_muon
def test_both_recipes_on_shards_of_the_packages_text(tmp_path, capsys, forked_python_commands):
    work = tmp_path / "work"
    work.mkdir()
    code, out, err = run_main(["--cpu", "--steps", "2", "--total-batch-size", "128", "--evals", "1", "--val-tokens",
                               "128", "--workers", "1", "--out", tmp_path / "out", "--work", work, "--",
                               "--batch-size", "4", "--seq-len", "32", "--block-size", "32"], capsys,
                              main=recipes_124m.main)  # after --: both trainers' flags
    assert code == 0, out + err
    assert os.listdir(work) == []  # the text, shards and checkpoints gone
    assert sorted(os.listdir(tmp_path / "out")) == ["fineweb.txt", "gpt2.txt", "log_gpt2.jsonl", "log_modern.jsonl",
                                                    "modern.txt", "recipes_124m.json"]
    made = (tmp_path / "out" / "fineweb.txt").read_text()
    assert re.search(r"\(1 val \+ [1-9]\d* train\)", made), made  # the validation shard held out
    for recipe in ("gpt2", "modern"):
        assert f"--data {work}" in (tmp_path / "out" / f"{recipe}.txt").read_text()  # the flags-given line
    saved = json.loads((tmp_path / "out" / "recipes_124m.json").read_text())
    assert saved["statuses"] == {"fineweb": "done", "gpt2": "done", "modern": "done"}
    assert saved["training_tokens"] == 2 * 128 and "warning" not in out  # each token trained on once
    curves = saved["curves"]
    assert [[step for step, *_ in curves[r]["vals"]] for r in ("gpt2", "modern")] == [[0, 2], [0, 2]]
    assert curves["modern"]["vals"][0][3] == pytest.approx(math.log(50257), abs=1e-3)  # a zero head: uniform
    assert 9 < curves["gpt2"]["vals"][0][3] < 11.5 and curves["gpt2"]["vals"][-1][1] == 2 * 128
    assert out.splitlines()[-1].startswith(f"GPT-2's final val loss {curves['gpt2']['vals'][-1][3]:.4f}: the modern "
                                           f"recipe ")
    assert saved["lines"] == out.splitlines()[-len(saved["lines"]):]
