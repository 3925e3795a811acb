"""Starts fineweb.py's tokenizer pool as its main does (SIGTERM and SIGHUP caught) and stops it at once, while its
worker is still starting, before its initializer has put SIGTERM back to its default; prints "stopped" unless the stop
hangs. argv[1]: the repository."""
import sys
import time

sys.path.insert(0, sys.argv[1])
import fineweb  # noqa: E402 (after the path that finds it)

init_worker = fineweb.init_worker


def slow_to_start(parent_pid):  # a loaded machine's slow start: the stop comes before the worker's own set-up
    time.sleep(0.5)
    init_worker(parent_pid)


fineweb.init_worker = slow_to_start
fineweb.stop_on_signals()
fineweb.stop_workers(fineweb.start_workers(1))
print("stopped")
