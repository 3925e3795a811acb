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


def optimizer_bytes(blocks, rest, recipe):
    """The state of the optimizers for so many block parameters and others: AdamW's two fp32 moments for every
    parameter (gpt2); the modern recipe's Muon keeps one fp32 momentum per block matrix, and its Adam two moments for
    the embedding and the (untied) head."""
    return 4 * blocks + 8 * rest if recipe == "modern" else 8 * (blocks + rest)


def model_state(params, world, recipe, accumulation):
    """Bytes per rank of everything but the activations: {row: (DDP, FSDP)}, None where the row is not the layout's."""
    n, blocks, rest = numel(params.blocks + params.rest), numel(params.blocks), numel(params.rest)
    shard = shard_numel(params.blocks + params.rest, world)
    rows = {
        "weights": (4 * n, 4 * shard),  # fp32 master weights: whole on every DDP rank, a 1/world slice under FSDP
        "gradients": (4 * n, 4 * shard),
        "optimizer": (optimizer_bytes(blocks, rest, recipe),
                      optimizer_bytes(shard_numel(params.blocks, world), shard_numel(params.rest, world), recipe)),
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


# The bytes per token that the compiled bf16 step's forward pass keeps for its backward, as saved_per_token counts
# them (torch 2.13): in units of the width C, per layer and outside the layers (the embedding's output, the final
# norm's input), and in units of the vocabulary V (the bf16 logits). Korthikanti et al. 2022 count 34*C per layer for
# GPT-2's block with flash attention.
SAVED_PER_TOKEN = {"gpt2": (36, 6, 2), "modern": (42, 6, 2)}
# The same of the eager fp32 step, a CPU's default: more than with bf16 autocast or compiled, so a bound for them too
SAVED_PER_TOKEN_EAGER = {"gpt2": (64, 8, 4), "modern": (76, 12, 8)}
# The logits' bytes per token, in units of V, at the eager fp32 step's peak: those saved (F.cross_entropy's fp32
# log-softmax; the modern recipe's soft-capped logits too) and the backward's fp32 gradients beside them. Measured on a
# CPU as the address space's growth with freed memory given back (docs/LOG.md, 2026-11-29), as is --loss chunked's,
# whose chunk holds its logits, their exponentials and gradient at once: a bound at any number of rows
LOGITS_PEAK_EAGER = {("gpt2", "full"): 12, ("modern", "full"): 16, ("gpt2", "chunked"): 20, ("modern", "chunked"): 24}


def activation_bytes(recipe, n_layer, n_embd, batch_size, seq_len, saved=SAVED_PER_TOKEN):
    """What the forward pass keeps for the backward, but the logits: saved's bytes (SAVED_PER_TOKEN, or
    SAVED_PER_TOKEN_EAGER), the same for DDP and FSDP."""
    per_layer, outside, _ = saved[recipe]
    return (per_layer * n_layer + outside) * n_embd * batch_size * seq_len


def logits_bytes(recipe, batch_size, seq_len, vocab_size):
    """(DDP, FSDP): the bf16 (B*T, V) logits the backward needs (SAVED_PER_TOKEN). GPT-2's compiled loss writes their
    gradient over them (train_gpt2.CrossEntropyWithPointwiseBackward); the modern recipe's soft-capped loss keeps
    F.cross_entropy's backward, whose gradient sits beside them where the step is one compiled graph (DDP's layout);
    under FSDP, whose groups compile as graphs of their own, none was measured (docs/LOG.md, 2026-11-25)."""
    saved = SAVED_PER_TOKEN[recipe][2] * batch_size * seq_len * vocab_size
    return (2 * saved if recipe == "modern" else saved), saved


def eager_step_bytes(params, cfg, world, batch_size, optimizer_held):
    """What an eager training step of batch_size sequences of cfg's model (Parameters params) adds to the weights of
    each of world processes at its peak, in bytes: the gradients, the optimizers' state unless optimizer_held (a
    resumed run's), the layout's copies, the activations and the logits (SAVED_PER_TOKEN_EAGER, LOGITS_PEAK_EAGER).
    It counts every gradient at the peak, where the backward has made few yet: GPT-2 124M's step of 1 x 1024 tokens
    on a CPU, 2.54 GiB here, took 2.09 (docs/LOG.md, 2026-11-29)."""
    layout = 1 if cfg.fsdp else 0
    rows = model_state(params, world, cfg.recipe, cfg.total_batch_size // (batch_size * cfg.seq_len * world))
    state = sum(rows[key][layout] or 0 for key in ("gradients", "ddp_buckets", "fsdp_gathered", "fsdp_accumulation"))
    state += 0 if optimizer_held else rows["optimizer"][layout]
    tokens = batch_size * cfg.seq_len
    logits = LOGITS_PEAK_EAGER[cfg.recipe, cfg.loss] * tokens * cfg.vocab_size
    return state + activation_bytes(cfg.recipe, params.n_layer, cfg.n_embd, batch_size, cfg.seq_len,
                                    SAVED_PER_TOKEN_EAGER) + logits
