"""
Train GPT-2 from scratch, in one file you can read top to bottom.

    python train_gpt2.py                                    # one GPU, or a CPU / Apple GPU for debugging
    torchrun --standalone --nproc_per_node=8 train_gpt2.py  # every GPU of one node
    python train_gpt2.py --help                             # every setting, with its default

Without FineWeb shards (make them with `python fineweb.py`) it trains a small model on tiny Shakespeare.
"""

import argparse
import contextlib
import datetime
import functools
import gc
import math
import os
import shlex
import signal
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import load_file
from torch.nn import functional as F

import hellaswag
import hf_export
import plumbing
from plumbing import EOT, GPT2_VOCAB, UsageError, failing_together

# torch.distributed.nn is imported before any process group exists: imported after one (as DDP does), its group.WORLD
# default arguments keep the group and its threads alive past destroy_process_group, and a gloo thread alive at exit
# can abort the process
if dist.is_available():  # builds without torch.distributed have none of these
    import torch.distributed.checkpoint as dcp  # --fsdp's checkpoints
    import torch.distributed.nn  # noqa: F401
    from torch.distributed.checkpoint import state_dict as dcp_state  # state dicts named by parameter, sharded or not
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor
try:  # torch.optim.Muon's own steps (torch 2.9 and later), so that ShardedMuon's update is exactly Muon's; private
    from torch.optim._muon import _adjust_lr as muon_lr_scale
    from torch.optim._muon import _zeropower_via_newtonschulz as orthogonalize
except ImportError:  # --fsdp --recipe modern is refused then (check_recipe), and nothing else needs them
    muon_lr_scale = orthogonalize = None

HERE = os.path.dirname(os.path.abspath(__file__))
PADDED_VOCAB = 50304  # GPT-2's 50257 tokens padded to a multiple of 128: matmuls of that width run faster on GPUs

# -----------------------------------------------------------------------------
# Settings: edit the defaults here, or pass any of them as a flag (n_layer -> --n-layer).
# The defaults are the GPT-2 124M recipe on FineWeb-Edu 10B tokens.


def setting(default, help, choices=None):
    return field(default=default, metadata={"help": help, "choices": choices})


MODEL_SIZES = {  # n_layer, n_head, n_embd of OpenAI's four GPT-2 models
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M parameters
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}


@dataclass
class TrainConfig:
    # data and outputs
    data: str = setting("edu_fineweb10B", "a directory of *train* and *val* shards (.npy or .bin), or a text file")
    log_dir: str = setting("log", "where log.jsonl and checkpoints go")
    # model
    model: str = setting("gpt2", "size preset for --n-layer/--n-head/--n-embd", list(MODEL_SIZES))
    n_layer: int = setting(0, "transformer blocks (0: from --model)")
    n_head: int = setting(0, "attention heads (0: from --model)")
    n_embd: int = setting(0, "embedding width (0: from --model)")
    block_size: int = setting(1024, "longest context the model can take (the rows of its position table)")
    vocab_size: int = setting(PADDED_VOCAB, "embedding rows: the 50257 GPT-2 tokens padded to a multiple of 128, "
                                            "for faster matmuls")
    attn: str = setting("sdpa", "sdpa (flash attention) or naive (explicit masked softmax, for tests)",
                        ["sdpa", "naive"])
    recipe: str = setting("gpt2", "gpt2: GPT-2 exactly; modern: rotary, QK-norm, ReLU², an untied zero-init head, "
                          "logit soft-cap, Muon, and a constant learning rate then a cool-down (the README's Modern "
                          "recipe)", ["gpt2", "modern"])
    init_from: str = setting("scratch", "start from random weights or from OpenAI's", ["scratch", *MODEL_SIZES])
    # batch: total_batch_size = batch_size * seq_len * accumulation steps * processes
    batch_size: int = setting(64, "micro-batch: sequences per forward pass in each process")
    seq_len: int = setting(1024, "tokens per sequence")
    total_batch_size: int = setting(524288, "tokens per optimizer step, over all processes (2**19, GPT-3 small's 0.5M)")
    # optimization
    max_steps: int = setting(19073, "optimizer steps (19073 x 524288 tokens: one pass over FineWeb-Edu 10B)")
    warmup_steps: int = setting(715, "steps of linear learning-rate warmup")
    max_lr: float = setting(6e-4, "peak learning rate; cosine decay then takes it to min_lr_ratio of this")
    min_lr_ratio: float = setting(0.1, "final learning rate as a fraction of --max-lr")
    weight_decay: float = setting(0.1, "AdamW weight decay of the matmul and embedding weights")
    muon_lr: float = setting(0.02, "--recipe modern: Muon's learning rate, for the blocks' matrices")
    embed_lr: float = setting(0.2, "--recipe modern: Adam's learning rate for the token embedding")
    head_lr: float = setting(0.004, "--recipe modern: Adam's learning rate for the output layer")
    cooldown_frac: float = setting(0.4, "--recipe modern: the last fraction of the run, over which the learning rate "
                                        "falls linearly to --min-lr-ratio of its peak")
    logit_softcap: float = setting(15.0, "--recipe modern: logits are squashed smoothly into (-cap, cap)")
    grad_clip: float = setting(1.0, "clip the global gradient norm to this")
    seed: int = setting(1337, "seeds the weights, the shard order and the samples")
    # evaluation, samples, checkpoints
    eval_every: int = setting(250, "steps between validation and samples (0: only at the end)")
    val_tokens: int = setting(10485760, "validation tokens: a fixed set, the same for any number of processes")
    hellaswag_every: int = setting(250, "steps between HellaSwag evaluations (0: never; the default is 0 without CUDA)")
    hellaswag_file: str = setting("", "a local hellaswag_val.jsonl, for machines with no internet")
    cache_dir: str = setting("", "where HellaSwag and OpenAI's weights are downloaded to (empty: $GPT2_CACHE_DIR, "
                                 "else ~/.cache/train_gpt2)")
    eval_only: bool = setting(False, "evaluate the latest checkpoint in --log-dir (or --resume's, or --init-from's "
                                     "weights), log it, and stop")
    prompt: str = setting("Hello, I'm a language model,", "prompt of the samples")
    num_samples: int = setting(4, "samples printed at each evaluation")
    max_new_tokens: int = setting(32, "length of each sample")
    sample: str = setting("", "print samples from this checkpoint and exit, with no training")
    export_hf: str = setting("", "write the latest checkpoint in --log-dir (or --resume's, or --init-from's weights) "
                                 "to this new directory as a Hugging Face model, and exit")
    checkpoint_every: int = setting(2500, "steps between checkpoints (0: only at the end and on SIGTERM/SIGINT)")
    keep_checkpoints: int = setting(2, "how many of the latest checkpoints to keep")
    resume: str = setting("auto", "auto: from the latest checkpoint in --log-dir; or a checkpoint path; "
                                  "--no-resume: start fresh")
    max_bad_steps: int = setting(5, "stop after this many steps in a row with a non-finite loss or gradient norm")
    # experiment tracking
    wandb_project: str = setting("", "also log to this Weights & Biases project, from rank 0 (empty: off; needs "
                                     "pip install wandb)")
    wandb_run_name: str = setting("", "the W&B run's name (empty: W&B makes one up)")
    # hardware and speed
    device: str = setting("auto", "auto picks cuda, then mps, then cpu", ["auto", "cpu", "cuda", "mps"])
    dtype: str = setting("auto", "auto: bf16 on Ampere and newer, fp16 on older GPUs, fp32 elsewhere",
                         ["auto", "fp32", "tf32", "bf16", "fp16"])
    compile: Optional[bool] = setting(None, "torch.compile the model (default: on for CUDA)")
    compile_mode: str = setting("default", "torch.compile's mode: max-autotune searches for faster matmul kernels "
                                "(compiles for minutes), reduce-overhead adds CUDA graphs",
                                ["default", "max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead"])
    fused_adamw: bool = setting(True, "use the fused CUDA kernel of AdamW")
    fsdp: bool = setting(False, "shard the weights, gradients and optimizer state over the processes (FSDP2) instead "
                                "of copying them to each (DDP): for models too large for one GPU (the README's FSDP)")
    loss: str = setting("full", "full: one cross-entropy over all the (B*T, vocab) logits, which compile fuses; "
                        "chunked: the lm_head matmul and the cross-entropy a chunk of rows at a time, never holding "
                        "all the logits (less memory)", ["full", "chunked"])


# A model that learns tiny Shakespeare in a few minutes on a laptop CPU: the default when no shards are there. Its
# vocab is not padded: padding speeds up GPU matmuls, not a CPU's. The 50257-wide output layer costs most of a step,
# so depth is cheap (the README has the search); 900 steps are three passes, ending where the validation text follows.
SHAKESPEARE = dict(
    data=os.path.join(HERE, "input.txt"), n_layer=8, n_head=4, n_embd=128, block_size=256, vocab_size=GPT2_VOCAB,
    batch_size=8, seq_len=128, total_batch_size=1024, max_steps=900, warmup_steps=50, max_lr=2e-3, eval_every=150,
    val_tokens=16384, hellaswag_every=0, checkpoint_every=0, prompt="\n", max_new_tokens=48, num_samples=3,
)
# Fine-tuning OpenAI's GPT-2 on it instead (--init-from gpt2): a far gentler learning rate, and fewer steps.
SHAKESPEARE_FINETUNE = dict(max_steps=100, warmup_steps=10, max_lr=3e-5, eval_every=25)
# The modern recipe (--recipe modern) on FineWeb: a fifth of GPT-2's steps (the speedrun's plain-attention trainer
# reached GPT-2's loss in 3,250; not yet measured with this one), at full rate from the first. On tiny Shakespeare:
# the rates of benchmarks/recipes.py's search, on a model of about that size (the README has it).
MODERN = dict(max_steps=3815, warmup_steps=0)
SHAKESPEARE_MODERN = dict(warmup_steps=0, muon_lr=0.02, embed_lr=0.3, head_lr=0.004)
# the settings each recipe alone reads: given with the other, they would do nothing
RECIPE_SETTINGS = {"gpt2": ("max_lr", "weight_decay"),
                   "modern": ("muon_lr", "embed_lr", "head_lr", "cooldown_frac", "logit_softcap")}


def parse_args(argv=None):
    """Returns the config and the names of the settings given on the command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     argument_default=argparse.SUPPRESS)
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        help = f.metadata["help"] + ("" if f.default is None else f" (default: {f.default})")
        if f.type in (bool, Optional[bool]):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help)
        else:
            parser.add_argument(flag, type=f.type, choices=f.metadata["choices"], help=help)
    parser.add_argument("--no-resume", dest="resume", action="store_const", const="none",
                        help="start fresh, moving an earlier run's files in --log-dir aside")
    given = vars(parser.parse_args(argv))
    return TrainConfig(**given), set(given)


# -----------------------------------------------------------------------------
# The model: GPT-2 exactly, so OpenAI's weights load into it one-to-one. The modern recipe changes it where the lines
# marked "modern:" say (the README's Modern recipe has where each change comes from).


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = PADDED_VOCAB
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    attn: str = "sdpa"  # or "naive"
    loss: str = "full"  # or "chunked"
    recipe: str = "gpt2"  # or "modern"
    logit_softcap: float = 15.0  # modern only


def rotary_tables(head_size, n_positions, base=10000.0):
    """cos and sin (T, hs/2) of the angle position * frequency, for frequencies from 1 down to about 1/base."""
    frequencies = base ** -(torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)  # (hs/2,)
    angles = torch.outer(torch.arange(n_positions, dtype=torch.float32), frequencies)  # (T, hs/2)
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    """Rotary embedding: each pair (x1[i], x2[i]) of a query or key turned by its position's angle i, so that q.k
    depends on how far apart the two positions are, not where they are."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, nh, T, hs/2) each
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)  # (B, nh, T, hs)


