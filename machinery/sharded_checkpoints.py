"""
Sharded checkpoints, as --fsdp writes them: a directory of the slices of the weights and optimizer state, each written
once, with torch.distributed.checkpoint by parameter name (checkpoints.py writes the rest of the checkpoint beside
them), checked whole before they are read, and read on any number of ranks and any mesh, with or without --fsdp.
"""

import os
import warnings

# torch.distributed's checkpoint modules take over a second to import, which every launch of the trainer would pay:
# only sharded checkpoints need them, so the functions here import them (checkpoint_modules)


def checkpoint_modules():
    """torch.distributed.checkpoint, and its state dicts named by parameter, sharded or not."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dcp_state

    return dcp, dcp_state


def is_sharded(model):
    return hasattr(model, "set_requires_gradient_sync")  # FSDP's own, as in train_gpt2.gradient_sync



def sharded_contents(model, optimizers=None):
    """FSDP's weights and optimizer state: each rank's own slices, as DTensors named by parameter (not by position),
    which torch.distributed.checkpoint writes and reads on any number of ranks, splitting them anew for that number.
    A model that is not sharded gets its whole tensors, which it loads such a checkpoint into."""
    _, dcp_state = checkpoint_modules()
    contents = {"model": dcp_state.get_model_state_dict(model)}
    if optimizers is not None:
        contents["optimizers"] = dcp_state.get_optimizer_state_dict(model, optimizers)
    return contents


def os_error_in(error):
    """The first OSError with an errno in error's chain (torch.save's RuntimeError keeps it as its context), or None."""
    while error is not None and not (isinstance(error, OSError) and error.errno):
        error = error.__cause__ or error.__context__
    return error


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


def save(contents, directory):
    """Every rank of the first replica writes its slices of contents (sharded_contents) into directory, each slice
    once: the other replicas of HSDP hold the same ones. Rank 0 ends with the index."""
    dcp, _ = checkpoint_modules()
    writer = dcp.FileSystemWriter(directory)
    writer.write_data, writer.finish = keeping_errno(writer.write_data), keeping_errno(writer.finish)
    # a slice that several ranks hold goes to the lowest of them: HSDP's first replica, not spread over all ranks
    dcp.save(contents, storage_writer=writer, planner=dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True))


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


def load_weights(model, path):
    """A sharded checkpoint's weights into the model, sharded (on any mesh) or whole."""
    _, dcp_state = checkpoint_modules()
    contents = sharded_contents(model)
    read(contents, path)
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
