"""
--fsdp: the weights, gradients and optimizer state sharded over the processes with PyTorch's FSDP2, instead of copied
to each by DDP (train_gpt2.py's default), for models too large for one GPU. What it holds:

- the refusals: what FSDP cannot run with;
- shard_model: which modules become groups of their own, and in which precision their weights are gathered;
- ShardedMuon: torch's Muon (the modern recipe's, modern.py) for matrices split over the ranks;
- sharded checkpoints: each rank's slices of the weights and optimizer state, written and read with
  torch.distributed.checkpoint by name, on any number of ranks (checkpoints.py writes the rest beside them), and
  checked whole before they are read.

train_gpt2.py shards the model in one place (wrap_model), before its optimizers are made.
"""

import os
import warnings

import torch
import torch.distributed as dist

from plumbing import UsageError

# torch.distributed's checkpoint, FSDP and DTensor modules take over a second to import, which every launch of the
# trainer would pay, each process under torchrun too: only --fsdp and sharded checkpoints need them, so the functions
# here import them (checkpoint_modules), and builds without torch.distributed never do.
try:  # torch.optim.Muon's own steps (torch 2.9 and later), so that ShardedMuon's update is exactly Muon's; private
    from torch.optim._muon import _adjust_lr as muon_lr_scale
    from torch.optim._muon import _zeropower_via_newtonschulz as orthogonalize
except ImportError:  # --fsdp --recipe modern is refused then (modern.check_settings); nothing else needs them
    muon_lr_scale = orthogonalize = None


def checkpoint_modules():
    """torch.distributed.checkpoint, and its state dicts named by parameter, sharded or not."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dcp_state

    return dcp, dcp_state


def check_settings(cfg, env):
    """Refuses, in one line, what --fsdp cannot run with (nothing without --fsdp)."""
    if not cfg.fsdp:
        return
    if not dist.is_available():
        raise UsageError(f"--fsdp needs torch.distributed, and this build of PyTorch ({torch.__version__}) has none; "
                         f"install one that has (pytorch.org), or drop --fsdp")
    if cfg.dtype == "fp16":
        raise UsageError("--fsdp cannot run with --dtype fp16: the gradient scaler that fp16 needs does not take "
                         "FSDP's sharded gradients; use --dtype bf16 or fp32, or drop --fsdp")
    if cfg.compile_mode == "reduce-overhead":
        raise UsageError("--compile-mode reduce-overhead cannot run with --fsdp: its CUDA graphs cannot hold FSDP's "
                         "gathers and reductions; pick another --compile-mode, or drop --fsdp")


def shard_model(model, dtype, device_type):
    """FSDP2, in place: each block, then the rest (embedding, final norm, head), becomes a group whose tensors are
    split over the ranks, each rank holding 1/world of every one. A group's weights are gathered whole just before
    its forward and backward and freed after them, and its gradients are reduce-scattered: each rank receives the
    sum of its own slice. The optimizers then step on slices, so their state is sharded too."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    block_policy = MixedPrecisionPolicy()
    if dtype == "bf16":  # the blocks' weights gathered in bf16 (half the bytes), their gradients summed in float32;
        # inputs not cast, and the embedding and head gathered in float32: the residual stream stays float32, and
        # autocast computes what it does under DDP (but for LayerNorm's gains and biases, rounded to bf16)
        block_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                            cast_forward_inputs=False)
        if device_type == "cpu":  # the CPU's layer_norm takes no bf16 gain with a float32 input (autocast on CUDA
            # runs it in float32): there the norms are groups of their own, gathered in float32, as under DDP
            for norm in model.modules():
                if isinstance(norm, torch.nn.LayerNorm) and norm.weight is not None:
                    fully_shard(norm)
    for block in model.transformer.h:
        fully_shard(block, mp_policy=block_policy)
    fully_shard(model, reshard_after_forward=False)  # the head's backward comes first: no gather of it again
    return model


def is_sharded(model):
    return hasattr(model, "set_requires_gradient_sync")  # FSDP's own, as in train_gpt2.gradient_sync


class ShardedMuon(getattr(torch.optim, "Muon", torch.optim.Optimizer)):  # torch.optim.Muon is new in torch 2.9
    """torch's Muon for matrices that FSDP shards over the ranks, row blocks of each to each rank. Orthogonalizing an
    update needs the whole matrix: every rank gathers each matrix's update in bf16 (the precision the orthogonalization
    runs in, so it is the same as Muon's unsharded), orthogonalizes it (all ranks the same work), and applies its own
    rows. The momentum stays sharded: it is elementwise. The arithmetic is on each rank's plain local rows: DTensor's
    operations each cost a dispatch in Python, and a step makes several for every matrix of the model."""

    @torch.no_grad()
    def step(self, closure=None):
        from torch.distributed.tensor import DTensor

        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:  # torch's name; a DTensor like p, so checkpoints save it sharded
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                momentum, grad = state["momentum_buffer"].to_local(), p.grad.to_local()  # this rank's rows
                momentum.lerp_(grad, 1 - group["momentum"])
                update = grad.lerp(momentum, group["momentum"]) if group["nesterov"] else momentum
                whole = DTensor.from_local(update.bfloat16(), p.device_mesh, p.placements, shape=p.shape,
                                           stride=p.stride()).full_tensor()  # (out, in), gathered on every rank
                whole = orthogonalize(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])
                weights = p.to_local()
                first_row = p.device_mesh.get_local_rank() * -(-p.shape[0] // p.device_mesh.size())  # FSDP's chunks
                weights.mul_(1 - group["lr"] * group["weight_decay"])
                weights.add_(whole[first_row:first_row + weights.shape[0]],
                             alpha=-muon_lr_scale(group["lr"], group["adjust_lr_fn"], p.shape))


# -----------------------------------------------------------------------------
# Sharded checkpoints: a directory, each rank's slices of the weights and optimizer state in it


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
    """Every rank writes its slices of contents (sharded_contents) into directory; rank 0 ends with the index."""
    dcp, _ = checkpoint_modules()
    writer = dcp.FileSystemWriter(directory)
    writer.write_data, writer.finish = keeping_errno(writer.write_data), keeping_errno(writer.finish)
    dcp.save(contents, storage_writer=writer)


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


def load_weights(model, path):
    """A sharded checkpoint's weights into the model, sharded or whole: each rank reads its slices, or all."""
    dcp, dcp_state = checkpoint_modules()
    contents = sharded_contents(model)
    with warnings.catch_warnings():  # in one process it warns that it assumes one process, as it should
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(contents, checkpoint_id=path)
    dcp_state.set_model_state_dict(model, contents["model"])


def load_whole_weights(model, state_dict):
    """A DDP checkpoint's whole tensors into a sharded model's slices."""
    _, dcp_state = checkpoint_modules()
    dcp_state.set_model_state_dict(model, state_dict, options=dcp_state.StateDictOptions(full_state_dict=True))


def load_optimizers(model, optimizers, path):
    """The optimizers' entries alone of a sharded checkpoint (load_weights has read the weights already)."""
    dcp, dcp_state = checkpoint_modules()
    contents = {"optimizers": sharded_contents(model, optimizers)["optimizers"]}
    dcp.load(contents, checkpoint_id=path)
    dcp_state.set_optimizer_state_dict(model, optimizers, contents["optimizers"])