def make_norm(config):
    if config.recipe == "modern":  # modern: RMSNorm with no gain or bias, as the matrices after it can learn any scale
        return nn.RMSNorm(config.n_embd, elementwise_affine=False)
    return nn.LayerNorm(config.n_embd)


def naive_attention(q, k, v):
    """Causal attention written out; the reference for SDPA and the slow rung of the speed ladder."""
    T, S = q.size(-2), k.size(-2)  # queries are the last T of the S keys
    att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))  # (B, nh, T, S)
    future = torch.ones(T, S, dtype=torch.bool, device=q.device).triu(S - T + 1)
    att = att.masked_fill(future, float("-inf")).softmax(dim=-1)
    return att @ v  # (B, nh, T, hs)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.naive, self.modern = config.n_head, config.attn == "naive", config.recipe == "modern"
        bias = not self.modern  # modern: no biases anywhere
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=bias)  # q, k, v of all heads in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=bias)
        self.c_proj.RESIDUAL_PROJECTION = True

    def forward(self, x, rotary=None, kv_cache=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if self.modern:
            q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))  # modern: QK-norm bounds q.k
            q, k = rotate(q, *rotary).to(v.dtype), rotate(k, *rotary).to(v.dtype)  # modern: rotary positions
            # (.to: autocast may run the norm in float32, and attention wants one dtype)
        if kv_cache is not None:  # sampling: one new token attends to the keys and values of all earlier ones
            if kv_cache:
                k, v = torch.cat([kv_cache[0], k], dim=2), torch.cat([kv_cache[1], v], dim=2)
            kv_cache[:] = [k, v]
        if self.naive:
            y = naive_attention(q, k, v)
        else:  # a single new token sees everything before it, so it needs no mask (generate feeds one at a time)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)  # flash attention
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.modern = config.recipe == "modern"
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=not self.modern)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2 used the tanh approximation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=not self.modern)
        self.c_proj.RESIDUAL_PROJECTION = True

    def forward(self, x):
        x = self.c_fc(x)
        x = F.relu(x).square() if self.modern else self.gelu(x)  # modern: ReLU², sparser and cheaper than GELU
        return self.c_proj(x)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x, rotary=None, kv_cache=None):
        x = x + self.attn(self.ln_1(x), rotary, kv_cache)
        return x + self.mlp(self.ln_2(x))


def soft_cap(logits, cap):
    return cap * torch.tanh(logits / cap)  # logits near 0 pass unchanged, large ones level off below cap


class ChunkedCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of the logits x @ weight.T (soft-capped, if cap) + mask over the targets that are not -1,
    a chunk of rows at a time: only (chunk, V) tensors ever exist, never (N, V). Each chunk's gradients are computed
    in the forward pass, while its logits exist; backward only scales them by the loss's own gradient."""

    @staticmethod
    def forward(ctx, x, weight, targets, mask, cap, dtype, chunk_rows, need_grads):
        ctx.dtypes = x.dtype, weight.dtype
        xd, wd = x.to(dtype), weight.to(dtype)  # (N, C), (V, C): the matmuls in the autocast dtype, as lm_head's are
        valid = targets != -1  # (N,)
        safe_targets = targets.clamp(min=0)  # -1 would index out of range; those rows count for nothing anyway
        loss_sum = torch.zeros((), device=x.device)
        grad_x = torch.empty(x.shape, device=x.device) if need_grads else None  # float32 sums, cast back in backward
        grad_w = torch.zeros(weight.shape, device=x.device) if need_grads else None
        for start in range(0, x.size(0), chunk_rows):
            rows = slice(start, start + chunk_rows)
            logits = (xd[rows] @ wd.T).float()  # (n, V)
            if cap:
                logits = soft_cap(logits, cap)  # modern
                if need_grads:
                    cap_slope = 1 - (logits / cap).square()  # (n, V) d soft_cap(z) / dz = 1 - tanh(z / cap)**2
            if mask is not None:
                logits += mask
            lse = logits.logsumexp(dim=-1)  # (n,)
            target_logits = logits.gather(1, safe_targets[rows, None]).squeeze(1)  # (n,)
            loss_sum += ((lse - target_logits) * valid[rows]).sum()
            if need_grads:  # d loss_i / d logits_i = softmax_i - one_hot(target_i), zero for the rows left out
                grad_logits = logits.sub_(lse[:, None]).exp_()  # (n, V) the softmax, in place of the logits
                grad_logits[torch.arange(len(lse), device=x.device), safe_targets[rows]] -= 1.0
                if cap:
                    grad_logits *= cap_slope
                grad_logits = grad_logits.mul_(valid[rows, None]).to(dtype)
                grad_x[rows] = grad_logits @ wd  # (n, C)
                grad_w += grad_logits.T @ xd[rows]  # (V, C)
        n_valid = valid.sum()
        ctx.save_for_backward(grad_x, grad_w, n_valid)
        return loss_sum / n_valid

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w, n_valid = ctx.saved_tensors
        scale = grad_loss / n_valid
        return (grad_x * scale).to(ctx.dtypes[0]), (grad_w * scale).to(ctx.dtypes[1]), *[None] * 6


def chunked_cross_entropy(x, weight, targets, mask=None, cap=None, chunk_rows=8192):
    """F.cross_entropy(soft_cap(x @ weight.T) + mask, targets, ignore_index=-1) with no (N, V) tensor: 8192 rows of
    50304 float32 logits are 1.6 GB, where all of a 64 x 1024 micro-batch's are 13 GB (and its gradient as much
    again)."""
    device_type = x.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    need_grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)  # evaluation needs none
    return ChunkedCrossEntropy.apply(x, weight, targets, mask, cap, dtype, chunk_rows, need_grads)


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.n_tokens = min(config.vocab_size, GPT2_VOCAB)  # rows past this are padding
        vocab_mask = torch.zeros(config.vocab_size)  # added to the logits: 0 for GPT-2's tokens,
        vocab_mask[GPT2_VOCAB:] = float("-inf")  # -inf for the padding ids, which get no probability and no gradient
        padded = config.vocab_size > GPT2_VOCAB
        self.register_buffer("vocab_mask", vocab_mask if padded else None, persistent=False)  # not saved
        self.modern = config.recipe == "modern"
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            # modern: no position table (rotary instead); in the dict, so that GPT-2's modules keep their order
            # and with it their random initial weights
            **({} if self.modern else {"wpe": nn.Embedding(config.block_size, config.n_embd)}),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=make_norm(config),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if not self.modern:  # modern: untied, the output layer and the embedding learn at rates of their own
            self.transformer.wte.weight = self.lm_head.weight  # weight tying, as in GPT-2
        cos, sin = rotary_tables(config.n_embd // config.n_head, config.block_size) if self.modern else (None, None)
        self.register_buffer("rotary_cos", cos, persistent=False)  # (block_size, hs/2)
        self.register_buffer("rotary_sin", sin, persistent=False)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            if hasattr(module, "RESIDUAL_PROJECTION"):  # keeps the residual stream's variance from growing with depth
                std *= (2 * self.config.n_layer) ** -0.5
            if self.modern:  # modern: zero for the blocks' outputs and the head (each block starts as the identity,
                # and the first predictions are uniform); for the rest, a scale set by the input width
                zero = hasattr(module, "RESIDUAL_PROJECTION") or module is self.lm_head
                std = 0.0 if zero else 0.5 * module.in_features**-0.5
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):  # modern: N(0, 1), as the norm after it sets its scale
            torch.nn.init.normal_(module.weight, mean=0.0, std=1.0 if self.modern else 0.02)

    def forward(self, idx, targets=None, kv_cache=None):
        """The logits (B, T, vocab_size), the padding ids at -inf; given targets, the mean loss instead."""
        x = self.trunk(idx, kv_cache)  # (B, T, C)
        return self.logits(x) if targets is None else self.loss(x, targets)

    def trunk(self, idx, kv_cache=None):
        """The final hidden states (B, T, C) of the tokens idx (B, T), which follow those in kv_cache, if any."""
        past = kv_cache[0][0].size(2) if kv_cache and kv_cache[0] else 0
        pos = torch.arange(past, past + idx.size(1), dtype=torch.long, device=idx.device)  # (T,)
        if self.modern:  # modern: the embedding normed; the positions go to attention as rotary angles
            x = F.rms_norm(self.transformer.wte(idx), (self.config.n_embd,))  # (B, T, C)
            rotary = self.rotary_cos[pos], self.rotary_sin[pos]  # (T, hs/2) each
        else:
            x, rotary = self.transformer.wte(idx) + self.transformer.wpe(pos), None  # (B, T, C)
        for i, block in enumerate(self.transformer.h):
            x = block(x, rotary, None if kv_cache is None else kv_cache[i])
        return self.transformer.ln_f(x)  # (B, T, C)

    def logits(self, x):
        logits = self.lm_head(x)  # (B, T, V)
        if self.modern:  # modern: soft-capped, in float32 (bf16 would round the logits near the cap to a few values)
            logits = soft_cap(logits.float(), self.config.logit_softcap)
        if self.vocab_mask is not None:  # in the logits' dtype: bf16 stays bf16; compile fuses the add into the loss
            logits = logits + self.vocab_mask.to(logits.dtype)
        return logits

    def loss(self, x, targets):
        """The mean cross-entropy over the targets that are not -1 (evaluate_val's filler rows)."""
        if self.config.loss == "chunked":  # a chunk of rows at a time: no (B*T, V) logits in memory
            cap = self.config.logit_softcap if self.modern else None
            return chunked_cross_entropy(x.flatten(0, 1), self.lm_head.weight, targets.flatten(), self.vocab_mask, cap)
        return F.cross_entropy(self.logits(x).flatten(0, 1), targets.flatten(), ignore_index=-1)

    @classmethod
    def from_pretrained(cls, name, config=None, cache_dir=None):
        """OpenAI's GPT-2 `name` (gpt2, gpt2-medium, gpt2-large, gpt2-xl) from the Hugging Face hub, or $HF_ENDPOINT's
        mirror, downloaded once into the cache; or, if name is a directory, the GPT-2 in it (model.safetensors and
        config.json, as --export-hf writes them). A config, if given, must have that model's shapes."""
        if os.path.isdir(name):
            path, config = os.path.join(name, "model.safetensors"), config or GPTConfig(**hf_export.read_shape(name))
            fix = "export it again"
        else:
            fix = "delete it to download it again"
            endpoint = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
            path = os.path.join(cache_dir or plumbing.default_cache_dir(), name, "model.safetensors")
            headers = {"Authorization": f"Bearer {os.environ['HF_TOKEN']}"} if os.environ.get("HF_TOKEN") else None
            plumbing.download_once_per_node(f"{endpoint}/openai-community/{name}/resolve/main/model.safetensors", path,
                                            plumbing.check_safetensors, "safetensors file",
                                            "set HF_ENDPOINT to a mirror (or HF_TOKEN if it needs a login)", headers)
        try:
            weights = load_file(path)
        except Exception as e:
            raise UsageError(f"{path} is not a readable safetensors file ({e}); {fix}")
        model = cls(config or GPTConfig(**MODEL_SIZES[name]))
        ours = model.state_dict()
        loaded = set()
        with torch.no_grad():
            ours["transformer.wte.weight"].zero_()  # the rows past OpenAI's 50257 are padding: never used or scored
            for key, tensor in weights.items():
                key = "transformer." + key.removeprefix("transformer.")
                if key.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers, not weights
                    continue
                if key not in ours:
                    raise UsageError(f"{path}: unexpected tensor {key}; is it a GPT-2 checkpoint?")
                if key.endswith(hf_export.CONV1D):  # OpenAI's Conv1D stores (in, out); nn.Linear wants (out, in)
                    tensor = tensor.t()
                # all of GPT-2's token rows, n_tokens of them: a file with fewer would leave tokens at zero
                target = ours[key][: model.n_tokens] if key == "transformer.wte.weight" else ours[key]
                if target.shape != tensor.shape:
                    raise UsageError(f"{path}: {key} has shape {tuple(tensor.shape)}, expected "
                                     f"{tuple(target.shape)} for {name}")
                target.copy_(tensor)
                loaded.add(key)
        missing = set(ours) - loaded - {"lm_head.weight"}  # lm_head is tied to wte
        if missing:
            raise UsageError(f"{path} lacks {sorted(missing)[:3]}...; {fix}")
        return model


