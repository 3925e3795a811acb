"""
The memory model: what a training step holds, from the model's own parameters. The model state as DDP and FSDP lay it
out (weights, gradients, the optimizers' state, the copies each layout adds), the activations the forward pass keeps
for its backward (bytes per token, counted: benchmarks/memory.py's saved_per_token), and the logits.
benchmarks/memory.py prints it per GPU for a compiled bf16 step; microbatch.py compares a CPU's eager step with the
memory the machine can give, before the first step (docs/memory.md).
"""

import math
from typing import NamedTuple


class Parameters(NamedTuple):
    """The shapes of the model's parameters: those of its transformer blocks, and the rest (the embedding, the
    position table, the final norm and the head: the root of FSDP's sharding)."""
    n_layer: int
    blocks: list
    rest: list


def parameters_of(model):
    """A model's Parameters (either recipe's: its blocks are model.transformer.h), a tied weight once."""
    in_blocks = {id(p) for p in model.transformer.h.parameters()}
    params = list(model.parameters())  # a tied weight (gpt2's embedding and head) once
    return Parameters(len(model.transformer.h), [tuple(p.shape) for p in params if id(p) in in_blocks],
                      [tuple(p.shape) for p in params if id(p) not in in_blocks])


def numel(shapes):
    return sum(math.prod(shape) for shape in shapes)


def shard_numel(shapes, world):
    """Rank 0's share, the largest: FSDP2 splits each tensor's rows (dim 0) into world chunks of ceil(rows / world)."""
    return sum(-(-shape[0] // world) * math.prod(shape[1:]) for shape in shapes)


def optimizer_bytes(blocks, rest, memory):
    """The state of the optimizers for so many block parameters and others, at the recipe's bytes per parameter
    (StepMemory memory): GPT-2's AdamW keeps two fp32 moments for every parameter; the modern recipe's Muon keeps one
    fp32 momentum per block matrix, and its Adam two moments for the embedding and the (untied) head."""
    per_block, per_rest = memory.optimizer_bytes
    return per_block * blocks + per_rest * rest


def model_state(params, world, memory, accumulation):
    """Bytes per rank of everything but the activations, for a recipe's StepMemory memory: {row: (DDP, FSDP)}, None
    where the row is not the layout's."""
    n, blocks, rest = numel(params.blocks + params.rest), numel(params.blocks), numel(params.rest)
    shard = shard_numel(params.blocks + params.rest, world)
    rows = {
        "weights": (4 * n, 4 * shard),  # fp32 master weights: whole on every DDP rank, a 1/world slice under FSDP
        "gradients": (4 * n, 4 * shard),
        "optimizer": (optimizer_bytes(blocks, rest, memory),
                      optimizer_bytes(shard_numel(params.blocks, world), shard_numel(params.rest, world), memory)),
        # a copy of the gradients (train_gpt2 makes DDP without gradient_as_bucket_view); a single process gets no DDP
        "ddp_buckets": (4 * n if world > 1 else 0, None),
        # the root gathered in fp32 and kept from forward to backward (reshard_after_forward=False), and about two
        # blocks in bf16: the one computing and the one prefetched
        "fsdp_gathered": (None, 4 * rest + 2 * 2 * blocks // params.n_layer),
        # the micro-steps before the last reduce nothing: each rank keeps every parameter's whole gradient, in fp32
        # (the reduce dtype); DDP's no_sync adds them up in its gradients above
        "fsdp_accumulation": (None, 4 * n if accumulation > 1 else 0),
        # autocast's bf16 copy of each fp32 weight a matmul reads, kept for the backward: under FSDP the root's alone,
        # the blocks' being gathered in bf16
        "bf16_copies": (2 * n, 2 * rest),
    }
    rows["model_state"] = tuple(sum(row[i] or 0 for row in rows.values()) for i in (0, 1))
    return rows


def activation_bytes(saved_per_token, n_layer, n_embd, batch_size, seq_len):
    """What the forward pass keeps for the backward, but the logits: the bytes of a recipe's saved_per_token (its
    StepMemory's, compiled or eager), the same for DDP and FSDP."""
    per_layer, outside, _ = saved_per_token
    return (per_layer * n_layer + outside) * n_embd * batch_size * seq_len


def logits_bytes(memory, batch_size, seq_len, vocab_size):
    """(DDP, FSDP): the bf16 (B*T, V) logits the backward needs (StepMemory memory's saved_per_token), and under DDP
    their gradient beside them where the recipe's loss keeps it (ddp_logits_copies). GPT-2's compiled loss writes
    their gradient over them (train_gpt2.CrossEntropyWithPointwiseBackward); the modern recipe's soft-capped loss keeps
    F.cross_entropy's backward, whose gradient sits beside them where the step is one compiled graph (DDP's layout);
    under FSDP, whose groups compile as graphs of their own, none was measured (docs/LOG.md, 2026-11-25)."""
    saved = memory.saved_per_token[2] * batch_size * seq_len * vocab_size
    return memory.ddp_logits_copies * saved, saved


def eager_step_bytes(params, cfg, memory, world, batch_size, optimizer_held):
    """What an eager training step of batch_size sequences of cfg's model (Parameters params, StepMemory memory) adds
    to the weights of each of world processes at its peak, in bytes: the gradients, the optimizers' state unless
    optimizer_held (a resumed run's), the layout's copies, the activations and the logits (memory's
    saved_per_token_eager and logits_peak_eager).
    It counts every gradient at the peak, where the backward has made few yet: GPT-2 124M's step of 1 x 1024 tokens
    on a CPU, 2.54 GiB here, took 2.09 (docs/LOG.md, 2026-11-29)."""
    layout = 1 if cfg.fsdp else 0
    rows = model_state(params, world, memory, cfg.total_batch_size // (batch_size * cfg.seq_len * world))
    state = sum(rows[key][layout] or 0 for key in ("gradients", "ddp_buckets", "fsdp_gathered", "fsdp_accumulation"))
    state += 0 if optimizer_held else rows["optimizer"][layout]
    tokens = batch_size * cfg.seq_len
    logits = memory.logits_peak_eager[cfg.loss] * tokens * cfg.vocab_size
    return state + activation_bytes(memory.saved_per_token_eager, params.n_layer, cfg.n_embd, batch_size,
                                    cfg.seq_len) + logits
