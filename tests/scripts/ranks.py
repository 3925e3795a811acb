"""Runs a script in N processes, as `torchrun --standalone --nproc_per_node=N` starts them for these tests (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), but forked from one interpreter that has imported
the trainer's modules once: torchrun's launcher and each of its workers import torch again, 2 to 3 s of CPU each on
the 2-core test machines, most of a tiny run's cost. What a rank runs is the same; the process group's store is rank
0's instead of torchrun's agent's. Tests of torchrun itself (its report of a failure, its signals, several nodes) run
torchrun. N may also be the sizes of several nodes, "1,1": each rank then gets its node's LOCAL_RANK,
LOCAL_WORLD_SIZE and GROUP_RANK, as torchrun's launchers with --nnodes give them.

    python tests/scripts/ranks.py N SCRIPT [ARGS...]

Each rank runs SCRIPT as __main__, with its directory (a link's target's) first on sys.path as `python SCRIPT` has
it. As torchrun does, once a rank fails the others are stopped (after a grace of a few seconds, so that each can say
its own error line); this process exits with the first non-zero exit code of a rank, or 0. The ranks die with it (a
test's timeout)."""
import ctypes
import os
import runpy
import signal
import socket
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
import train_gpt2  # noqa: E402, F401 (imported before the fork, once for all the ranks)

GRACE_SECONDS = 5


def run_rank(rank, sizes, port, script, args):
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the launcher
    node = next(node for node in range(len(sizes)) if rank < sum(sizes[:node + 1]))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank - sum(sizes[:node])), WORLD_SIZE=str(sum(sizes)),
                      LOCAL_WORLD_SIZE=str(sizes[node]), GROUP_RANK=str(node), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.realpath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main():
    sizes, script, args = [int(size) for size in sys.argv[1].split(",")], sys.argv[2], sys.argv[3:]
    n = sum(sizes)
    with socket.socket() as s:  # a free port for rank 0's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sys.stdout.flush()
    pids = []
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            run_rank(rank, sizes, port, script, args)
        pids.append(pid)
    codes, failed_at = {}, None
    while len(codes) < n:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] and failed_at is None:
                failed_at = time.monotonic()
        elif failed_at is not None and time.monotonic() - failed_at > GRACE_SECONDS:
            for other in pids:
                if other not in codes:
                    os.kill(other, signal.SIGKILL)
        else:
            time.sleep(0.01)
    sys.exit(next((codes[pid] for pid in pids if codes[pid]), 0))


if __name__ == "__main__":
    main()
