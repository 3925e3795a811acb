"""train_gpt2.main(flags) in a Python where `import wandb` fails, as if the package were not installed:

    python tests/scripts/train_without_wandb.py [train_gpt2.py flags]

Without --wandb-project, the trainer must never import wandb: not even at its own import."""
import os
import sys

sys.modules["wandb"] = None  # `import wandb` raises ImportError
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

import train_gpt2  # noqa: E402 (after wandb is made unimportable, and the path that finds it)

train_gpt2.main(sys.argv[1:])
