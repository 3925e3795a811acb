"""
Where this process runs: torchrun's environment variables (its rank, the processes, where they meet, a node's
processes) read and checked, the device it runs on checked, and the precision that device computes in. Each refusal
is one line that says what to unset or pass, before any process group is made.
"""

import os
import socket

import torch

from machinery.errors import UsageError


def processes(environ=os.environ):
    """This process's rank, local rank and the number of processes, from torchrun's RANK, LOCAL_RANK and WORLD_SIZE
    (or one process where they are unset), refused in one line where no torchrun could have set them."""
    rank, local_rank, world_size = (whole_number_in(environ, name, default)
                                    for name, default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")))
    if rank >= world_size:
        raise UsageError(f"RANK={rank} in the environment is not below WORLD_SIZE={world_size}; unset both to run one "
                         f"process, or start the run with torchrun")
    if world_size > 1:
        check_meeting_place(environ, world_size)
    return rank, local_rank, world_size


def whole_number_in(environ, name, default, positive=False, fix="unset it to run one process"):
    """The environment variable's value as torchrun writes a number, in the digits 0-9 alone: str.isdigit also takes
    "²", and int() " 1", "+1" and "1_0". positive: 0 is refused too; fix: what the refusal says to do."""
    value = environ.get(name, default)
    if not (value.isascii() and value.isdigit()) or (positive and int(value) == 0):
        raise UsageError(f"{name}={value!r} in the environment is not a {'positive ' if positive else ''}whole number; "
                         f"torchrun sets it for each process it starts: {fix}")
    return int(value)


def processes_per_node(world_size, environ=os.environ):
    """torchrun's LOCAL_WORLD_SIZE, the processes of this node: world_size where it is unset (one node)."""
    return whole_number_in(environ, "LOCAL_WORLD_SIZE", str(world_size), positive=True, fix="unset it")


def check_meeting_place(environ, world_size):
    """Refuses, in one line, a MASTER_ADDR and MASTER_PORT where the processes cannot meet: unset, a port that is no
    number (a ValueError in torch's rendezvous), or an address this machine cannot resolve (which c10d would retry for
    the process group's hour, its warnings the only word)."""
    address, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if not (address and port):
        raise UsageError(f"WORLD_SIZE={world_size} says this is one of {world_size} processes, but MASTER_ADDR and "
                         f"MASTER_PORT, where they meet, are not set; start them with torchrun (torchrun --standalone "
                         f"--nproc_per_node={world_size} train_gpt2.py), or unset WORLD_SIZE to run one process")
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 2**16):
        raise UsageError(f"MASTER_PORT={port!r} in the environment is not a port number (1 to 65535); start the run "
                         f"with torchrun, which sets it (--master_port), or unset WORLD_SIZE to run one process")
    try:
        socket.getaddrinfo(address, int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:  # UnicodeError: a name that IDNA cannot encode
        reason = e.strerror if isinstance(e, OSError) else e
        raise UsageError(f"MASTER_ADDR={address!r} in the environment is no address this machine can resolve "
                         f"({reason}); set it to rank 0's host name or IP address (torchrun's --master_addr), or unset "
                         f"WORLD_SIZE to run one process") from None


def check_device(device, local_rank, world_size, fsdp):
    """Refuses a device that PyTorch does not see here, or that cannot hold this process or its process group."""
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but PyTorch sees no CUDA GPU; install a CUDA build of torch or use "
                         "--device cpu")
    if device == "cuda" and local_rank >= torch.cuda.device_count():
        raise UsageError(f"process LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPU(s) are visible "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); lower "
                         f"torchrun's --nproc_per_node")
    if device == "mps" and not torch.backends.mps.is_available():
        raise UsageError("--device mps, but this machine has no Apple GPU available to PyTorch; use --device cpu")
    if device == "mps" and (world_size > 1 or fsdp):
        raise UsageError("several processes need CUDA or the CPU; run one process on mps" if world_size > 1 else
                         "--fsdp needs CUDA or the CPU (its collectives have no mps backend); drop --fsdp")


def resolve_dtype(dtype, device_type):
    """--dtype on device_type: auto's choice for it, or the one asked for, refused where this GPU has none."""
    if dtype == "auto":
        if device_type != "cuda":
            return "fp32"
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"  # V100 and T4 lack bf16
    if dtype == "bf16" and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UsageError("--dtype bf16: this GPU has no bf16; use --dtype fp16")
    return dtype
