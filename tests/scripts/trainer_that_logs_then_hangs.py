"""A stand-in for train_gpt2.py, run by tests/test_speed_ladder.py: `trainer_that_logs_then_hangs.py LOG N` starts a
worker process (as torch.compile starts its workers), writes the pids of both to LOG.pids, logs N steps to LOG as
train_gpt2.py does, one every 50 ms, then half a line, and hangs as a long final evaluation would."""
import json
import os
import subprocess
import sys
import time

if sys.argv[1:] == ["--worker"]:
    time.sleep(60)
    sys.exit()
log_path, n_steps = sys.argv[1], int(sys.argv[2])
worker = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"])
with open(log_path + ".pids", "w") as f:
    f.write(f"{os.getpid()} {worker.pid}")
with open(log_path, "a") as f:
    for step in range(n_steps):
        f.write(json.dumps({"step": step, "dt_ms": 1.0}) + "\n")
        f.flush()
        time.sleep(0.05)
    f.write('{"step": 99, "dt')  # half a line, then a final evaluation that would take long
    f.flush()
    time.sleep(60)