def gpt_config(cfg):
    """The model's part of the settings: each field of GPTConfig is a setting of the same name."""
    return GPTConfig(**{f.name: getattr(cfg, f.name) for f in fields(GPTConfig)})


def make_model(cfg, device, pretrained=False):
    """The model the settings describe, on device: random weights, the same on every rank, or OpenAI's if pretrained."""
    torch.manual_seed(cfg.seed)
    config = gpt_config(cfg)
    model = GPT.from_pretrained(cfg.init_from, config, cfg.cache_dir or None) if pretrained else GPT(config)
    return model.to(device)


def flops_per_token(config, seq_len):
    """6N for the matmuls' forward and backward, plus attention's 12*L*H*Q*T (PaLM's appendix B). N counts every
    parameter but the position table: the tied embedding is the output layer's matmul."""
    C, L = config.n_embd, config.n_layer
    n_params = config.vocab_size * C + L * (12 * C**2 + 13 * C) + 2 * C
    if config.recipe == "modern":  # no biases or gains; its own embedding table is a lookup, not a matmul
        n_params = config.vocab_size * C + L * 12 * C**2
    return 6 * n_params + 12 * L * C * seq_len


@torch.no_grad()
def generate(model, prompt_tokens, num_samples, max_new_tokens, generator, top_k=50):
    """The prompt and max_new_tokens sampled after it, top-k from the softmax. A KV cache makes each new token cost
    one position; once the context outgrows the block, the window slides: each token is predicted from the last
    block_size, recomputed."""
    device, block_size = model.lm_head.weight.device, model.config.block_size
    tokens = torch.tensor(prompt_tokens, dtype=torch.long, device=device).repeat(num_samples, 1)  # (N, P)
    kv_cache = [[] for _ in model.transformer.h]
    logits = model(tokens[:, -block_size:], kv_cache=kv_cache)
    for _ in range(max_new_tokens):
        probs = F.softmax(logits[:, -1].float(), dim=-1)  # (N, V): exactly 0 for the padding ids, at -inf
        top_probs, top_ids = torch.topk(probs, min(top_k, probs.size(-1)), dim=-1)  # (N, k)
        choice = torch.multinomial(top_probs, 1, generator=generator)  # (N, 1)
        next_ids = torch.gather(top_ids, -1, choice)  # (N, 1)
        tokens = torch.cat([tokens, next_ids], dim=1)
        if tokens.size(1) == len(prompt_tokens) + max_new_tokens:
            break  # no logits needed after the last token
        if kv_cache[0][0].size(2) < block_size:
            logits = model(next_ids, kv_cache=kv_cache)
        else:  # the positions are full: start the cache again from the last block_size tokens
            kv_cache = [[] for _ in model.transformer.h]
            logits = model(tokens[:, -block_size:], kv_cache=kv_cache)
    return tokens.tolist()


# -----------------------------------------------------------------------------
# Data: token shards read through memory maps, or a text file tokenized in memory.


def check_token_ids(tokens, vocab_size, source):
    n_tokens = min(vocab_size, GPT2_VOCAB)  # the ids the model scores: padding rows are not tokens
    if len(tokens) and int(tokens.max()) >= n_tokens:
        raise UsageError(f"{source} holds token id {int(tokens.max())}, but the model scores ids below {n_tokens} only "
                         f"(--vocab-size {vocab_size}, capped at GPT-2's {GPT2_VOCAB}); re-create the data with the "
                         f"GPT-2 tokenizer")


def shards_changed(saved, now):
    """What differs between the shards a checkpoint was trained on and these, in words ("" if nothing)."""
    before, after = dict(saved), dict(now)
    changes = [f"{name} is gone" if name not in after else f"{name} had {tokens:,} tokens, now {after[name]:,}"
               for name, tokens in before.items() if after.get(name) != tokens]
    changes += [f"{name} is new" for name in after if name not in before]
    return "; ".join(changes) or ("the shards are in another order" if saved != now else "")


class TokenStream:
    """The training tokens as one endless stream: every shard end to end, in an order reshuffled each epoch.

    Each optimizer step consumes the next total_batch_size tokens (plus one, for the last target). That global
    batch is cut into chunks of B*T tokens, and micro-step m of rank r reads chunk m*world + r, so any split of
    the same total batch over processes and accumulation steps trains on exactly the same tokens.
    """

    def __init__(self, shards, names, seed):
        nonempty = [i for i, shard in enumerate(shards) if len(shard)]  # an empty shard would stall seek()
        self.shards, self.names, self.seed = [shards[i] for i in nonempty], [names[i] for i in nonempty], seed
        self.epoch, self.index, self.offset = 0, 0, 0  # now in shard order(epoch)[index], at token offset

    def order(self, epoch):
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))

    def seek(self, epoch, index, offset, n):
        """The position n tokens on from (epoch, index, offset)."""
        offset += n
        while offset >= (length := len(self.shards[self.order(epoch)[index]])):
            offset -= length
            index += 1
            if index == len(self.shards):
                epoch, index = epoch + 1, 0
        return epoch, index, offset

    def read(self, n, vocab_size):
        """The next n tokens from the current position, as int64."""
        epoch, index, offset = self.epoch, self.index, self.offset
        pieces = []
        while n > 0:
            shard = self.order(epoch)[index]
            piece = self.shards[shard][offset: offset + n]
            check_token_ids(piece, vocab_size, self.names[shard])
            pieces.append(piece)
            n -= len(piece)
            epoch, index, offset = self.seek(epoch, index, offset, len(piece))
        return torch.from_numpy(np.concatenate(pieces).astype(np.int64))

    def next_step(self, B, T, accum_steps, rank, world_size, vocab_size):
        """This rank's micro-batches (x, y) for one optimizer step, then moves past the whole global batch."""
        # every rank reads and checks the whole global batch, so that bad data stops all ranks at once, alike
        window = self.read(accum_steps * world_size * B * T + 1, vocab_size)
        batches = []
        for micro in range(accum_steps):
            start = (micro * world_size + rank) * B * T
            buf = window[start: start + B * T + 1]
            batches.append((buf[:-1].view(B, T), buf[1:].view(B, T)))  # inputs, and targets one token later
        step_tokens = accum_steps * world_size * B * T
        self.epoch, self.index, self.offset = self.seek(self.epoch, self.index, self.offset, step_tokens)
        return batches

    def shard_sizes(self):
        """[name, tokens] of each shard, by file name only: the same shards moved to another directory are the same."""
        return [[os.path.basename(name), len(shard)] for name, shard in zip(self.names, self.shards)]

    def state_dict(self):
        return {"epoch": self.epoch, "index": self.index, "offset": self.offset, "seed": self.seed,
                "shards": self.shard_sizes()}

    def load_state_dict(self, state):
        """The position of a checkpoint, which means something only over the same shards in the same order."""
        if state["seed"] != self.seed:
            raise UsageError(f"the checkpoint's data position is for --seed {state['seed']}, not --seed {self.seed}: "
                             f"the shard order depends on it; pass --seed {state['seed']}, or --no-resume to start "
                             f"over")
        change = shards_changed(state["shards"], self.shard_sizes())
        if change:
            raise UsageError(f"the checkpoint's data position is in other training shards than those of --data: "
                             f"{change}; pass the --data it was trained on, or --no-resume to start over")
        self.epoch, self.index, self.offset = state["epoch"], state["index"], state["offset"]


def read_text(path):
    """A text file's tokens: the first 90% to train on, the last 10% to validate."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--data {path}: cannot read it as UTF-8 text ({e})")
    tokens = np.array(plumbing.gpt2_tokenizer().encode_ordinary(text), dtype=np.uint16)
    split = int(0.9 * len(tokens))
    return tokens[:split], tokens[split:]


def load_data(cfg):
    """The train stream and the fixed validation tokens, from a shard directory or a text file."""
    if not os.path.exists(cfg.data):
        raise UsageError(f"--data {cfg.data}: no such file or directory; make FineWeb shards with "
                         f"`python fineweb.py`, or pass a text file")
    if os.path.isdir(cfg.data):
        names, val_paths = plumbing.shard_paths(cfg.data)
        train_shards, val_shards = [plumbing.open_shard(p) for p in names], [plumbing.open_shard(p) for p in val_paths]
    elif cfg.data.endswith((".npy", ".bin")):
        raise UsageError(f"--data {cfg.data} is a single shard; pass the directory that holds the train and val shards")
    else:
        text_train, text_val = read_text(cfg.data)
        train_shards, names, val_shards = [text_train], [cfg.data], [text_val]
    train_tokens = sum(len(s) for s in train_shards)
    if train_tokens < cfg.total_batch_size + 1:
        raise UsageError(f"--data {cfg.data}: {train_tokens} training tokens, fewer than one batch of "
                         f"--total-batch-size {cfg.total_batch_size}; use more text or a smaller batch")
    n_val = (min(cfg.val_tokens, sum(len(s) for s in val_shards) - 1) // cfg.seq_len) * cfg.seq_len
    if n_val <= 0:
        raise UsageError(f"--data {cfg.data}: its validation split, or --val-tokens {cfg.val_tokens}, holds less than "
                         f"one sequence of --seq-len {cfg.seq_len} (plus a target); raise --val-tokens, shorten "
                         f"--seq-len, or add data")
    val, need = [], n_val + 1
    for shard in val_shards:
        val.append(shard[:need])
        need -= len(val[-1])
    val = np.concatenate(val)
    check_token_ids(val, cfg.vocab_size, f"the validation data of {cfg.data}")
    return TokenStream(train_shards, names, cfg.seed), val


# -----------------------------------------------------------------------------
# Optimization: AdamW with decay on the weight matrices only, warmup then cosine decay; the modern recipe's Muon and
# Adam, with a constant learning rate then a linear cool-down.


def gpt2_optimizers(model, cfg, fused):
    """AdamW (0.9, 0.95), as GPT-3 used it: weight decay on the matmuls and embeddings, none on biases and gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},  # matmuls and embeddings
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},  # biases and LayerNorm gains
    ]
    for group in groups:
        group["max_lr"] = cfg.max_lr
    return [torch.optim.AdamW(groups, lr=cfg.max_lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)]


