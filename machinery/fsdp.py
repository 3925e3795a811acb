"""
--fsdp: the weights, gradients and optimizer state sharded over the processes with PyTorch's FSDP2, instead of copied
to each by DDP (train_gpt2.py's default), for models too large for one GPU. What it holds:

- the refusals: what FSDP cannot run with;
- shard_model: which modules become groups of their own, and in which precision their weights are gathered;
- ShardedMuon: torch's Muon (the modern recipe's, modern.py) for matrices split over the ranks;
(Its checkpoints, each rank's slices of the weights and optimizer state, are sharded_checkpoints.py's.)

train_gpt2.py shards the model in one place (wrap_model), before its optimizers are made.
"""


import torch
import torch.distributed as dist

from machinery.errors import UsageError

# torch.distributed's FSDP and DTensor modules take over a second to import, which every launch of the trainer would
# pay, each process under torchrun too: only --fsdp needs them, so the functions here import them, and builds without
# torch.distributed never do.
try:  # torch.optim.Muon's own steps (torch 2.9 and later), so that ShardedMuon's update is exactly Muon's; private
    from torch.optim._muon import _adjust_lr as muon_lr_scale
    from torch.optim._muon import _zeropower_via_newtonschulz as orthogonalize
except ImportError:  # --fsdp --recipe modern is refused then (modern.check_settings); nothing else needs them
    muon_lr_scale = orthogonalize = None


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
