"""Training with a NaN loss at chosen steps, for tests of what non-finite steps do:

    python tests/scripts/nan_loss.py STEPS [train_gpt2.py flags]    # STEPS: optimizer steps, such as 1,2

At those steps (counted from the first step this process trains: the step itself, in a fresh run) the model's loss of
every micro-batch is multiplied by NaN, as a diverging model's would be: the real train_step finds the loss and the
gradient norm non-finite and skips the update. Tests in this process patch the same with nan_loss_at(steps,
monkeypatch.setattr)."""
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

import train_gpt2  # noqa: E402 (after the path that finds it)


def nan_loss_at(steps, setattr=setattr):
    """Patches train_gpt2 (with setattr: pytest's monkeypatch.setattr undoes it after the test) so that the loss is NaN
    in the training steps numbered steps."""
    steps, calls, poisoned = set(steps), itertools.count(), [False]
    train_step, forward = train_gpt2.train_step, train_gpt2.GPT.forward

    def train_step_counted(*args, **kwargs):
        poisoned[0] = next(calls) in steps
        try:
            return train_step(*args, **kwargs)
        finally:
            poisoned[0] = False  # the evaluations between steps see the real loss

    def nan_loss(self, idx, targets=None, kv_cache=None):
        logits, loss = forward(self, idx, targets, kv_cache)
        return logits, loss * float("nan") if poisoned[0] and loss is not None else loss

    setattr(train_gpt2, "train_step", train_step_counted)
    setattr(train_gpt2.GPT, "forward", nan_loss)


def steps_argument(text):
    """"1,2" -> {1, 2}"""
    return {int(step) for step in text.split(",") if step}


if __name__ == "__main__":
    nan_loss_at(steps_argument(sys.argv[1]))
    train_gpt2.main(sys.argv[2:])
