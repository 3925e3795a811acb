"""
The modern recipe, `python train_gpt2.py --recipe modern`: what the field has learnt since GPT-2, as the
modded-nanogpt speedrun's plain-attention trainer and nanochat use it. Read it beside train_gpt2.py, which holds
GPT-2's: the model has GPT-2's interface and module names (so sampling, HellaSwag, checkpoints, FSDP and the KV cache
work unchanged), and each change says what it replaces there and where it comes from.

- rotary positions instead of a position table (Su et al. 2021, RoFormer)
- QK-norm: queries and keys RMS-normed per head (Henry et al. 2020; Dehghani et al. 2023)
- RMSNorm with no gain, and no biases anywhere (Zhang & Sennrich 2019; modded-nanogpt)
- ReLU² instead of GELU (So et al. 2021, Primer)
- zero-initialised output projections and head; an untied head (modded-nanogpt, after Zhang et al. 2019, Fixup)
- logits soft-capped at 15 (Gemma 2, Google DeepMind 2024)
- Muon for the blocks' matrices (Jordan et al. 2024), Adam (0.8, 0.95) for the embedding and head at rates of their
  own (modded-nanogpt, nanochat), instead of AdamW for all; under --fsdp, Muon on matrices split over the ranks
  (ShardedMuon)
- a constant learning rate, then a linear cool-down, instead of warmup and a cosine (Hägele et al. 2024)

Its model is transformers' NanoChatForCausalLM, so --export-hf writes it as one, which --init-from DIR reads back
(HF_FORMAT). train_gpt2.py chooses the recipe in one place (RECIPES), which takes this file's RECIPE, at its end. It
never imports train_gpt2, which runs as __main__.
"""

import contextlib
import os
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from machinery import checks, settings
from machinery.errors import UsageError
from machinery.settings import setting
from machinery.tokenizer import GPT2_VOCAB
from variations import hf_layouts
from variations.losses import chunked_cross_entropy, soft_cap

try:  # torch.optim.Muon's own steps (torch 2.9 and later), so that ShardedMuon's update is exactly Muon's; private
    from torch.optim._muon import _adjust_lr as muon_lr_scale
    from torch.optim._muon import _zeropower_via_newtonschulz as orthogonalize
except ImportError:  # --fsdp --recipe modern is refused then (check_settings)
    muon_lr_scale = orthogonalize = None


@dataclass(frozen=True)
class Settings:
    """The settings only this recipe reads: train_gpt2.py's TrainConfig inherits them, so each is a flag of its own
    (--muon-lr), and GPT-2's recipe refuses them."""
    muon_lr: float = setting(0.02, "--recipe modern: Muon's learning rate, for the blocks' matrices")
    embed_lr: float = setting(0.2, "--recipe modern: Adam's learning rate for the token embedding")
    head_lr: float = setting(0.004, "--recipe modern: Adam's learning rate for the output layer")
    cooldown_frac: float = setting(0.4, "--recipe modern: the last fraction of the run, over which the learning rate "
                                        "falls linearly to --min-lr-ratio of its peak")
    logit_softcap: float = setting(15.0, "--recipe modern: logits are squashed smoothly into (-cap, cap)", model=True)


SETTINGS = tuple(f.name for f in fields(Settings))
# Each in a log directory of its own, so that a modern run never meets GPT-2's run in log/ (it would refuse it).
PRESETS = {
    # on FineWeb: a fifth of GPT-2's steps (the speedrun's plain-attention trainer reached GPT-2's loss in 3,250; not
    # yet measured with this one), at full rate from the first
    "fineweb": dict(max_steps=3815, warmup_steps=0, log_dir="log_modern"),
    # on tiny Shakespeare (over train_gpt2.py's SHAKESPEARE): the rates of benchmarks/recipes.py's search, on a model
    # of about that size (docs/LOG.md, 2026-11-25)
    "shakespeare": dict(warmup_steps=0, muon_lr=0.02, embed_lr=0.3, head_lr=0.004, log_dir="log_modern"),
    # fine-tuning with --init-from on it (over SHAKESPEARE_FINETUNE): the rates above over 60, as GPT-2's 3e-5 is its
    # 2e-3 over 67. The quick start's export, fine-tuned on the text it learnt, held its 4.5285 at 4.5362 after 100
    # steps; at the rates above it went to 5.1351 (docs/LOG.md, 2026-11-28)
    "shakespeare_finetune": dict(warmup_steps=10, muon_lr=0.0003, embed_lr=0.005, head_lr=0.00007),
}