class ShardedMuon(getattr(torch.optim, "Muon", torch.optim.Optimizer)):  # torch.optim.Muon is new in torch 2.9
    """torch's Muon for matrices that FSDP shards over the ranks, row blocks of each to each rank. Orthogonalizing an
    update needs the whole matrix: every rank gathers each matrix's update in bf16 (the precision the orthogonalization
    runs in, so it is the same as Muon's unsharded), orthogonalizes it (all ranks the same work), and applies its own
    rows. The momentum stays sharded: it is elementwise. The arithmetic is on each rank's plain local rows: DTensor's
    operations each cost a dispatch in Python, and a step makes several for every matrix of the model."""

    @torch.no_grad()
    def step(self, closure=None):
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


def modern_optimizers(model, cfg, fused):
    """Muon for the blocks' matrices: their momentum orthogonalized, so that every direction of a matrix learns at
    the same rate (Jordan et al. 2024). Adam for the embedding and the output layer, which are lookups and a
    classifier rather than maps between hidden spaces, each at a rate of its own."""
    matrices = list(model.transformer.h.parameters())  # all of the blocks' parameters: modern blocks have no biases
    muon_class = ShardedMuon if cfg.fsdp else torch.optim.Muon
    muon = muon_class([{"params": matrices, "max_lr": cfg.muon_lr}], lr=cfg.muon_lr, momentum=0.95, weight_decay=0.0)
    adam = torch.optim.Adam([{"params": [model.transformer.wte.weight], "max_lr": cfg.embed_lr},
                             {"params": [model.lm_head.weight], "max_lr": cfg.head_lr}],
                            lr=cfg.head_lr, betas=(0.8, 0.95), eps=1e-10, fused=fused)
    return [muon, adam]


def make_optimizers(model, cfg, device_type):
    """The recipe's optimizers, a list: a recipe may give each kind of parameter an optimizer of its own. Each
    parameter group keeps its peak learning rate as max_lr, which the schedule scales."""
    fused = cfg.fused_adamw and device_type == "cuda"  # one kernel for all parameters, not one per tensor
    return (modern_optimizers if cfg.recipe == "modern" else gpt2_optimizers)(model, cfg, fused)


def get_lr(step, max_lr, cfg):
    """Linear warmup to max_lr, then down to min_lr_ratio * max_lr, reached at the last step: along a cosine for
    GPT-2; for the modern recipe, held at max_lr, then straight down over the last --cooldown-frac of the run."""
    min_lr = max_lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return max_lr * (step + 1) / cfg.warmup_steps
    if cfg.recipe == "modern":
        left = (cfg.max_steps - 1 - step) / max(1, cfg.cooldown_frac * (cfg.max_steps - 1))  # 1 where it starts
        return min_lr + min(1.0, max(0.0, left)) * (max_lr - min_lr)
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - 1 - cfg.warmup_steps))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


def set_lr(optimizers, step, cfg):
    """Every parameter group's learning rate at step, from its own peak."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = get_lr(step, group["max_lr"], cfg)


# -----------------------------------------------------------------------------
# Processes, devices and precision: one process per GPU under torchrun, TF32, bf16 autocast, torch.compile.


class Env(NamedTuple):
    """Where this process runs, from torchrun's environment variables (or one process)."""
    rank: int
    local_rank: int
    world_size: int
    device: str
    device_type: str


def set_up_distributed(device="auto", fsdp=False):
    """One process per GPU under torchrun (RANK, LOCAL_RANK, WORLD_SIZE), or a single process; in a process group
    if there are several, or for FSDP, which shards over one even in a single process."""
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda, but PyTorch sees no CUDA GPU; install a CUDA build of torch or use "
                             "--device cpu")
        if local_rank >= torch.cuda.device_count():
            raise UsageError(f"process LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPU(s) are visible "
                             f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); lower "
                             f"torchrun's --nproc_per_node")
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    elif device == "mps" and not torch.backends.mps.is_available():
        raise UsageError("--device mps, but this machine has no Apple GPU available to PyTorch; use --device cpu")
    device_type = device.split(":")[0]
    if world_size > 1 or fsdp:
        if device_type == "mps":
            raise UsageError("several processes need CUDA or the CPU; run one process on mps" if world_size > 1 else
                             "--fsdp needs CUDA or the CPU (its collectives have no mps backend); drop --fsdp")
        # an hour, not 10 minutes: rank 0 alone may download GPT-2 XL or write a large checkpoint while the others wait
        backend, device_id = ("nccl", torch.device(device)) if device_type == "cuda" else ("gloo", None)
        alone = {} if world_size > 1 else dict(store=dist.HashStore(), rank=0, world_size=1)  # no torchrun needed
        dist.init_process_group(backend=backend, device_id=device_id, timeout=datetime.timedelta(hours=1), **alone)
    return Env(rank, local_rank, world_size, device, device_type)


def any_rank(flag, device):
    """True on every rank if flag is True on any of them."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    votes = torch.tensor(float(flag), device=device)
    dist.all_reduce(votes)
    return votes.item() > 0


def tear_down_distributed():
    if dist.is_available() and dist.is_initialized():
        # the last references to the group go first: FSDP's state and the model refer to each other, and such cycles
        # are freed only by the garbage collector; one freed after the group, at exit, can abort the process
        gc.collect()
        dist.destroy_process_group()


def set_tf32(enabled):
    """TF32 matmuls on Ampere and newer: float32's range with a 10-bit mantissa, several times faster."""
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled


def set_up_device(cfg, env):
    """The process-wide settings a run's speed depends on: TF32 matmuls, and on a CPU, how freed memory is kept."""
    set_tf32(cfg.dtype != "fp32")
    if env.device_type == "cpu":
        plumbing.keep_freed_memory()  # the README's Speed section has what it buys


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(dtype, device_type):
    if dtype == "auto":
        if device_type != "cuda":
            return "fp32"
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"  # V100 and T4 lack bf16
    if dtype == "bf16" and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UsageError("--dtype bf16: this GPU has no bf16; use --dtype fp16")
    return dtype


def autocast_context(device_type, dtype):
    """Matmuls in bf16/fp16 with float32 master weights; a no-op for fp32 and tf32."""
    if dtype in DTYPES:
        return torch.autocast(device_type=device_type, dtype=DTYPES[dtype])
    return contextlib.nullcontext()


def compile_model(model, cfg):
    """torch.compile fuses kernels; static shapes give evaluation's batch shapes their own graphs instead of one
    dynamic graph for all."""
    return torch.compile(model, dynamic=False, mode=cfg.compile_mode) if cfg.compile else model


def shard_model(model, dtype):
    """FSDP2, in place: each block, then the rest (embedding, final norm, head), becomes a group whose tensors are
    split over the ranks, each rank holding 1/world of every one. A group's weights are gathered whole just before
    its forward and backward and freed after them, and its gradients are reduce-scattered: each rank receives the
    sum of its own slice. The optimizers then step on slices, so their state is sharded too."""
    block_policy = MixedPrecisionPolicy()
    if dtype == "bf16":  # the blocks' weights gathered in bf16 (half the bytes), their gradients summed in float32;
        # inputs not cast, and the embedding and head gathered in float32: the residual stream stays float32, and
        # autocast computes what it does under DDP (but for LayerNorm's gains and biases, rounded to bf16)
        block_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                            cast_forward_inputs=False)
    for block in model.transformer.h:
        fully_shard(block, mp_policy=block_policy)
    fully_shard(model, reshard_after_forward=False)  # the head's backward comes first: no gather of it again
    return model


