"""
Sharded checkpoints, as --fsdp writes them: a directory of the slices of the weights and optimizer state, each written
once, with torch.distributed.checkpoint by parameter name (checkpoints.py writes the rest of the checkpoint beside
them, with the checksums of these files), checked whole before they are read, and read on any number of ranks and any
mesh, with or without --fsdp. A tied weight (GPT-2's embedding and head) is stored once, as torch.save stores it.
"""

import functools
import os
import warnings

from machinery import files, ranks
from machinery.errors import chain

# torch.distributed's checkpoint modules take over a second to import, which every launch of the trainer would pay:
# only sharded checkpoints need them, so the functions here import them (checkpoint_modules)


def checkpoint_modules():
    """torch.distributed.checkpoint, and its state dicts named by parameter, sharded or not."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dcp_state

    return dcp, dcp_state


def is_sharded(model):
    return hasattr(model, "set_requires_gradient_sync")  # FSDP's own, as in train_gpt2.gradient_sync



def tied_names(model):
    """{name: the name it is tied to} of each parameter that is another's (the GPT-2 recipe's head, its embedding)."""
    first, tied = {}, {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            tied[name] = first[id(parameter)]
        else:
            first[id(parameter)] = name
    return tied


def sharded_contents(model, optimizers=None):
    """FSDP's weights and optimizer state: each rank's own slices, as DTensors named by parameter (not by position),
    which torch.distributed.checkpoint writes and reads on any number of ranks, splitting them anew for that number.
    A model that is not sharded gets its whole tensors, which it loads such a checkpoint into. A tied weight is in it
    once, by its first name: torch.distributed.checkpoint would write it once for each."""
    _, dcp_state = checkpoint_modules()
    weights = dcp_state.get_model_state_dict(model)
    for name in tied_names(model):
        weights.pop(name, None)
    contents = {"model": weights}
    if optimizers is not None:
        contents["optimizers"] = dcp_state.get_optimizer_state_dict(model, optimizers)
    return contents


INDEX_BYTES = 280  # about what an entry adds to the index, .metadata (torch 2.13: 270 to 290)


@functools.cache
def entry_bytes():
    """The bytes that writing an entry adds to its own: each is in torch.save's format (a zip archive, some 1.5 KB
    of it around the data), with its line in the index."""
    import io

    import torch

    archive = io.BytesIO()
    torch.save(torch.empty(0), archive)
    return len(archive.getvalue()) + INDEX_BYTES


def written_bytes(contents, shards):
    """About the bytes that all ranks write of contents (sharded_contents), as torch.distributed.checkpoint writes
    them: each entry on its own (two that share a storage twice), the slices of the DTensors by the shards ranks of
    one replica, the rest once."""
    slices, rest, todo = 0, 0, [contents]
    while todo:
        entry = todo.pop()
        if isinstance(entry, dict):
            todo.extend(entry.values())
        elif isinstance(entry, list) and any(isinstance(item, dict) for item in entry):  # the optimizers' groups
            todo.extend(entry)
        elif hasattr(entry, "to_local"):  # a DTensor: this rank's slice, as large as any other's or larger
            slices += entry.to_local().nbytes + entry_bytes()
        else:  # a tensor, or a value (a learning rate, the names of a group's parameters)
            rest += getattr(entry, "nbytes", 0) + entry_bytes()
    return slices * shards + rest


def os_error_in(error):
    """The first OSError with an errno in error's chain (torch.save's RuntimeError keeps it as its context), or None."""
    return next((e for e in chain(error) if isinstance(e, OSError) and e.errno), None)


def keeping_errno(write):
    """write, a step of torch.distributed.checkpoint's writer, raising a failed write's OSError itself: it gathers each
    rank's exception to every rank by pickling it, which keeps an OSError's errno (ENOSPC, EDQUOT, ...) but drops the
    chain that torch.save's RuntimeError holds it in."""
    def wrapped(*args, **kwargs):
        try:
            return write(*args, **kwargs)
        except Exception as e:
            cause = os_error_in(e)
            if cause is None:
                raise
            raise OSError(cause.errno, cause.strerror, cause.filename) from e
    return wrapped


def recording_files(writer, written):
    """torch.distributed.checkpoint's writer, adding to written the name of each file it writes: those of its slices,
    and the index if this rank ends the checkpoint (rank 0)."""
    write_data, finish = writer.write_data, writer.finish

    def write_data_recorded(*args, **kwargs):
        future = write_data(*args, **kwargs)  # of the write results, each naming the file of a slice
        written.extend(sorted({result.storage_data.relative_path for result in future.wait()}))
        return future

    def finish_recorded(*args, **kwargs):
        finish(*args, **kwargs)
        written.append(".metadata")

    writer.write_data, writer.finish = keeping_errno(write_data_recorded), keeping_errno(finish_recorded)
    return writer


