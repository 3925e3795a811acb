"""Training in which one rank sends itself a signal as an optimizer step begins, for tests of a rank preempted
(SIGTERM) or killed outright (SIGKILL, as the kernel's out-of-memory killer kills) while the others train:

    python tests/scripts/signal_at_step.py RANK STEP SIGNAL [train_gpt2.py flags]    # e.g. 3 5 SIGTERM

The signal is real, and sent at a step chosen in advance rather than at a moment a test catches."""
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

import train_gpt2  # noqa: E402 (after the path that finds it)


def signal_at_step(rank, step, signum):
    """Patches train_gpt2 so that this process, if it is rank rank, sends itself signum as step begins (set_lr, just
    before its train_step)."""
    set_lr = train_gpt2.set_lr

    def set_lr_then_signal(optimizers, at, cfg):
        set_lr(optimizers, at, cfg)
        if at == step and os.environ.get("RANK", "0") == str(rank):
            os.kill(os.getpid(), signum)

    train_gpt2.set_lr = set_lr_then_signal


if __name__ == "__main__":
    signal_at_step(int(sys.argv[1]), int(sys.argv[2]), signal.Signals[sys.argv[3]])
    train_gpt2.main(sys.argv[4:])