def gradient_sync(model, on):
    """A context in which backward reduces the gradients over the ranks (on), or only adds them up on each rank:
    DDP and FSDP reduce once per optimizer step, after the last micro-batch."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP (also through torch.compile's wrapper)
        model.set_requires_gradient_sync(on)
    elif not on and isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def compile_and_wrap(model, cfg, env):
    """What training and evaluation run: the model compiled and, under torchrun, in DDP, which all-reduces the
    gradients (its constructor gives every rank rank 0's weights). An FSDP model (shard_model) is only compiled."""
    compiled = compile_model(model, cfg)
    if env.world_size == 1 or cfg.fsdp:
        return compiled
    return nn.parallel.DistributedDataParallel(
        compiled, device_ids=[env.local_rank] if env.device_type == "cuda" else None,
        broadcast_buffers=False)  # the only buffer, the vocab mask, never changes: no broadcast every forward


PEAK_FLOPS = {  # dense bf16/fp16 tensor-core peak, by a part of the GPU's name, for MFU
    "H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12, "A10G": 70e12, "L40S": 362e12,
    "L40": 181e12, "L4": 121e12, "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12, "T4": 65e12,
}


@functools.cache
def peak_flops(device_type):
    if device_type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((flops for part, flops in PEAK_FLOPS.items() if part in name), None)


# -----------------------------------------------------------------------------
# The settings resolved: the defaults that depend on the data and the device, then the checks.


def fit_warmup(cfg, given, master):
    """A run no longer than its warmup never reaches its peak learning rate, nor decays: a preset's warmup (715 steps
    for FineWeb) is cut to a tenth of a shorter run, and a --warmup-steps given that long is warned about."""
    if cfg.eval_only or cfg.max_steps == 0 or cfg.warmup_steps < cfg.max_steps:
        return
    if "warmup_steps" in given:
        if master:
            print(f"warning: --warmup-steps {cfg.warmup_steps} is not shorter than --max-steps {cfg.max_steps}: the "
                  f"learning rate rises for the whole run and never decays")
        return
    warmup = cfg.max_steps // 10
    if master:
        print(f"--max-steps {cfg.max_steps} is shorter than the {cfg.warmup_steps} warmup steps: warming up for "
              f"{warmup} step{'' if warmup == 1 else 's'} instead, a tenth of the run (--warmup-steps sets it)")
    cfg.warmup_steps = warmup


def require(cfg, names, ok, what):
    for name in names:
        if not ok(getattr(cfg, name)):  # written so that NaN fails too
            raise UsageError(f"--{name.replace('_', '-')} must be {what}, not {getattr(cfg, name)}")


def check_config(cfg, world_size):
    require(cfg, ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "batch_size", "seq_len",
                  "total_batch_size", "val_tokens", "keep_checkpoints", "max_bad_steps", "max_lr", "grad_clip",
                  "muon_lr", "embed_lr", "head_lr", "logit_softcap"),
            lambda v: v > 0, "positive")
    require(cfg, ("max_steps", "warmup_steps", "eval_every", "hellaswag_every", "checkpoint_every", "num_samples",
                  "max_new_tokens", "weight_decay"), lambda v: v >= 0, "zero or more")
    require(cfg, ("min_lr_ratio",), lambda v: 0 <= v <= 1, "between 0 and 1")
    require(cfg, ("cooldown_frac",), lambda v: 0 < v <= 1, "above 0 and at most 1")
    require(cfg, ("seed",), lambda v: 0 <= v < 2**32, "from 0 to 2**32 - 1")
    if cfg.n_embd % cfg.n_head:
        raise UsageError(f"--n-embd {cfg.n_embd} must be a multiple of --n-head {cfg.n_head}")
    if cfg.wandb_run_name and not cfg.wandb_project:
        raise UsageError(f"--wandb-run-name {cfg.wandb_run_name} names a W&B run, but W&B is off; pass "
                         f"--wandb-project too")
    if cfg.wandb_project:
        plumbing.import_wandb(cfg.wandb_project)  # now rather than after the set-up: a missing package costs no time
    if cfg.hellaswag_every > 0 and cfg.vocab_size < GPT2_VOCAB:
        raise UsageError(f"--hellaswag-every {cfg.hellaswag_every} needs GPT-2's whole vocabulary, but --vocab-size "
                         f"is {cfg.vocab_size}; pass --hellaswag-every 0")
    if cfg.loss == "chunked" and cfg.dtype == "fp16":  # its gradients exist before the loss is scaled
        raise UsageError("--loss chunked cannot run with --dtype fp16: it computes its gradients in fp16 before the "
                         "gradient scaler sees them, where they can underflow or overflow; use --dtype bf16 or fp32, "
                         "or --loss full")
    if cfg.fsdp:
        check_fsdp(cfg)
    if cfg.seq_len > cfg.block_size:
        raise UsageError(f"--seq-len {cfg.seq_len} is longer than the model's --block-size {cfg.block_size}; "
                         f"shorten it")
    tokens_per_pass = cfg.batch_size * cfg.seq_len * world_size
    if cfg.total_batch_size % tokens_per_pass:
        raise UsageError(f"--total-batch-size {cfg.total_batch_size} is not a multiple of --batch-size x --seq-len x "
                         f"processes = {cfg.batch_size} x {cfg.seq_len} x {world_size} = {tokens_per_pass}; change "
                         f"one of them")


def check_fsdp(cfg):
    if not dist.is_available():
        raise UsageError(f"--fsdp needs torch.distributed, and this build of PyTorch ({torch.__version__}) has none; "
                         f"install one that has (pytorch.org), or drop --fsdp")
    if cfg.dtype == "fp16":
        raise UsageError("--fsdp cannot run with --dtype fp16: the gradient scaler that fp16 needs does not take "
                         "FSDP's sharded gradients; use --dtype bf16 or fp32, or drop --fsdp")
    if cfg.compile_mode == "reduce-overhead":
        raise UsageError("--compile-mode reduce-overhead cannot run with --fsdp: its CUDA graphs cannot hold FSDP's "
                         "gathers and reductions; pick another --compile-mode, or drop --fsdp")


def check_recipe(cfg, given):
    if cfg.recipe == "modern" and not hasattr(torch.optim, "Muon"):
        raise UsageError(f"--recipe modern needs torch.optim.Muon, new in PyTorch 2.9; this is {torch.__version__}: "
                         f"upgrade torch, or drop --recipe modern")
    if cfg.recipe == "modern" and cfg.fsdp and orthogonalize is None:
        raise UsageError(f"--fsdp --recipe modern shards Muon with the steps of torch.optim.Muon's own update, which "
                         f"this torch ({torch.__version__}) does not have where it looked (torch.optim._muon); use the "
                         f"torch that requirements.txt names, or drop --fsdp")
    if cfg.recipe == "modern" and cfg.init_from != "scratch":
        raise UsageError(f"--init-from {cfg.init_from} loads OpenAI's GPT-2, which --recipe modern's model cannot "
                         f"hold (no position table, untied head, no biases); drop one of the two")
    other_recipe = "gpt2" if cfg.recipe == "modern" else "modern"
    other = [f"--{name.replace('_', '-')}" for name in RECIPE_SETTINGS[other_recipe] if name in given]
    if other:
        what = f"{other[0]} is a setting" if len(other) == 1 else f"{', '.join(other)} are settings"
        raise UsageError(f"{what} of --recipe {other_recipe} only, and this run is --recipe {cfg.recipe}; drop "
                         f"{'it' if len(other) == 1 else 'them'}, or pass --recipe {other_recipe}")


