"""
The memory a process has, and how it runs out: how much it may use on its device (of_device), what it can still take
on a CPU (available: the machine's, its cgroup's, its address space's), what an out-of-memory error is,
whichever allocator raised it (out_of_memory_in), and the CPU heap's mode (keep_freed_memory): freed memory kept in
the heap (faster), or given back to the system where memory is tight, as under an address-space limit. What a step
needs is step_memory.py's; which micro-batch fits, microbatch.py's.
"""

import ctypes
import errno
import os
import re
import resource
import sys

import torch
import torch.distributed as dist

from machinery.errors import chain

GIB = 2**30
OUT_OF_MEMORY_MESSAGES = r"can't allocate memory|out of memory|_STATUS_ALLOC_FAILED"  # CPU's; CUDA's, MPS's; cuBLAS's


def out_of_memory_in(error):
    """The allocator's refusal that error is, or was raised from (a compiler's error may wrap it): CUDA's
    torch.OutOfMemoryError, the CPU's and MPS's RuntimeError, a CUDA library's failed allocation (cuBLAS's first
    handle in the backward's thread, under a capped memory: seen on an H100), Python's MemoryError (numpy's too), the
    kernel's ENOMEM; None if there is none."""
    for link in chain(error):
        if isinstance(link, (torch.OutOfMemoryError, MemoryError)) or getattr(link, "errno", None) == errno.ENOMEM:
            return link
        if isinstance(link, RuntimeError) and re.search(OUT_OF_MEMORY_MESSAGES, str(link)):
            return link
    return None


def is_out_of_memory(error):
    return out_of_memory_in(error) is not None


def of_device(device):
    """How much memory this process may use on device: its bytes, and in words ('23.6 GiB of cuda:0', '6.0 GiB of
    address space (ulimit -v)'), on rank r of several ('... on rank 1')."""
    device = torch.device(device)
    if device.type == "cuda":
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)(device)
        size, what = fraction * torch.cuda.get_device_properties(device).total_memory, str(device)
    elif device.type == "mps":
        size, what = torch.mps.recommended_max_memory(), "mps"
    elif address_space_limited():
        size, what = resource.getrlimit(resource.RLIMIT_AS)[0], "address space (ulimit -v)"
    else:
        size, what = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "RAM"
    on_rank = f" on rank {dist.get_rank()}" if dist.is_initialized() and dist.get_world_size() > 1 else ""
    return size, f"{size / GIB:.1f} GiB of {what}{on_rank}"


def in_words(device):
    return of_device(device)[1]


def address_space_limited():
    """Whether this process's address space is limited (ulimit -v, prlimit --as). Freed memory kept in the heap, as a
    CPU run keeps it to be faster, takes up to twice the address space a step uses, by an amount that varies from run
    to run with the heap's fragments: no try can say whether it fits under such a limit, so there the tries and the
    run give freed memory back to the system, and what a try measures is what the run takes."""
    return resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY


# -----------------------------------------------------------------------------
# What a CPU can still give


def available(env):
    """The memory this process can still take, in bytes, and in words: the least of the machine's (MemAvailable), its
    cgroup's (memory.max, v1's memory.limit_in_bytes) and its address space's (ulimit -v), the first two shared with
    the other processes of this node (torchrun's LOCAL_WORLD_SIZE); (None, None) where none can be read."""
    share = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))  # all of them, without torchrun
    on_rank = f" on rank {env.rank}" if env.world_size > 1 else ""
    each = f" for each of {share} processes" if share > 1 else ""
    found = [(room // share, f"{gib(room // share)} available{each} ({what}){on_rank}") for room, what in
             (machine_room(), cgroup_room()) if room is not None]
    if address_space_limited():
        with open("/proc/self/statm") as f:  # its first field: the pages of address space in use
            used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        room = max(0, resource.getrlimit(resource.RLIMIT_AS)[0] - used)
        found.append((room, f"{gib(room)} of address space left (ulimit -v){on_rank}"))
    return min(found, default=(None, None))


def gib(size):
    return f"{size / GIB:.2f} GiB"


def machine_room():
    """MemAvailable of /proc/meminfo in bytes, and where it comes from; (None, None) where there is none."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None, None
    return kib << 10, "MemAvailable in /proc/meminfo"


CGROUPS = (("0::", "/sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"),  # v2
           (":memory:", "/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
            "total_inactive_file"))  # v1


def cgroup_room():
    """The least memory left under the limits of this process's cgroups (its own and those above it, v2's or v1's):
    the limit less what the cgroup uses but its page cache, which it can give back; and the file of that limit.
    (None, None) where no limit is set, or none can be read."""
    try:
        with open("/proc/self/cgroup") as f:
            own = f.read().splitlines()
    except OSError:
        return None, None
    rooms = []
    for marker, mount, limit_name, usage_name, cache_name in CGROUPS:
        path = next((line.split(marker, 1)[1] for line in own if marker in line), None)
        while path is not None:
            directory = os.path.join(mount, path.lstrip("/"))
            limit, usage = (read_number(os.path.join(directory, name)) for name in (limit_name, usage_name))
            if limit is not None and usage is not None and limit < 2**60:  # v1's "no limit" is near 2**63
                cache = read_stat(os.path.join(directory, "memory.stat"), cache_name)
                rooms.append((max(0, limit - usage + cache), os.path.join(directory, limit_name)))
            path = None if path in ("/", "") else os.path.dirname(path)
    return min(rooms, default=(None, None))


def read_number(path):
    """The number a cgroup file holds, or None: no such file, or "max" (no limit)."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def read_stat(path, name):
    """The value of name in a cgroup's memory.stat, or 0."""
    try:
        with open(path) as f:
            return next((int(line.split()[1]) for line in f if line.split()[:1] == [name]), 0)
    except (OSError, ValueError):
        return 0


# -----------------------------------------------------------------------------
# The CPU heap


def keep_freed_memory(keep):
    """On Linux, glibc gives every freed block over 32 MB back to the OS, and the next step faults its pages back in,
    zeroed: on a CPU, GPT-2's 50257-wide logits made that 40% of a small model's step. keep: freed memory stays in the
    heap. Not keep, where memory is tight: every block over 1 MiB is mapped on its own and given back once freed, so
    that no free block in the heap counts against the memory left (glibc's default keeps up to 32 MB ones)."""
    libc = ctypes.CDLL(None) if sys.platform.startswith("linux") else None
    if hasattr(libc, "mallopt"):
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
        libc.mallopt(M_MMAP_MAX, 0 if keep else 1 << 16)  # keep: no block gets an mmap of its own
        if not keep:
            libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30 if keep else 1 << 20)  # the heap's free top goes back past this
