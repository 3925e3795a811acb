"""A stand-in for train_gpt2.py, run by tests/test_speed_ladder.py: a trainer that runs out of GPU memory before its
first step, so it logs no step, and says why on its last line."""
import sys

print("CUDA out of memory. Tried to allocate 1 GiB")
sys.exit(1)
