"""train_gpt2.main(flags), where a HellaSwag download must hold N examples rather than the real file's 10042, so that
a test's HELLASWAG_URL can serve a few synthetic ones to a subprocess (which monkeypatch cannot reach):

    python tests/scripts/train_with_small_hellaswag.py N [train_gpt2.py flags]
    torchrun --nproc_per_node=2 tests/scripts/train_with_small_hellaswag.py N --eval-only ..."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

import train_gpt2  # noqa: E402
from evaluation import hellaswag  # noqa: E402 (after the path that finds it)

hellaswag.HELLASWAG_VAL_EXAMPLES = int(sys.argv[1])
train_gpt2.main(sys.argv[2:])