def check_settings(cfg, given):
    """Refuses, in one line, what this recipe cannot honour. (--init-from gpt2 never comes here: OpenAI's weights fix
    GPT-2's recipe, as an export of this one's, a NanoChatForCausalLM, fixes this one.)"""
    if not hasattr(torch.optim, "Muon"):
        raise UsageError(f"--recipe modern needs torch.optim.Muon, new in PyTorch 2.9; this is {torch.__version__}: "
                         f"upgrade torch, or drop --recipe modern")
    if cfg.fsdp and orthogonalize is None:
        raise UsageError(f"--fsdp --recipe modern shards Muon with the steps of torch.optim.Muon's own update, which "
                         f"this torch ({torch.__version__}) does not have where it looked (torch.optim._muon); use the "
                         f"torch that requirements.txt names, or drop --fsdp")
    checks.require(cfg, ("logit_softcap",), lambda v: v > 0, "positive")
    checks.require(cfg, ("cooldown_frac",), lambda v: 0 < v <= 1, "above 0 and at most 1")
    head_size = cfg.n_embd // cfg.n_head
    if head_size % 2:  # rotate turns each value of a head's first half with its partner in the second
        raise UsageError(f"--recipe modern turns queries and keys in pairs of values (rotary positions), which needs "
                         f"an even head size, and --n-embd {cfg.n_embd} / --n-head {cfg.n_head} = head size "
                         f"{head_size}; pass --n-embd {cfg.n_head * (head_size + 1)} (head size {head_size + 1})")


# -----------------------------------------------------------------------------
# The model

ROTARY_BASE = 10000.0  # RoFormer's: the rotary frequencies go from 1 down to about 1/ROTARY_BASE


def rotary_tables(head_size, n_positions, base=ROTARY_BASE):
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


def rms_norm(x):
    """RMSNorm with no gain (GPT-2: LayerNorm with gain and bias): the matrices after it can learn any scale."""
    return F.rms_norm(x, (x.size(-1),))


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.naive = config.n_head, config.attn == "naive"
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)  # no biases (GPT-2: biases)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.c_proj.RESIDUAL_PROJECTION = True

    def forward(self, x, rotary, kv_cache=None):
        B, T, C = x.size()
        heads = [t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2)]
        q, k, v = heads  # (B, nh, T, hs) each
        q, k = rms_norm(q), rms_norm(k)  # QK-norm bounds q.k (GPT-2: none)
        # rotary positions (GPT-2: a position table added to the embedding); .to: autocast may run the norm in
        # float32, and attention wants one dtype
        q, k = rotate(q, *rotary).to(v.dtype), rotate(k, *rotary).to(v.dtype)
        if kv_cache is not None:  # sampling, as in GPT-2's: the new tokens attend to the cached keys and values too
            k, v = (torch.cat([kv_cache[0], k], dim=2), torch.cat([kv_cache[1], v], dim=2)) if kv_cache else (k, v)
            kv_cache[:] = [k, v]
        # --attn naive: torch's own written-out softmax attention, where GPT-2's has one of its own
        with sdpa_kernel(SDPBackend.MATH) if self.naive else contextlib.nullcontext():
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)
        self.c_proj.RESIDUAL_PROJECTION = True

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())  # ReLU², sparser and cheaper (GPT-2: GELU)


class Block(nn.Module):
    """GPT-2's block, with norms that have no weights: they are functions (ln_1, ln_2 stand for them in GPT-2's)."""

    def __init__(self, config):
        super().__init__()
        self.attn = CausalSelfAttention(config)
        self.mlp = MLP(config)

    def forward(self, x, rotary, kv_cache=None):
        x = x + self.attn(rms_norm(x), rotary, kv_cache)
        return x + self.mlp(rms_norm(x))


