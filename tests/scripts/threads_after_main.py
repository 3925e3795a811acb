"""Runs train_gpt2.main with a NaN loss at STEPS (see nan_loss.py), under torchrun, then prints in one line of JSON
this process's rank, main's exit code and the names of its threads still running:

    torchrun --nproc_per_node=2 tests/scripts/threads_after_main.py STEPS [train_gpt2.py flags]

A gloo thread still running at interpreter exit can abort the process (SIGABRT, 'terminate called without an active
exception'): main must leave none, even when it stops with an error mid-training."""
import json
import os
import sys

from nan_loss import nan_loss_at, steps_argument, train_gpt2  # this script's directory is on sys.path

nan_loss_at(steps_argument(sys.argv[1]))
code = names = None
try:
    train_gpt2.main(sys.argv[2:])
except SystemExit as e:  # the threads listed while the exception lives, as it does in `python train_gpt2.py` until exit
    code = e.code
    names = sorted(open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task"))
report = {"rank": os.environ["RANK"], "code": code, "threads": names}
os.write(1, (json.dumps(report) + "\n").encode())  # one write: whole lines, however the ranks' prints interleave
