"""Starts fineweb.py's tokenizer pool and stops it while its workers send large results, ten times; prints "stopped"
unless a stop hangs. argv[1]: the repository."""
import random
import sys
import time

import numpy as np

sys.path.insert(0, sys.argv[1])
import fineweb  # noqa: E402 (after the path that finds it)

for trial in range(10):
    pool = fineweb.start_workers(2)
    results = [pool.submit(np.ones, 1_000_000, dtype=np.uint16) for _ in range(20)]  # 2 MB each: slow to send
    results[0].result()  # the workers are sending now
    time.sleep(random.Random(trial).uniform(0, 0.02))  # stop at another moment each trial, the same every run
    fineweb.stop_workers(pool)
print("stopped")