class GPT(nn.Module):
    """The modern model: GPT-2's interface, logits, loss = model(idx, targets), and its module names."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.n_tokens = min(config.vocab_size, GPT2_VOCAB)  # rows past this are padding, at -inf as in GPT-2's
        mask = torch.where(torch.arange(config.vocab_size) < GPT2_VOCAB, 0.0, float("-inf"))
        self.register_buffer("vocab_mask", mask if config.vocab_size > GPT2_VOCAB else None, persistent=False)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),  # no position table (GPT-2: wpe): rotary instead
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.RMSNorm(config.n_embd, elementwise_affine=False),
        ))
        # untied (GPT-2: the embedding's weights): the output layer and the embedding learn at rates of their own
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        cos, sin = rotary_tables(config.n_embd // config.n_head, config.block_size)
        self.register_buffer("rotary_cos", cos, persistent=False)  # (block_size, hs/2)
        self.register_buffer("rotary_sin", sin, persistent=False)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        """Zero for the blocks' outputs and the head: each block starts as the identity, and the first predictions
        are uniform (the loss at step 0 is ln 50257 exactly); the other matrices scaled by their input width, the
        embedding N(0, 1) as the norm after it sets its scale (GPT-2: N(0, 0.02), scaled down with depth)."""
        if isinstance(module, nn.Linear):
            zero = hasattr(module, "RESIDUAL_PROJECTION") or module is self.lm_head
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.0 if zero else 0.5 * module.in_features**-0.5)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=1.0)

    def forward(self, idx, targets=None, kv_cache=None, at=None):
        """As GPT-2's: the logits (B, T, vocab_size), the padding ids at -inf (at: of the B*T positions, these alone),
        or given targets, (None, the mean loss)."""
        past = kv_cache[0][0].size(2) if kv_cache and kv_cache[0] else 0
        pos = torch.arange(past, past + idx.size(1), dtype=torch.long, device=idx.device)  # (T,)
        x = rms_norm(self.transformer.wte(idx))  # (B, T, C) the embedding normed
        rotary = self.rotary_cos[pos], self.rotary_sin[pos]  # (T, hs/2) each: the positions, as angles
        for i, block in enumerate(self.transformer.h):
            x = block(x, rotary, None if kv_cache is None else kv_cache[i])
        x = self.transformer.ln_f(x)  # (B, T, C)
        if targets is None:
            return self.logits(x if at is None else x.flatten(0, 1)[at]), None
        if self.config.loss == "chunked":  # the soft-cap inside the chunks
            return None, chunked_cross_entropy(x.flatten(0, 1), self.lm_head.weight, targets.flatten(),
                                               self.vocab_mask, self.config.logit_softcap)
        return None, F.cross_entropy(self.logits(x).flatten(0, 1), targets.flatten(), ignore_index=-1)

    def logits(self, x):
        """Soft-capped (GPT-2: not), in float32: bf16 would round the logits near the cap to a few values."""
        logits = soft_cap(self.lm_head(x).float(), self.config.logit_softcap)  # (B, T, V)
        return logits if self.vocab_mask is None else logits + self.vocab_mask


# -----------------------------------------------------------------------------
# Optimization


class ShardedMuon(getattr(torch.optim, "Muon", torch.optim.Optimizer)):  # torch.optim.Muon is new in torch 2.9
    """torch's Muon for matrices that FSDP shards over the ranks, row blocks of each to each rank. Orthogonalizing an
    update needs the whole matrix: every rank gathers each matrix's update in bf16 (the precision the orthogonalization
    runs in, so it is the same as Muon's unsharded), orthogonalizes it (all ranks the same work), and applies its own
    rows. Under HSDP the gather is within the shard group, and every replica, holding the same all-reduced gradients
    and momentum, computes the same update. The momentum stays sharded: it is elementwise. The arithmetic is on each
    rank's plain local rows: DTensor's operations each cost a dispatch in Python, and a step makes several for every
    matrix of the model."""

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
                weights, shard_dim = p.to_local(), p.device_mesh.ndim - 1  # HSDP's mesh is (replicate, shard)
                first_row = p.device_mesh.get_local_rank(shard_dim) * -(-p.shape[0] // p.device_mesh.size(shard_dim))
                weights.mul_(1 - group["lr"] * group["weight_decay"])
                weights.add_(whole[first_row:first_row + weights.shape[0]],
                             alpha=-muon_lr_scale(group["lr"], group["adjust_lr_fn"], p.shape))


def make_optimizers(model, cfg, fused):
    """Muon for the blocks' matrices: their momentum orthogonalized, so that every direction of a matrix learns at
    the same rate (Jordan et al. 2024). Adam for the embedding and the output layer, which are lookups and a
    classifier rather than maps between hidden spaces, each at a rate of its own. (GPT-2: AdamW for all.) Each
    parameter group keeps its peak learning rate as max_lr, which the schedule scales."""
    matrices = list(model.transformer.h.parameters())  # all of the blocks' parameters: they have no biases
    muon_class = ShardedMuon if cfg.fsdp else torch.optim.Muon  # sharded by --fsdp
    muon = muon_class([{"params": matrices, "max_lr": cfg.muon_lr}], lr=cfg.muon_lr, momentum=0.95, weight_decay=0.0)
    adam = torch.optim.Adam([{"params": [model.transformer.wte.weight], "max_lr": cfg.embed_lr},
                             {"params": [model.lm_head.weight], "max_lr": cfg.head_lr}],
                            lr=cfg.head_lr, betas=(0.8, 0.95), eps=1e-10, fused=fused)
    return [muon, adam]


def get_lr(step, max_lr, cfg):
    """Linear warmup (none by default) to max_lr, held there, then straight down over the last --cooldown-frac of
    the run to --min-lr-ratio of it at the last step (GPT-2: down along a cosine from the end of the warmup)."""
    min_lr = max_lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return max_lr * (step + 1) / cfg.warmup_steps
    left = (cfg.max_steps - 1 - step) / max(1, cfg.cooldown_frac * (cfg.max_steps - 1))  # 1 where it starts
    return min_lr + min(1.0, max(0.0, left)) * (max_lr - min_lr)


# -----------------------------------------------------------------------------
# As transformers' own NanoChatForCausalLM (transformers 5.0 and later), whose forward pass is this model's: an export
# (--export-hf) and an export read back (--init-from DIR). variations/hf_layouts.py lays out its files.

# F.rms_norm's epsilon, eps=None: the machine epsilon of the dtype it normalizes, float32's in an export
HF_FORMAT = hf_layouts.nanochat(rope_theta=ROTARY_BASE, rms_norm_eps=torch.finfo(torch.float32).eps)


def from_pretrained(directory, config, cache_dir=None):
    """The model of config (its recipe and shapes those of the export directory, presets.settings_of_export) with the
    export's weights; the token rows past GPT-2's, padding, zero."""
    model = GPT(config)
    with torch.no_grad():
        HF_FORMAT.load_layout(os.path.join(directory, "model.safetensors"), model.state_dict(), model.n_tokens,
                              directory, "export it again")
    return model


# Its step's memory (machinery/step_memory.py): Muon keeps one fp32 momentum per block matrix parameter, Adam two per
# embedding and head parameter; the soft-capped logits are kept too, and F.cross_entropy's backward, which the
# soft-capped loss keeps, puts their gradient beside them where the step is one compiled graph (DDP's layout)
STEP_MEMORY = settings.StepMemory(optimizer_bytes=(4, 8), saved_per_token=(42, 6, 2), saved_per_token_eager=(76, 12, 8),
                                  logits_peak_eager={"full": 16, "chunked": 24}, ddp_logits_copies=2)

RECIPE = settings.Recipe(model=GPT, optimizers=make_optimizers, get_lr=get_lr, presets=PRESETS, settings=SETTINGS,
                         check_settings=check_settings, hf_format=HF_FORMAT, from_pretrained=from_pretrained,
                         named="the modern recipe", memory=STEP_MEMORY, schedule=("cooldown_frac",))