def save(contents, directory):
    """Every rank of the first replica writes its slices of contents (sharded_contents) into directory, each slice
    once: the other replicas of HSDP hold the same ones. Rank 0 ends with the index. Returns {file: (bytes, CRC-32)}
    of every file written, on every rank: each rank reads back its own files, all at once, for the readers to check
    them against (damage)."""
    dcp, _ = checkpoint_modules()
    written = []
    writer = recording_files(dcp.FileSystemWriter(directory), written)
    # a slice that several ranks hold goes to the lowest of them: HSDP's first replica, not spread over all ranks
    dcp.save(contents, storage_writer=writer, planner=dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    checksums = {}
    for each_rank in ranks.every_rank({name: files.size_and_crc32(os.path.join(directory, name)) for name in written}):
        checksums.update(each_rank)
    return checksums


def shards(model):
    """How many processes each of the model's tensors is split over: the last dimension of its mesh (HSDP's is
    (replicate, shard)); 1 for a model that is not sharded."""
    mesh = getattr(next(model.parameters()), "device_mesh", None)
    return 1 if mesh is None else mesh.size(mesh.ndim - 1)


def check_complete(path):
    """Raises ValueError unless the sharded checkpoint at path has its index (.metadata) and every file that names,
    each as long as the byte ranges it lists in it: one damaged or cut short is refused without reading its tensors."""
    dcp, _ = checkpoint_modules()
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        raise ValueError("its index .metadata is missing") from None
    except Exception as e:  # pickle's errors, of a file cut short
        raise ValueError(f"its index .metadata cannot be read ({type(e).__name__}: {e})") from None
    ends = {}
    for stored in metadata.storage_data.values():
        ends[stored.relative_path] = max(ends.get(stored.relative_path, 0), stored.offset + stored.length)
    for name, end in sorted(ends.items()):
        try:
            size = os.path.getsize(os.path.join(path, name))
        except FileNotFoundError:
            raise ValueError(f"{name}, which its index .metadata names, is missing") from None
        if size < end:
            raise ValueError(f"{name} is cut short: {size:,} bytes of {end:,}")


def read(contents, path):
    """contents (sharded_contents) read from the sharded checkpoint at path, in place: each rank its slices, or all."""
    dcp, _ = checkpoint_modules()
    with warnings.catch_warnings():  # in one process it warns that it assumes one process, as it should
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(contents, checkpoint_id=path)


def file_checks(path, checksums):
    """[(bytes, check)] for the files of the sharded checkpoint at path: check() says what is damaged in one, read
    whole against the bytes and CRC-32 it was written with (checksums, save's), or None. A checkpoint written before
    the checksums were gives none: its files' sizes alone are checked (check_complete)."""
    def check(name, size, crc):
        try:
            now = files.size_and_crc32(os.path.join(path, name))
        except OSError as e:
            return f"{name} cannot be read ({e.strerror})"
        if now[0] != size:
            return f"{name} is damaged: {now[0]:,} bytes, where {size:,} were written"
        if now[1] != crc:
            return f"{name} is damaged: its bytes are not those written (CRC-32 {now[1]:08x}, not {crc:08x})"
        return None

    return [(size, functools.partial(check, name, size, crc)) for name, (size, crc) in (checksums or {}).items()]


def load_weights(model, path):
    """A sharded checkpoint's weights into the model, sharded (on any mesh) or whole; a tied weight from its first
    name, in a checkpoint older than that from its first name too."""
    _, dcp_state = checkpoint_modules()
    contents = sharded_contents(model)
    read(contents, path)
    for name, first in tied_names(model).items():
        contents["model"][name] = contents["model"][first]
    dcp_state.set_model_state_dict(model, contents["model"])


def load_whole_weights(model, state_dict):
    """A DDP checkpoint's whole tensors into a sharded model's slices."""
    _, dcp_state = checkpoint_modules()
    dcp_state.set_model_state_dict(model, state_dict, options=dcp_state.StateDictOptions(full_state_dict=True))


def load_optimizers(model, optimizers, path):
    """The optimizers' entries alone of a sharded checkpoint (load_weights has read the weights already), by parameter
    name: into a sharded model's slices, or a whole model's (DDP's) tensors."""
    _, dcp_state = checkpoint_modules()
    contents = {"optimizers": sharded_contents(model, optimizers)["optimizers"]}
    read(contents, path)
    dcp_state.set_optimizer_state_dict(model, optimizers, contents["optimizers"])
