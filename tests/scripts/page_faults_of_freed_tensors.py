"""Prints, as JSON, [the page faults of 5 tensors of 100 MB, each written in full and freed (as a step's logits are),
by default; the same once memory.keep_freed_memory(True) keeps freed memory in the heap]:

    python tests/scripts/page_faults_of_freed_tensors.py"""
import ctypes
import json
import os
import resource
import sys

# no transparent huge pages for this process: where they are on for all memory ("always"), one fault maps 2 MiB,
# and the default's faults, the baseline, drop 512-fold
assert ctypes.CDLL(None).prctl(41, 1, 0, 0, 0) == 0, "prctl(PR_SET_THP_DISABLE) failed"

import torch  # noqa: E402 (after the prctl, which covers the memory torch maps from then on)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

import train_gpt2  # noqa: E402, F401 (the trainer's imports, as a run has them: they shape the heap the test measures)
from machinery import memory  # noqa: E402


def page_faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        torch.ones(25_000_000)  # freed at once
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


default = page_faults()
memory.keep_freed_memory(True)
page_faults()  # the heap grows to hold one
print(json.dumps([default, page_faults()]))
