"""Runs train_gpt2.main(ARGS) in a process whose address space is limited (RLIMIT_AS, what `ulimit -v` and
`prlimit --as` set: a real limit, which every allocator meets as on a small machine) to what it uses once the trainer
is imported plus HEADROOM MiB: only on rank LIMITED_RANK, or on every rank if that is -1. With $TAKEN_LATER_MIB, that
much of the limited address space is taken (mapped, and held) once the micro-batch is chosen, as an allocator's
fragments or another library may take it after the search: the run's steps then meet the limit sooner than its tries.

    python tests/scripts/limited_memory.py REPO LIMITED_RANK HEADROOM ARGS..."""
import mmap
import os
import resource
import sys

sys.path.insert(0, sys.argv[1])
import train_gpt2  # noqa: E402
from machinery import microbatch  # noqa: E402


def take_later(mib):
    choose, taken = microbatch.largest_that_fits, []

    def choose_then_take(*args):
        chosen = choose(*args)
        taken.append(mmap.mmap(-1, mib << 20))
        return chosen

    microbatch.largest_that_fits = choose_then_take


limited_rank, headroom = int(sys.argv[2]), int(sys.argv[3]) << 20
if limited_rank in (-1, int(os.environ.get("RANK", "0"))):
    with open("/proc/self/statm") as f:  # its first field: the pages of address space in use
        in_use = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (in_use + headroom, resource.RLIM_INFINITY))
    if os.environ.get("TAKEN_LATER_MIB"):
        take_later(int(os.environ["TAKEN_LATER_MIB"]))
train_gpt2.main(sys.argv[4:])