def resolve_config(cfg, given, env):
    """Fills in the defaults that depend on the data, the model preset and the device, then checks everything."""
    if "data" not in given and not os.path.exists(cfg.data):
        if env.rank == 0:
            doing = ("evaluating" if cfg.eval_only else "training a small model" if cfg.init_from == "scratch"
                     else f"fine-tuning OpenAI's {cfg.init_from}")
            print(f"no FineWeb shards in {cfg.data}/ (make them with `python fineweb.py`): {doing} on tiny "
                  f"Shakespeare instead")
        preset = SHAKESPEARE if cfg.init_from == "scratch" else {**SHAKESPEARE, **SHAKESPEARE_FINETUNE}
        if cfg.recipe == "modern":
            preset = {**SHAKESPEARE, **SHAKESPEARE_MODERN}
        keep = set(given) | (set(MODEL_SIZES[cfg.model]) if "model" in given else set())  # --model gpt2-medium means it
        cfg.__dict__.update({k: v for k, v in preset.items() if k not in keep})
        if "batch_size" not in given and cfg.seq_len > 0:  # one micro-batch a step, split over the processes
            cfg.batch_size = max(1, cfg.total_batch_size // (cfg.seq_len * env.world_size))
    elif cfg.recipe == "modern":
        cfg.__dict__.update({k: v for k, v in MODERN.items() if k not in given})
    check_recipe(cfg, given)
    if cfg.init_from != "scratch":  # OpenAI's shapes, whatever a preset said
        pretrained = dict(MODEL_SIZES[cfg.init_from], block_size=1024, vocab_size=PADDED_VOCAB)
        clash = [f"--{k.replace('_', '-')}" for k, v in pretrained.items() if k in given and getattr(cfg, k) != v]
        if clash:
            raise UsageError(f"--init-from {cfg.init_from} fixes {', '.join(clash)}; drop those flags")
        cfg.__dict__.update(pretrained, model=cfg.init_from)
    for key, value in MODEL_SIZES[cfg.model].items():
        if getattr(cfg, key) == 0:
            setattr(cfg, key, value)
    if cfg.compile is None:
        cfg.compile = env.device_type == "cuda"
    if cfg.compile_mode != "default" and not cfg.compile:
        raise UsageError(f"--compile-mode {cfg.compile_mode} needs --compile (off by default without CUDA); pass "
                         f"--compile or drop it")
    if "hellaswag_every" not in given and (env.device_type != "cuda" or cfg.vocab_size < GPT2_VOCAB):
        cfg.hellaswag_every = 0  # too slow on a CPU; and HellaSwag's text needs every GPT-2 token
    cfg.dtype = resolve_dtype(cfg.dtype, env.device_type)
    check_config(cfg, env.world_size)
    fit_warmup(cfg, given, env.rank == 0)
    return cfg


# -----------------------------------------------------------------------------
# The training step: gradient accumulation over micro-batches, one all-reduce, clipping, then the optimizers.


class StepResult(NamedTuple):
    loss: float  # the mean over the whole batch of every rank
    grad_norm: float  # before clipping
    finite: bool  # False for a non-finite loss or gradient norm: the optimizers did not step


def train_step(model, optimizers, scaler, batches, autocast_ctx, grad_clip):
    """One optimizer step over this rank's micro-batches (x, y), skipped if the loss or gradient norm is not finite."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    device = next(model.parameters()).device  # of FSDP's slices, too
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=device)
    for micro, (x, y) in enumerate(batches):
        if device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()  # lets the copy overlap with the GPU's work
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with gradient_sync(model, on=micro == len(batches) - 1):
            with autocast_ctx:
                loss = model(x, y)
            loss = loss / len(batches)  # the gradients add up to those of the mean over the whole batch
            loss_sum += loss.detach()
            scaler.scale(loss).backward()
    if world_size > 1:
        dist.all_reduce(loss_sum)
    for optimizer in optimizers:
        scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)  # under FSDP, over every rank's slices
    if hasattr(norm, "full_tensor"):  # FSDP: the norm is a DTensor, and every rank needs its value
        norm = norm.full_tensor()
    loss_value, norm_value = loss_sum.item() / world_size, norm.item()
    finite = math.isfinite(loss_value) and (math.isfinite(norm_value) or scaler.is_enabled())
    # with fp16, gradients that overflowed are normal: the scaler lowers its scale, and the step is skipped for every
    # optimizer, not only for the one whose gradients overflowed (clipping zeroed the others', and momentum would move)
    if math.isfinite(loss_value) and math.isfinite(norm_value):
        for optimizer in optimizers:
            scaler.step(optimizer)
    scaler.update()
    return StepResult(loss_value, norm_value, finite)


# -----------------------------------------------------------------------------
# Evaluation: the validation loss, and samples.


@torch.no_grad()
def evaluate_val(model, val, B, T, device, autocast_ctx, rank, world_size):
    """Mean loss per token over the fixed validation set; rank r takes every world_size-th batch of B sequences.
    Every rank runs as many batches, the last ones empty where the set runs out: under FSDP each forward pass gathers
    weights from all ranks, so each needs all of them."""
    n_seq = (len(val) - 1) // T
    totals = torch.zeros(2, device=device)  # loss sum, token count
    for first in range(rank * B, math.ceil(n_seq / (world_size * B)) * world_size * B, world_size * B):
        rows = max(0, min(B, n_seq - first))
        buf = torch.from_numpy(val[first * T: (first + rows) * T + 1].astype(np.int64))
        x = torch.zeros(B, T, dtype=torch.long)  # a short last batch is padded, so shapes never change
        y = torch.full((B, T), -1, dtype=torch.long)
        x[:rows], y[:rows] = buf[:-1].view(rows, T), buf[1:].view(rows, T)
        with autocast_ctx:
            loss = model(x.to(device), y.to(device))
        if rows:  # an empty batch's loss is 0 / 0
            totals += torch.stack([loss.float() * rows * T, torch.tensor(float(rows * T), device=device)])
    if world_size > 1:
        dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


# Control characters a model samples (escape, carriage return, bell, backspace) would garble the terminal: each is
# shown as its Unicode symbol (␛, ␍, ␇, ␈) instead. Line breaks and tabs stay as they are.
CONTROL_SYMBOLS = {c: 0x2400 + c for c in range(32) if chr(c) not in "\n\t"} | {0x7F: 0x2421}


def print_samples(model, cfg, enc, device, autocast_ctx, seed, step, show=True):
    """Prints --num-samples continuations of --prompt as text, line breaks and all, each under a header line (if
    show: an FSDP rank that only lends its slices of the weights samples without printing)."""
    prompt = enc.encode_ordinary(cfg.prompt) or [EOT]
    lines = []
    if max(prompt) >= model.n_tokens:  # a --vocab-size below GPT-2's cannot embed the prompt's tokens
        lines.append(f"no samples: the prompt needs token ids up to {max(prompt)}, beyond this model's "
                     f"{model.n_tokens}")
    else:
        if len(prompt) > model.config.block_size:
            lines.append(f"the prompt's {len(prompt)} tokens outgrow the block of {model.config.block_size}: each "
                         f"token is sampled from the last {model.config.block_size} before it")
        generator = torch.Generator(device=device).manual_seed(seed)
        with autocast_ctx:
            samples = generate(model, prompt, cfg.num_samples, cfg.max_new_tokens, generator)
        for i, tokens in enumerate(samples):
            lines += [f"--- sample {i + 1}/{len(samples)} (step {step}) ---",
                      enc.decode(tokens).translate(CONTROL_SYMBOLS)]
        lines.append("--- end of samples ---")
    if show:
        print("\n".join(lines), flush=True)


# -----------------------------------------------------------------------------
# A run: what it is made of, and how it logs.


@dataclass
class Run:
    """What a training run is made of: built by set_up, moved on by the training loop, saved in its checkpoints."""
    cfg: TrainConfig
    env: Env
    stream: TokenStream  # the training tokens
    val: np.ndarray  # the fixed validation tokens
    hellaswag_data: Optional[dict]  # tokenized once; None when HellaSwag is off
    model: GPT  # its weights are what checkpoints save and samples come from
    optimizers: list
    scaler: torch.amp.GradScaler
    autocast_ctx: object
    log: plumbing.RunLog
    compiled: Optional[nn.Module] = None  # the model compiled, and in DDP under torchrun: what trains and evaluates
    step: int = 0  # optimizer steps taken
    evaluated: bool = False  # the evaluations due at step are done
    val_loss: Optional[float] = None  # the latest
    val_step: Optional[int] = None  # the step val_loss was measured at
    nonfinite_since: Optional[int] = None  # the first of the latest steps in a row with a non-finite loss
    resumed_from: Optional[str] = None  # the checkpoint's path

    @property
    def master(self):
        return self.env.rank == 0  # only rank 0 prints and writes files


def set_up(cfg, env, pretrained):
    """The data, the model (random, or OpenAI's weights if pretrained) on its device, and the optimizers."""
    set_up_device(cfg, env)
    stream, val = load_data(cfg)
    hellaswag_data = None
    if cfg.hellaswag_every > 0:
        examples = hellaswag.load_examples(cfg.hellaswag_file or None, cfg.cache_dir or None)
        hellaswag_data = hellaswag.prepare(examples, plumbing.gpt2_tokenizer(), cfg.block_size)
    model = make_model(cfg, env.device, pretrained)
    if cfg.fsdp:
        shard_model(model, cfg.dtype)  # before the optimizers are made: sharding replaces the parameters
    return Run(cfg, env, stream, val, hellaswag_data, model,
               optimizers=make_optimizers(model, cfg, env.device_type),
               scaler=torch.amp.GradScaler(env.device_type, enabled=cfg.dtype == "fp16"),  # fp16 gradients underflow
               autocast_ctx=autocast_context(env.device_type, cfg.dtype),
               log=plumbing.RunLog(cfg.log_dir))


def accumulation_steps(cfg, world_size):
    """Micro-batches per optimizer step, in each process."""
    return cfg.total_batch_size // (cfg.batch_size * cfg.seq_len * world_size)


def report(run, record, line=None):
    """Appends record to log.jsonl and the W&B run, and prints line, on rank 0."""
    if run.master:
        run.log.write(record)
        if line:
            print(line, flush=True)


def what_runs(run):
    """What this run does, in words: the first line it prints."""
    cfg = run.cfg
    if cfg.eval_only:
        if run.resumed_from:
            return f"evaluating {run.resumed_from} (step {run.step})"
        if cfg.init_from != "scratch":
            return f"evaluating OpenAI's {cfg.init_from}"
        return "evaluating the initial model: random weights (no checkpoint in --log-dir)"
    if run.resumed_from:
        return f"resuming from the checkpoint of step {run.step} ({run.resumed_from}), training to step {cfg.max_steps}"
    start = "training from scratch" if cfg.init_from == "scratch" else f"fine-tuning OpenAI's {cfg.init_from}"
    return f"{start} for {cfg.max_steps} steps"


def start_log(run):
    """Readies the log directory (a fresh start moves an old run aside) and says what is being run."""
    cfg, env = run.cfg, run.env
    if env.world_size > 1:  # every rank has read its checkpoint before rank 0 moves any file
        dist.barrier()
    with failing_together():
        if run.master and not cfg.eval_only:
            try:
                plumbing.prepare_log_dir(cfg.log_dir, run.step if run.resumed_from else None)
            except OSError as e:
                raise UsageError(f"--log-dir {cfg.log_dir}: cannot use it ({e}); pass a directory this run may "
                                 f"write to")
    if not run.master:
        return
    print(what_runs(run))
    n_params = sum(p.numel() for p in run.model.parameters())
    recipe = ", the modern recipe" if cfg.recipe == "modern" else ""
    compiled = "on" if cfg.compile else "off"
    print(f"model: {cfg.n_layer} layers, {cfg.n_head} heads, width {cfg.n_embd}, {n_params / 1e6:.2f}M parameters"
          f"{recipe} | {env.world_size} process(es) on {env.device_type}, {cfg.dtype}, compile {compiled}")
    train_tokens = sum(len(shard) for shard in run.stream.shards)
    print(f"data: {cfg.data}, {train_tokens:,} training tokens | batch {cfg.total_batch_size:,} tokens = "
          f"{cfg.batch_size} x {cfg.seq_len} x {accumulation_steps(cfg, env.world_size)} accumulation steps x "
          f"{env.world_size} process(es)")
    if run.resumed_from and not cfg.eval_only:  # plot.py drops the points logged after it: they are trained again
        report(run, {"step": run.step, "event": "resume"})


def start_wandb(run):
    """With --wandb-project, rank 0 logs log.jsonl's records to a W&B run as well. A resumed run continues the W&B
    run of its checkpoint; --eval-only gets one of its own (restore leaves it no id), as the training's may still be
    going on."""
    cfg = run.cfg
    if cfg.wandb_project:
        with failing_together():
            if run.master:
                run.log.start_wandb(cfg.wandb_project, cfg.wandb_run_name, asdict(cfg))


# -----------------------------------------------------------------------------
# Evaluations during the run: the validation loss with samples, and HellaSwag.


def evaluations_due(run):
    """Whether the validation loss (with samples) and HellaSwag are due at run.step."""
    cfg, step = run.cfg, run.step
    final = cfg.eval_only or step == cfg.max_steps
    return (final or (cfg.eval_every > 0 and step % cfg.eval_every == 0),
            run.hellaswag_data is not None and (final or step % cfg.hellaswag_every == 0))


def evaluate(run):
    """The evaluations due at run.step, logged: the validation loss with samples, and HellaSwag."""
    cfg, env, step = run.cfg, run.env, run.step
    val_due, hellaswag_due = evaluations_due(run)
    tokens = step * cfg.total_batch_size
    extra = {"eval_only": True, "init_from": run.resumed_from or cfg.init_from} if cfg.eval_only else {}
    if val_due:
        run.val_loss = evaluate_val(run.compiled, run.val, cfg.batch_size, cfg.seq_len, env.device, run.autocast_ctx,
                                    env.rank, env.world_size)
        run.val_step = step
        report(run, {"step": step, "tokens": tokens, "val_loss": run.val_loss, **extra},
               f"step {step:5d} | val loss {run.val_loss:.4f}")
        # eager, so that growing lengths never recompile; under FSDP on every rank, as each holds a slice of the weights
        if (run.master or cfg.fsdp) and cfg.num_samples > 0:
            print_samples(run.model, cfg, plumbing.gpt2_tokenizer(), env.device, run.autocast_ctx, cfg.seed, step,
                          show=run.master)
    if hellaswag_due:
        acc_norm, acc, n = hellaswag.evaluate(run.compiled, run.hellaswag_data, env.device, run.autocast_ctx,
                                              env.rank, env.world_size)
        report(run, {"step": step, "tokens": tokens, "hellaswag_acc_norm": acc_norm, "hellaswag_acc": acc, **extra},
               f"step {step:5d} | hellaswag acc_norm {acc_norm:.4f} acc {acc:.4f} ({n} examples)")


def evaluate_unless_stopped(run, stop_signal):
    """Runs the evaluations due at run.step, unless a stop signal is voted for first: a preempted run saves before a
    long evaluation, as the grace period before SIGKILL is short. Returns whether to stop."""
    if not run.evaluated and any(evaluations_due(run)):
        if any_rank(bool(stop_signal), run.env.device):
            return True
        evaluate(run)
    run.evaluated = True  # also when none was due: nothing is left to evaluate at this step
    return False


# -----------------------------------------------------------------------------
# Checkpoints: what one holds, saving, finding and restoring it.

CHECKPOINT_FORMAT = 2  # raised whenever what a checkpoint holds changes: a checkpoint of another format is refused


def checkpoint_contents(run, rng_per_rank):
    """All a checkpoint holds, but for FSDP's weights and optimizer state (sharded_contents), kept apart."""
    whole = {} if run.cfg.fsdp else {
        "model": run.model.state_dict(), "optimizers": [optimizer.state_dict() for optimizer in run.optimizers]}
    return {
        "format": CHECKPOINT_FORMAT, "sharded": run.cfg.fsdp, **whole, "model_config": asdict(run.model.config),
        "scaler": run.scaler.state_dict(),
        "step": run.step, "evaluated": run.evaluated, "val_loss": run.val_loss, "val_step": run.val_step,
        "stream": run.stream.state_dict(), "rng": rng_per_rank,
        "train_config": asdict(run.cfg), "wandb_id": run.log.wandb_id,
    }


def sharded_contents(model, optimizers=None):
    """FSDP's weights and optimizer state: each rank's own slices, as DTensors named by parameter (not by position),
    which torch.distributed.checkpoint writes and reads on any number of ranks, splitting them anew for that number.
    A model that is not sharded gets its whole tensors, which it loads such a checkpoint into."""
    contents = {"model": dcp_state.get_model_state_dict(model)}
    if optimizers is not None:
        contents["optimizers"] = dcp_state.get_optimizer_state_dict(model, optimizers)
    return contents


def save_checkpoint(run):
    """Rank 0 writes the checkpoint of run.step, with every rank's RNG states; under FSDP, every rank writes its
    slices of the weights and optimizer state beside it, in a directory."""
    cfg, env = run.cfg, run.env
    rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if env.device_type == "cuda" else None}
    rng_per_rank = [rng]
    if env.world_size > 1:  # every rank reaches here before rank 0 writes
        rng_per_rank = [None] * env.world_size
        dist.all_gather_object(rng_per_rank, rng)
    with failing_together():  # a full disk stops every rank; and none goes on before the checkpoint is written
        ckpt = checkpoint_contents(run, rng_per_rank) if run.master else None  # rank 0 alone writes it
        if cfg.fsdp:
            sharded = sharded_contents(run.model, run.optimizers)

            def save(directory):  # every rank writes its slices there, and rank 0 all the rest beside them
                dcp.save(sharded, checkpoint_id=directory)
                if run.master:
                    torch.save(ckpt, os.path.join(directory, "run.pt"))

            plumbing.write_sharded_checkpoint(cfg.log_dir, run.step, save, plumbing.tensor_bytes(sharded) *
                                              env.world_size, cfg.keep_checkpoints, run.master)
        elif run.master:
            plumbing.write_checkpoint(cfg.log_dir, run.step, lambda f: torch.save(ckpt, f),
                                      plumbing.tensor_bytes(ckpt), cfg.keep_checkpoints)


def load_checkpoint(path):
    """A checkpoint of this train_gpt2.py. Raises ValueError if it cannot be read, UsageError if it is of another
    format."""
    # weights_only: a checkpoint is data, and loading one can never run code
    try:  # --fsdp's is a directory: all but the sharded tensors are in its run.pt (save_checkpoint)
        ckpt = torch.load(os.path.join(path, "run.pt") if os.path.isdir(path) else path, map_location="cpu",
                          weights_only=True, mmap=True)  # mmap: no private copy per rank
    except Exception as e:  # torch's messages can run over many lines: keep the first, for one-line errors
        raise ValueError(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}") from None
    if not isinstance(ckpt, dict) or not ("model" in ckpt or ckpt.get("sharded")) or "model_config" not in ckpt:
        raise ValueError("not a train_gpt2.py checkpoint")
    ckpt.setdefault("sharded", False)  # written before --fsdp was
    if ckpt.get("format") != CHECKPOINT_FORMAT:
        raise UsageError(f"{path} is a checkpoint of format {ckpt.get('format', 1)}, and this train_gpt2.py reads "
                         f"format {CHECKPOINT_FORMAT} only; use the train_gpt2.py that wrote it")
    try:  # a checkpoint from before the modern recipe lacks its settings: it is a GPT-2 model
        ckpt["model_config"] = asdict(GPTConfig(**ckpt["model_config"]))
    except TypeError as e:
        raise UsageError(f"{path} has model settings this train_gpt2.py does not know ({e}); use the train_gpt2.py "
                         f"that wrote it") from None
    return ckpt


def load_weights(model, ckpt, path):
    """The checkpoint's weights into the model, sharded by FSDP or not, whichever way the checkpoint was written."""
    if ckpt["sharded"]:
        contents = sharded_contents(model)
        with warnings.catch_warnings():  # in one process it warns that it assumes one process, as it should
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(contents, checkpoint_id=path)  # each rank reads its slices of every tensor, or the whole ones
        dcp_state.set_model_state_dict(model, contents["model"])
    elif dist.is_available() and isinstance(model, FSDPModule):  # a DDP run's whole tensors, into FSDP's slices
        dcp_state.set_model_state_dict(model, ckpt["model"], options=dcp_state.StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(ckpt["model"])


def model_from_checkpoint(ckpt, path):
    model = GPT(GPTConfig(**ckpt["model_config"]))
    load_weights(model, ckpt, path)
    return model


def find_resume_checkpoint(cfg, env):
    """The checkpoint to resume from and its path ((None, None): start fresh). Rank 0 picks it, falling back past
    unreadable ones, and every rank loads that same one."""
    if cfg.resume == "none" or (cfg.eval_only and cfg.resume == "auto" and cfg.init_from != "scratch"):
        return None, None  # --eval-only --init-from gpt2 evaluates OpenAI's weights, not the run's
    ckpt, chosen = None, [None]
    with failing_together():
        if env.rank == 0:
            for path in [cfg.resume] if cfg.resume != "auto" else reversed(plumbing.checkpoint_paths(cfg.log_dir)):
                try:
                    ckpt, chosen = load_checkpoint(path), [path]
                    break
                except ValueError as e:
                    if cfg.resume != "auto":
                        raise UsageError(f"--resume {cfg.resume}: cannot load it ({e})")
                    print(f"warning: skipping unreadable checkpoint {path} ({e})")
    if env.world_size > 1:
        dist.broadcast_object_list(chosen, src=0)
    with failing_together():
        if env.rank != 0 and chosen[0] is not None:
            try:
                ckpt = load_checkpoint(chosen[0])
            except ValueError as e:
                raise UsageError(f"rank {env.rank} cannot read {chosen[0]}, which rank 0 resumes from ({e}); "
                                 f"--log-dir must be on a file system every node shares")
    return ckpt, chosen[0]


def check_same_model(ckpt, model, path):
    """Refuses a checkpoint of another model than the flags describe, naming the settings that differ. Only how the
    model computes (attention kernel, loss) may change."""
    saved, flags = ckpt["model_config"], asdict(model.config)
    differ = [f"{k}: checkpoint {saved.get(k)}, flags {flags.get(k)}" for k in dict.fromkeys([*flags, *saved])
              if k not in ("attn", "loss") and saved.get(k) != flags.get(k)]
    if differ:
        raise UsageError(f"{path} (step {ckpt['step']}) does not fit the model the flags describe "
                         f"({'; '.join(differ)}); pass matching flags, or --no-resume to start fresh")


def check_same_batch(ckpt, total_batch_size, path):
    saved = ckpt["train_config"]["total_batch_size"]
    if saved != total_batch_size:
        raise UsageError(f"{path} was trained with --total-batch-size {saved}, not {total_batch_size}: its "
                         f"{ckpt['step']} steps stand for {ckpt['step'] * saved:,} tokens, and the schedule and the "
                         f"log count steps; pass --total-batch-size {saved}, or --no-resume to start over")


def load_optimizers(optimizers, model, ckpt, path, fsdp):
    """The optimizers' state from the checkpoint, under the settings of this run's flags (--weight-decay, ...)."""
    if ckpt["sharded"] != fsdp:  # the state of whole tensors, by position, or FSDP's slices, by name
        written = "with" if ckpt["sharded"] else "without"
        raise UsageError(f"{path} was written {written} --fsdp, and only a run {written} it can train on from it; "
                         f"pass {'--fsdp' if ckpt['sharded'] else '--no-fsdp'}, or --no-resume to start over "
                         f"(--eval-only, --sample and --export-hf read either)")
    settings = [[{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
                for optimizer in optimizers]
    if fsdp:  # the optimizers' entries alone: load_weights has read the weights already
        contents = {"optimizers": sharded_contents(model, optimizers)["optimizers"]}
        dcp.load(contents, checkpoint_id=path)
        dcp_state.set_optimizer_state_dict(model, optimizers, contents["optimizers"])
    else:
        if len(ckpt["optimizers"]) != len(optimizers):
            raise UsageError(f"{path} holds the state of {len(ckpt['optimizers'])} optimizer(s), and this run has "
                             f"{len(optimizers)}; pass the settings it was trained with, or --no-resume to start over")
        for optimizer, state in zip(optimizers, ckpt["optimizers"]):
            optimizer.load_state_dict(state)
    for optimizer, flags_of_groups in zip(optimizers, settings):  # the flags win
        for group, flags in zip(optimizer.param_groups, flags_of_groups):
            group.update(flags)


def restore(run, ckpt, path):
    """Puts the run back where the checkpoint at path left it: weights and step, and to train on, the optimizers,
    the data position and the RNGs. Evaluating needs the weights alone, on any --data."""
    cfg = run.cfg
    check_same_model(ckpt, run.model, path)
    load_weights(run.model, ckpt, path)
    run.step, run.resumed_from = ckpt["step"], path
    run.val_loss, run.val_step = ckpt["val_loss"], ckpt["val_step"]
    # evaluated at its step as its own run was due; as the end of this one (a smaller --max-steps), only if validated
    run.evaluated = ckpt["evaluated"] and (run.step < cfg.max_steps or run.val_step == run.step)
    if cfg.eval_only:  # its steps stand for the tokens of the batch it was trained with, whatever the flags say
        cfg.total_batch_size = ckpt["train_config"]["total_batch_size"]
        return
    if run.step > cfg.max_steps:
        raise UsageError(f"{path} is at step {run.step}, past --max-steps {cfg.max_steps}; pass a larger --max-steps "
                         f"to train on, --resume an earlier checkpoint, or --no-resume to start over")
    check_same_batch(ckpt, cfg.total_batch_size, path)
    run.stream.load_state_dict(ckpt["stream"])
    load_optimizers(run.optimizers, run.model, ckpt, path, cfg.fsdp)
    if ckpt["scaler"]:  # empty unless the run used fp16
        run.scaler.load_state_dict(ckpt["scaler"])
    rank = run.env.rank
    if rank < len(ckpt["rng"]):
        torch.set_rng_state(ckpt["rng"][rank]["cpu"])
        if run.env.device_type == "cuda" and ckpt["rng"][rank]["cuda"] is not None:
            torch.cuda.set_rng_state(ckpt["rng"][rank]["cuda"])
    run.log.wandb_id = ckpt["wandb_id"]


def finished(run):
    """Whether the resumed checkpoint is the end of this run, evaluated: then there is nothing left to do."""
    done = run.step == run.cfg.max_steps and run.evaluated and not run.cfg.eval_only
    if done and run.master:
        print(f"{run.resumed_from} is the end of this run (step {run.step}, val loss {run.val_loss:.4f}): nothing left "
              f"to do; pass a larger --max-steps to train on, or --no-resume to start over")
    return done


# -----------------------------------------------------------------------------
# The training loop, and the end of the run.


def catch_stop_signals():
    """SIGTERM and SIGINT (preemption, Ctrl-C) end the run after the step in progress, with a checkpoint; a second one
    kills it. Returns the list the signals are recorded in."""
    caught = []

    def on_signal(signum, frame):
        caught.append(signum)
        signal.signal(signum, signal.SIG_DFL)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return caught


def log_step(run, result, lr, dt):
    """One line and one log.jsonl record for the step just taken."""
    cfg, env, step = run.cfg, run.env, run.step
    tok_per_sec = cfg.total_batch_size / dt
    record = {"step": step, "tokens": (step + 1) * cfg.total_batch_size,
              "train_loss": result.loss if result.finite else None, "lr": lr, "grad_norm": result.grad_norm,
              "dt_ms": dt * 1000, "tok_per_sec": tok_per_sec}
    line = (f"step {step:5d} | loss {result.loss:.6f} | lr {lr:.4e} | norm {result.grad_norm:.4f} | "
            f"{dt * 1000:.1f} ms | {tok_per_sec:,.0f} tok/s")
    if peak_flops(env.device_type):
        record["mfu"] = flops_per_token(run.model.config, cfg.seq_len) * tok_per_sec / (
            peak_flops(env.device_type) * env.world_size)
        line += f" | mfu {100 * record['mfu']:.1f}%"
    if env.device_type == "cuda":
        record["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    if not result.finite:
        record["skipped"] = True
        line += f" | non-finite: update skipped ({step - run.nonfinite_since + 1} in a row)"
    elif not math.isfinite(result.grad_norm):  # fp16 gradients overflowed: the scaler skipped the update
        record["skipped"] = True
    report(run, record, line)


def prune_checkpoints(run):
    """Rank 0 deletes the checkpoints past --keep-checkpoints: only once the newest one's weights trained to a finite
    loss, so that the last checkpoint that trains is never deleted."""
    if run.master:
        plumbing.prune_checkpoints(run.cfg.log_dir, run.cfg.keep_checkpoints)


def stop_if_diverging(run):
    """After --max-bad-steps non-finite steps in a row, stops the run, naming the checkpoint to go back to: the latest
    from before them, as the weights that made them non-finite came later."""
    cfg = run.cfg
    in_a_row = 0 if run.nonfinite_since is None else run.step - run.nonfinite_since + 1
    if in_a_row >= cfg.max_bad_steps:
        good = plumbing.latest_checkpoint(cfg.log_dir, before_step=run.nonfinite_since)
        later = good != plumbing.latest_checkpoint(cfg.log_dir)
        resume = (f"resume from {good}" + (f" (--resume {good}: the later checkpoints hold the weights that went "
                                           f"non-finite)" if later else "")) if good else "start again"
        raise UsageError(f"{in_a_row} steps in a row had a non-finite loss or gradient norm (last: step {run.step}); "
                         f"stopping. Lower --max-lr and {resume}")


def training_loop(run, stop_signal):
    """Trains from run.step to --max-steps, evaluating and saving checkpoints on the way. Returns whether a stop
    signal ended it early: every rank then stops at the same step, as they vote on it."""
    cfg, env = run.cfg, run.env
    start, save_due = run.step, False
    while run.step < cfg.max_steps:
        if evaluate_unless_stopped(run, stop_signal):
            return True
        save_due |= run.step > start and cfg.checkpoint_every > 0 and run.step % cfg.checkpoint_every == 0
        saved = save_due and run.nonfinite_since is None  # not while steps are non-finite: their weights may be why
        if saved:
            save_checkpoint(run)
            save_due = False
        t0 = time.perf_counter()
        batches = run.stream.next_step(cfg.batch_size, cfg.seq_len, accumulation_steps(cfg, env.world_size), env.rank,
                                       env.world_size, cfg.vocab_size)
        set_lr(run.optimizers, run.step, cfg)
        result = train_step(run.compiled, run.optimizers, run.scaler, batches, run.autocast_ctx, cfg.grad_clip)
        if env.device_type == "cuda":
            torch.cuda.synchronize()  # the optimizer's kernels belong to this step's time
        if result.finite:
            run.nonfinite_since = None
            if saved:
                prune_checkpoints(run)
        elif run.nonfinite_since is None:
            run.nonfinite_since = run.step
        log_step(run, result, run.optimizers[0].param_groups[0]["lr"], time.perf_counter() - t0)
        stop_if_diverging(run)
        run.step, run.evaluated = run.step + 1, False
        if any_rank(bool(stop_signal), env.device):  # a signal that came during the step
            return True
    return False


def finish(run, stopped_by_signal, seconds):
    """Says how the run ended and what to do next."""
    cfg = run.cfg
    if not run.master:
        return
    last = plumbing.latest_checkpoint(cfg.log_dir)
    if run.nonfinite_since is not None:
        print(f"{'stopped by signal' if stopped_by_signal else 'done'} at step {run.step}, not saved: the steps since "
              f"{run.nonfinite_since} were non-finite; the latest checkpoint is {last or 'none'}")
    elif stopped_by_signal and last is None:
        print("stopped by signal before the first step: nothing to save")
    elif stopped_by_signal:
        left = " (the last: only its final evaluation is left)" if run.step == cfg.max_steps else ""
        same = "the same command" if cfg.resume == "auto" else "the same command without --no-resume or --resume"
        print(f"stopped by signal at step {run.step}{left}, checkpoint saved; resume with {same} (it picks up "
              f"{cfg.log_dir})")
    else:
        hint = f"; for more samples: python train_gpt2.py --sample {last}" if last else ""
        print(f"done: step {run.step}, val loss {run.val_loss:.4f}, trained for {seconds / 60:.1f} min{hint}")


def train_to_the_end(run):
    """The training loop, then the end of the run: the final evaluation and checkpoint, or the checkpoint a stop
    signal asks for."""
    stop_signal = catch_stop_signals()
    start, t0 = run.step, time.perf_counter()
    stopped = training_loop(run, stop_signal) or evaluate_unless_stopped(run, stop_signal)  # the final evaluation
    # the end that a signal saved unevaluated is saved again once evaluated, or every later start would evaluate it
    if (run.step > start or (run.resumed_from and run.evaluated)) and run.nonfinite_since is None:
        save_checkpoint(run)
        prune_checkpoints(run)  # the run ended on a finite step
    finish(run, stopped, time.perf_counter() - t0)


def start_run(cfg, env):
    """The run, set up and restored from its checkpoint if it has one, and its log started; None if that checkpoint
    is already the end of the run."""
    ckpt, ckpt_path = find_resume_checkpoint(cfg, env)
    run = set_up(cfg, env, pretrained=ckpt is None and cfg.init_from != "scratch")
    if ckpt is not None:
        restore(run, ckpt, ckpt_path)
        if finished(run):
            return None
    start_log(run)
    return run


def train(cfg, given):
    """A whole run: the settings resolved, the log directory held, the run set up, trained (or evaluated) and ended."""
    env = set_up_distributed(cfg.device, cfg.fsdp)
    cfg = resolve_config(cfg, given, env)
    with contextlib.ExitStack() as held:
        with failing_together():
            if env.rank == 0:
                held.enter_context(plumbing.lock_log_dir(cfg.log_dir, exclusive=not cfg.eval_only))
        run = start_run(cfg, env)
        if run is None:
            return
        try:
            start_wandb(run)
            run.compiled = compile_and_wrap(run.model, cfg, env)
            if cfg.eval_only:
                evaluate(run)
            else:
                train_to_the_end(run)
        finally:
            run.log.finish(failed=sys.exc_info()[0] is not None)  # in a finally, exc_info is the error on its way out


# -----------------------------------------------------------------------------
# The command line: train, print samples from a checkpoint, or export one for Hugging Face's transformers.


def checkpoint_val_loss(ckpt):
    """The validation loss of the checkpoint's weights, in words: a signal may have saved them before their
    evaluation."""
    step, val_step, val_loss = ckpt["step"], ckpt["val_step"], ckpt["val_loss"]
    if val_loss is None:
        return "not evaluated"
    if val_step == step:
        return f"val loss {val_loss:.4f}"
    return f"not evaluated; val loss {val_loss:.4f} at step {val_step}"


def sample_from_checkpoint(cfg):
    """--sample PATH: print samples from a checkpoint, without any training setup."""
    require(cfg, ("num_samples", "max_new_tokens"), lambda v: v >= 0, "zero or more")
    env = set_up_distributed(cfg.device)
    try:
        ckpt = load_checkpoint(cfg.sample)
    except ValueError as e:
        raise UsageError(f"--sample {cfg.sample}: cannot load it as a checkpoint ({e})")
    model = model_from_checkpoint(ckpt, cfg.sample).to(env.device)
    dtype = resolve_dtype(cfg.dtype, env.device_type)
    print(f"checkpoint of step {ckpt['step']} ({checkpoint_val_loss(ckpt)}), prompt {cfg.prompt!r}")
    print_samples(model, cfg, plumbing.gpt2_tokenizer(), env.device, autocast_context(env.device_type, dtype),
                  cfg.seed, ckpt["step"])


def export_checkpoint(cfg, argv):
    """--export-hf DIR: the latest checkpoint in --log-dir (or --resume's, or OpenAI's weights with --init-from) as a
    Hugging Face model directory, which transformers loads as a GPT-2; no training setup."""
    hf_export.check_new_directory(cfg.export_hf)  # now, not after a long load
    if cfg.init_from != "scratch":
        model = GPT.from_pretrained(cfg.init_from, cache_dir=cfg.cache_dir or None)
        source, about = f"OpenAI's {cfg.init_from}", hf_export.published_facts(cfg.init_from)
    else:
        ckpt, source = find_resume_checkpoint(cfg, Env(rank=0, local_rank=0, world_size=1, device="cpu",
                                                       device_type="cpu"))  # one process: the weights, on the CPU
        if ckpt is None:
            raise UsageError(f"--export-hf {cfg.export_hf}: no checkpoint in --log-dir {cfg.log_dir}; pass the "
                             f"run's --log-dir, --resume PATH, or --init-from gpt2")
        if ckpt["model_config"]["recipe"] != "gpt2":  # transformers would load it as a GPT-2 that computes otherwise
            raise UsageError(f"--export-hf: {source} holds a model of --recipe {ckpt['model_config']['recipe']}, "
                             f"which GPT-2's Hugging Face format cannot hold; only GPT-2's recipe exports")
        model = model_from_checkpoint(ckpt, source)
        about = hf_export.checkpoint_facts(source, ckpt["step"], ckpt["train_config"], checkpoint_val_loss(ckpt))
    command = shlex.join(["python", "train_gpt2.py", *argv])
    n_params = hf_export.export(cfg.export_hf, model.state_dict(), asdict(model.config), model.n_tokens,
                                dict(about, command=command))
    print(f"exported {source} to {cfg.export_hf}: a GPT-2 of {n_params / 1e6:.2f}M parameters for Hugging Face's "
          f"transformers (AutoModelForCausalLM.from_pretrained({cfg.export_hf!r}))")


def main(argv=None):
    """A UsageError ends the process with its one line on stderr and exit code 2, never a traceback, once the process
    group is torn down."""
    cfg, given = parse_args(argv)
    signal_handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    error = None
    try:
        if cfg.sample:
            sample_from_checkpoint(cfg)
        elif cfg.export_hf:
            export_checkpoint(cfg, sys.argv[1:] if argv is None else argv)
        else:
            train(cfg, given)
    except UsageError as e:
        error = str(e)  # not e: its traceback holds the (DDP) model, which must be freed before its process group
    finally:
        tear_down_distributed()
        for sig, handler in signal_handlers.items():  # a run catches them; give them back to an importing caller
            signal.signal(sig, handler)
        if error is not None:
            sys.stderr.write(f"error: {error}\n")  # one write: under torchrun, the ranks' lines do not interleave
            sys.exit(2)


if __name__ == "__main__":
    main()
