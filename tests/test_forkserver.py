"""The tests' fork server and its switch (TRAIN_GPT2_TESTS_FORKSERVER=0): a command run as a real process gives what
the forked one gives, its how options (limits, ignored signals, a new session, a private tmpfs) included; and the
switch takes 0 or 1 alone."""
import json
import os
import re
import signal
import subprocess
import sys

import pytest

import forkserver
from helpers import (
    REPO,
    TINY,
    assert_tensors_equal,
    checkpoint_path,
    load_ckpt,
    private_tmpfs,
    run_script,
    script_env,
)

compared = pytest.mark.skipif(not forkserver.FORK, reason=f"{forkserver.SWITCH}=0: the fork server is switched off, "
                                "and there is no forked command to compare")

TIMINGS = r"\d[\d.,]* ?(ms|tok/s|s)\b"  # a step's time and speed, a save's, the run's: all that differs by run
TIMING_KEYS = ("dt_ms", "tok_per_sec", "elapsed_s")


def both_ways(monkeypatch, run):
    """run() with the fork server on, then switched off: the two results."""
    results = []
    for fork in (True, False):
        monkeypatch.setattr(forkserver, "FORK", fork)
        results.append(run())
    return results


def python_c(code, tmp_path, **how):
    """`python -c code` in tmp_path: (exit code, stdout, stderr)."""
    result = forkserver.run([sys.executable, "-c", code], tmp_path, script_env(), 60, **how)
    return result.returncode, result.stdout, result.stderr


@compared
def test_a_tiny_training_run_is_the_same_in_a_real_process(shards, tmp_path, monkeypatch):
    def train():
        cwd = tmp_path / ("forked" if forkserver.FORK else "real")
        cwd.mkdir()
        result = run_script(TINY + ["--data", shards, "--log-dir", "log", "--max-steps", "1"], cwd)
        records = [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
                   for line in (cwd / "log" / "log.jsonl").read_text().splitlines()]
        return (result.returncode, re.sub(TIMINGS, "T", result.stdout), result.stderr,
                sorted(os.listdir(cwd / "log")), records, load_ckpt(checkpoint_path(cwd / "log", 1))["model"])

    forked, real = both_ways(monkeypatch, train)
    assert forked[0] == 0, forked[2][-3000:]
    assert forked[:5] == real[:5]
    assert_tensors_equal(forked[5], real[5])


# a write past RLIMIT_FSIZE fails with EFBIG, not SIGXFSZ's kill: python ignores that signal itself
@compared
@pytest.mark.parametrize("code, how, expected", [
    ("try: open('big', 'wb').write(b'x' * 100_000)\nfinally: print(__import__('os').path.getsize('big'))",
     {"limits": {"RLIMIT_FSIZE": (16384, 16384)}}, r"^16384\n.*OSError: \[Errno 27\] File too large\n$"),
    ("[open('/dev/null') for _ in range(64)]", {"limits": {"RLIMIT_NOFILE": (32, 32)}},
     r"OSError: \[Errno 24\] Too many open files"),
    ("import signal; print(signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN)", {"ignore": ("SIGUSR1",)}, "^True\n$"),
    ("import os; print(os.getsid(0) == os.getpid())", {"start_new_session": True}, "^True\n$"),
    ("import os; print(os.getsid(0) == os.getpid())", {}, "^False\n$"),
])
def test_a_limit_an_ignored_signal_or_a_session_is_the_same_in_a_real_process(code, how, expected, tmp_path,
                                                                              monkeypatch):
    forked, real = both_ways(monkeypatch, lambda: python_c(code, tmp_path, **how))
    assert forked == real
    assert re.search(expected, forked[1] + forked[2], re.S)


@compared
@pytest.mark.parametrize("killed", [False, True])
def test_a_private_tmpfs_is_the_same_in_a_real_process(killed, tmp_path, monkeypatch):
    mount = tmp_path / "mount"
    tmpfs = private_tmpfs(mount, "size=8k", before="echo before > first")
    end = "os.kill(os.getpid(), signal.SIGTERM)" if killed else "open(mount + '/second', 'w').write('x' * 20_000)"
    code = f"import os, signal; mount = {str(mount)!r}; print(os.listdir(mount), flush=True); {end}"
    forked, real = both_ways(monkeypatch, lambda: python_c(code, tmp_path, tmpfs=tmpfs))
    assert forked == real
    if killed:  # no listing: the process ended before it could run after
        assert forked == (-signal.SIGTERM, "['first']\n", "")
    else:
        assert forked[0] == 1 and forked[2].endswith("OSError: [Errno 28] No space left on device\n")
        assert forked[1].splitlines() == ["['first']", "", "first second "]  # then after's listing of the mount
    assert os.listdir(mount) == []  # the mount was the process's own


