"""
The stop signals, SIGTERM and SIGINT (a cluster's preemption, Ctrl-C): recorded for the training loop, which ends the
run after its step with a checkpoint (record_stop_signals), raised where a wait must stop and a move must not be cut
in half (StopSignals), or SIGTERM made an exit that cleans up as Ctrl-C's does (exiting_on_sigterm: files.py's
directory writer).
"""

import contextlib
import signal


def record_stop_signals():
    """SIGTERM and SIGINT (preemption, Ctrl-C) end the run after the step in progress, with a checkpoint; a second one
    kills it. Returns the list the signals are recorded in."""
    caught = []

    def on_signal(signum, frame):
        caught.append(signum)
        signal.signal(signum, signal.SIG_DFL)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return caught


class StoppedBySignal(Exception):
    """SIGINT or SIGTERM, come while StopSignals raises them."""


class StopSignals:
    """While inside, the first SIGINT or SIGTERM raises StoppedBySignal unless deferred is set; any other is only kept
    (their names, in caught) for after. Their handlers are given back on leaving. SIGTERM's own would end the process
    at once, and SIGINT's KeyboardInterrupt print a traceback, wherever they came."""

    def __init__(self):
        self.deferred, self.caught = False, []

    def __enter__(self):
        self.handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig, handler in self.handlers.items():
            if handler != signal.SIG_IGN:  # a background job's SIGINT, which its shell ignores: left so
                signal.signal(sig, self.on_signal)
        return self

    def __exit__(self, *exception):
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)

    def on_signal(self, signum, frame):
        self.caught.append(signal.Signals(signum).name)
        if not self.deferred:
            self.deferred = True  # once: a second signal never cuts short the handling of the first
            raise StoppedBySignal


def exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)  # as Ctrl-C's KeyboardInterrupt, deletes the temporary directory; 143: SIGTERM's


@contextlib.contextmanager
def exiting_on_sigterm():
    """While inside, SIGTERM raises SystemExit(143), which ends the process as SIGTERM's own handler would, but after
    what is on its way out has cleaned up (a temporary directory deleted), as Ctrl-C's KeyboardInterrupt does. Its
    handler is given back on leaving."""
    previous = signal.signal(signal.SIGTERM, exit_on_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
