"""
--fsdp: the weights, gradients and optimizer state sharded over the processes with PyTorch's FSDP2, instead of copied
to each by DDP (train_gpt2.py's default), for models too large for one GPU. On several nodes it shards within each
node and replicates across them (HSDP: a 2-D mesh of replicas x shards), so that the slow links between nodes carry
only the gradients' all-reduce; where each node has one process, it shards over all of them. What it holds:

- the refusals: what FSDP cannot run with; and the mesh: how many processes each tensor is split over (--fsdp-shards);
- shard_model: which modules become groups of their own, and in which precision their weights are gathered.

Its checkpoints, each slice of the weights and optimizer state written once, by the first replica's ranks, are
sharded_checkpoints.py's.

train_gpt2.py shards the model in one place (wrap_model), before its optimizers are made.
"""

import torch
import torch.distributed as dist

from machinery import environment
from machinery.errors import UsageError

# torch.distributed's FSDP and DTensor modules take over a second to import, which every launch of the trainer would
# pay, each process under torchrun too: only --fsdp needs them, so the functions here import them, and builds without
# torch.distributed never do.

def check_settings(cfg, env):
    """Refuses, in one line, what --fsdp cannot run with (nothing without --fsdp); returns the line that names the
    mesh for the run's first lines: under HSDP, and where nodes of one process shard over all of them (None for FSDP
    on one node)."""
    if cfg.fsdp_shards is not None and not cfg.fsdp:
        raise UsageError(f"--fsdp-shards {cfg.fsdp_shards} splits --fsdp's tensors, and --fsdp is off; pass --fsdp "
                         f"too, or drop --fsdp-shards")
    if not cfg.fsdp:
        return None
    if cfg.fsdp_shards < 0:
        raise UsageError(f"--fsdp-shards must be zero or more, not {cfg.fsdp_shards}; pass a divisor of the "
                         f"{env.world_size} process(es), or 0 to shard over all of them")
    if not dist.is_available():
        raise UsageError(f"--fsdp needs torch.distributed, and this build of PyTorch ({torch.__version__}) has none; "
                         f"install one that has (pytorch.org), or drop --fsdp")
    if cfg.dtype == "fp16":
        raise UsageError("--fsdp cannot run with --dtype fp16: the gradient scaler that fp16 needs does not take "
                         "FSDP's sharded gradients; use --dtype bf16 or fp32, or drop --fsdp")
    if cfg.compile_mode == "reduce-overhead":
        raise UsageError("--compile-mode reduce-overhead cannot run with --fsdp: its CUDA graphs cannot hold FSDP's "
                         "gathers and reductions; pick another --compile-mode, or drop --fsdp")
    per_node = environment.processes_per_node(env.world_size)  # refused where it is no number, read by the mesh or not
    replicas, shards = mesh_shape(cfg, env)
    if shards == 1 and replicas > 1:
        return (f"HSDP: {replicas} replicas x 1 shard (--fsdp-shards 1): each process holds whole copies of the "
                f"weights, gradients and optimizer state, as under DDP; --fsdp-shards 0 splits them over all "
                f"{env.world_size}")
    if replicas > 1:
        return (f"HSDP: {replicas} replicas x {shards} shards (each tensor split over {shards} processes: "
                f"{shard_group_in_words(cfg, env)}; --fsdp-shards 0 splits it over all {env.world_size})")
    if shards > 1 and per_node == 1:
        return (f"FSDP: each tensor split over all {shards} processes ({shard_group_in_words(cfg, env)}; "
                f"--fsdp-shards 1 would keep whole copies on each, as DDP does)")
    return None


def default_shards(world_size):
    """--fsdp's shard group where --fsdp-shards is not given, and what makes it, in words: a node's processes
    (torchrun's LOCAL_WORLD_SIZE), so that only the gradients' all-reduce crosses the slower links between nodes; or
    all of them (0) where a node has one process, as one GPU per node is: a group of one would shard nothing, and
    each rank would hold DDP's whole copies, which --fsdp is passed to avoid."""
    per_node = environment.processes_per_node(world_size)
    if per_node == 1 and world_size > 1:
        return 0, "a node of one process, torchrun's LOCAL_WORLD_SIZE=1, shards nothing alone"
    return per_node, f"a node's {per_node} processes, torchrun's LOCAL_WORLD_SIZE={per_node}"


def shard_group_in_words(cfg, env):
    """What made --fsdp's shard group of cfg.fsdp_shards: the flag, or the default (default_shards) it equals."""
    shards, why = default_shards(env.world_size)
    return why if cfg.fsdp_shards == shards else f"--fsdp-shards {cfg.fsdp_shards}"


def mesh_shape(cfg, env):
    """(replicas, shards) of --fsdp's processes: each tensor split over a group of shards processes (--fsdp-shards,
    its default filled in by final_settings: default_shards; 0: all of them), and each group a replica of the
    others. Refuses, in one line, a group size that does not divide the processes."""
    shards = cfg.fsdp_shards or env.world_size
    if env.world_size % shards:
        raise UsageError(f"--fsdp's shard groups of {shards} ({shard_group_in_words(cfg, env)}) do not divide the "
                         f"{env.world_size} process(es); pass --fsdp-shards with a divisor of {env.world_size}, or 0 "
                         f"to shard over all of them")
    return env.world_size // shards, shards


def device_mesh(cfg, env):
    """HSDP's 2-D mesh of processes, ("replicate", "shard"): rank r is shard r % shards of replica r // shards, and
    torchrun numbers a node's processes in a row, so a shard group is a node. None for one replica: FSDP's own mesh,
    of all the processes."""
    replicas, shards = mesh_shape(cfg, env)
    if replicas == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(env.device_type, (replicas, shards), mesh_dim_names=("replicate", "shard"))


def shard_model(model, cfg, env):
    """FSDP2, in place: each block, then the rest (embedding, final norm, head), becomes a group whose tensors are
    split over the ranks of a shard group, each rank holding 1/shards of every one (device_mesh). A group's weights
    are gathered whole just before its forward and backward and freed after them, and its gradients are
    reduce-scattered: each rank receives the sum of its own slice, then under HSDP all-reduced over the replicas. The
    optimizers then step on slices, so their state is sharded too."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype, device_type, mesh = cfg.dtype, env.device_type, device_mesh(cfg, env)
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
                    fully_shard(norm, mesh=mesh)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=block_policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)  # the head's backward comes first: no gather of it again
    return model