@compared
def test_a_real_process_starts_with_sigint_as_python_sets_it_whatever_the_tests_process_made_of_it(tmp_path,
                                                                                                  monkeypatch):
    """A shell's background job (CI's, maybe) ignores SIGINT, and its children would inherit that: a test's SIGINT
    must still raise KeyboardInterrupt in its command."""
    code = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forked, real = both_ways(monkeypatch, lambda: python_c(code, tmp_path))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert forked == real == (0, "True\n", "")


@compared
def test_a_signal_ends_a_real_process_as_it_ends_a_forked_one(tmp_path, monkeypatch):
    def signalled():
        code = "import time; print('ready', flush=True); time.sleep(60)"
        process = forkserver.Process([sys.executable, "-c", code], tmp_path, script_env(), stdout=subprocess.PIPE,
                                     text=True)
        ready = process.stdout.readline()
        process.send_signal(signal.SIGTERM)
        return ready, process.wait(30), process.communicate()

    forked, real = both_ways(monkeypatch, signalled)
    assert forked == real == ("ready\n", -signal.SIGTERM, ("", None))


# what a torchrun worker sees of itself, written to rank<RANK>.json. torch imported before the script ran tells a
# forked worker (the server imported it) from an exec'd one, which imports none: it would cost 3 s of CPU a worker
WORKER = """import json, os, sys
seen = {"argv": sys.argv[1:], "path0": sys.path[0] == os.path.dirname(os.path.abspath(__file__)),
        "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS", "MINE")},
        "cwd": os.getcwd(), "unbuffered": sys.stdout.write_through, "own_session": os.getsid(0) == os.getpid(),
        "forked": "torch" in sys.modules}
if seen["forked"]:  # the forked workers meet in a process group, as the trainer's ranks do
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1]); dist.all_reduce(total)
    seen["sum"] = int(total)
    dist.destroy_process_group()
sys.stderr.write(f"rank {os.environ['RANK']} to stderr\\n")  # one write: the ranks share the file
open(f"rank{os.environ['RANK']}.json", "w").write(json.dumps(seen))
"""


@compared
def test_torchruns_workers_forked_are_what_its_real_workers_are(tmp_path):
    """The launcher forks its workers from the server, unless real_workers: each sees the same argv, sys.path,
    environment, directory, unbuffered streams and session, and writes its stderr to the launcher's; the forked ones
    meet in a process group."""
    (tmp_path / "worker.py").write_text(WORKER)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "worker.py", "a b"]
    env = {k: v for k, v in script_env(MINE="x").items() if k != "PYTHONUNBUFFERED"}  # torchrun's -u alone
    seen = {}
    for real in (False, True):
        result = forkserver.run(command, tmp_path, env, 120, real_workers=real)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert sorted(line for line in result.stderr.splitlines() if " to stderr" in line) == \
            ["rank 0 to stderr", "rank 1 to stderr"]
        seen[real] = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, (forked, exec_d) in enumerate(zip(seen[False], seen[True])):
        assert forked.pop("forked") and not exec_d.pop("forked") and forked.pop("sum") == 3
        assert forked == exec_d == {"argv": ["a b"], "path0": True, "cwd": str(tmp_path), "unbuffered": True,
                                    "own_session": True, "env": {"RANK": str(rank), "LOCAL_RANK": str(rank),
                                                                 "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
                                                                 "MINE": "x"}}


def test_the_switch_takes_0_or_1_and_refuses_anything_else():
    """Any other value stops the tests as they import the server's module, in a line that names both: a misspelt "off"
    (or "false", or "") taken for on would fork each command where real processes were asked for."""
    def imported_with(value):
        env = {k: v for k, v in script_env(PYTHONPATH=os.path.join(REPO, "tests")).items() if k != forkserver.SWITCH}
        env.update({} if value is None else {forkserver.SWITCH: value})
        result = subprocess.run([sys.executable, "-c", "import forkserver; print(forkserver.FORK)"], env=env,
                                capture_output=True, text=True, timeout=60)
        return result.returncode, result.stdout, (result.stderr.strip().splitlines() or [""])[-1]

    for value, on in (("1", True), (None, True), ("0", False)):
        assert imported_with(value) == (0, f"{on}\n", "")
    for value in ("off", "false", "", " 1"):
        assert imported_with(value) == (1, "", f"ValueError: {forkserver.SWITCH}={value!r}: 1 (or unset) forks each "
                                               "command from the tests' fork server, 0 starts each as a real process")
