"""
Train GPT-2 from scratch: the settings, the model, the data, the optimizer, processes and precision, the training step,
evaluation, the run's set-up, then the training loop, each written before what uses it.

    python train_gpt2.py                                    # one GPU, or a CPU or Apple GPU for debugging
    torchrun --standalone --nproc_per_node=8 train_gpt2.py  # every GPU of one node
    python train_gpt2.py --help                             # every setting, with its default and the presets

Without FineWeb shards (`python fineweb.py` makes them), it trains a small model on tiny Shakespeare. The recipes and
speed-ups it can swap in are in variations/, the benchmarks it scores in evaluation/, the run's machinery in machinery/.
"""

import contextlib
import datetime
import gc
import inspect
import math
import os
import signal
import sys
from dataclasses import asdict, dataclass, fields
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F

from evaluation import core_score, hellaswag
from machinery import checkpoint_commands, fsdp, log_directory, microbatch, ranks, resume, run_log, settings
from machinery.checkpoints import saved_model_config
from machinery.checks import check_paths, require
from machinery.downloads import hub_weights
from machinery.environment import check_device, processes
from machinery.errors import DataError, UsageError
from machinery.presets import presets_help
from machinery.resolution import draft_settings, final_settings
from machinery.run_state import Run
from machinery.settings import setting
from machinery.shard_files import SHARD_SUFFIXES, open_shard, shard_paths
from machinery.tokenizer import EOT, GPT2_VOCAB, gpt2_tokenizer
from variations import hf_layouts, modern, speedups
from variations.losses import chunked_cross_entropy

HERE = os.path.dirname(os.path.realpath(__file__))  # this file's own directory, not a link's: input.txt lies there
PADDED_VOCAB = 50304  # GPT-2's 50257 tokens padded to a multiple of 128: matmuls of that width run faster on GPUs
BENCHMARKS = (hellaswag, core_score)  # what a run can score (evaluation/), in the order of its lines and model card

# -----------------------------------------------------------------------------
# Settings: edit the defaults here, or pass any of them as a flag (n_layer -> --n-layer).
# The defaults are the GPT-2 124M recipe on FineWeb-Edu 10B tokens.

MODEL_SIZES = {  # n_layer, n_head, n_embd of OpenAI's four GPT-2 models
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M parameters
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}


@dataclass(frozen=True)  # the run's settings are decided once (final_config), then never assigned
class TrainConfig(speedups.Settings, modern.Settings):  # the modern recipe's (--muon-lr, ...) and speed-ups' too
    # data and outputs
    data: str = setting("edu_fineweb10B", "a directory of *train* and *val* shards (.npy or .bin), or a text file",
                        path=True)
    log_dir: str = setting("log", "where log.jsonl and checkpoints go", path=True)
    model: str = setting("gpt2", "size preset for --n-layer/--n-head/--n-embd", list(MODEL_SIZES))
    preset: str = setting("auto", "shakespeare: the quick start's SHAKESPEARE on any --data", ["auto", "shakespeare"])
    # model (model=True: GPTConfig's, kept in checkpoints and exports)
    block_size: int = setting(1024, "longest context the model can take (the rows of its position table)", model=True)
    vocab_size: int = setting(PADDED_VOCAB, "embedding rows: GPT-2's 50257 tokens padded to a multiple of 128",
                              model=True)
    n_layer: int = setting(0, "transformer blocks (0: from --model)", model=True)
    n_head: int = setting(0, "attention heads (0: from --model)", model=True)
    n_embd: int = setting(0, "embedding width (0: from --model)", model=True)
    attn: str = setting("sdpa", "sdpa (flash attention), naive (explicit masked softmax, for tests)", ["sdpa", "naive"],
                        model=True)
    recipe: str = setting("gpt2", "gpt2: GPT-2 exactly; modern: rotary, QK-norm, ReLU², an untied zero-init head, "
                          "logit soft-cap, Muon, a constant rate then a cool-down (modern.py)", ["gpt2", "modern"],
                          model=True)
    init_from: str = setting("scratch", "random weights, OpenAI's (gpt2, gpt2-medium, ...) or an --export-hf directory",
                             path=True)
    # batch: total_batch_size = batch_size * seq_len * accumulation steps * processes
    batch_size: int = setting(64, "micro-batch: sequences per forward pass in each process, halved until a step fits")
    fit_batch_size: bool = setting(True, "try a step of --batch-size first, halving it until one fits in memory "
                                   "(microbatch.py); off: train it as given")
    grow_batch_size: Optional[bool] = setting(None, "where --batch-size fits, try larger ones up to a process's "
                                              "sequences a step: fewer accumulation steps (default: on for CUDA)")
    seq_len: int = setting(1024, "tokens per sequence")
    total_batch_size: int = setting(524288, "tokens per optimizer step, over all processes (2**19, GPT-3 small's 0.5M)")
    # optimization
    max_steps: int = setting(19073, "optimizer steps (19073 x 524288 tokens: one pass over FineWeb-Edu 10B)")
    warmup_steps: int = setting(715, "steps of linear learning-rate warmup")
    max_lr: float = setting(6e-4, "peak learning rate; cosine decay then takes it to min_lr_ratio of this")
    min_lr_ratio: float = setting(0.1, "final learning rate as a fraction of --max-lr")
    weight_decay: float = setting(0.1, "AdamW weight decay of the matmul and embedding weights")
    grad_clip: float = setting(1.0, "clip the global gradient norm to this")
    seed: int = setting(1337, "seeds the weights, the shard order and the samples")
    # evaluation, samples, checkpoints
    eval_every: int = setting(250, "steps between validation and samples (0: only at the end)")
    val_tokens: int = setting(10485760, "validation tokens: a fixed set, the same for any number of processes")
    hellaswag_every: int = setting(250, "steps between HellaSwag evaluations (0: never; the default is 0 without CUDA)",
                                   benchmark="HellaSwag")
    hellaswag_file: str = setting("", "a local hellaswag_val.jsonl, for machines with no internet", path=True)
    core_every: int = setting(2000, "steps between CORE evaluations (0: never; the default is 0 without CUDA)",
                              benchmark="CORE")
    core_max_per_task: int = setting(0, "examples a CORE task (0: nanochat's 500 in training, all at the end)")
    core_data: str = setting("", "a local CORE bundle (an unzipped eval_bundle.zip), for machines with no internet",
                             path=True)
    cache_dir: str = setting("", "for downloads (empty: $GPT2_CACHE_DIR, else ~/.cache/train_gpt2)", path=True)
    eval_only: bool = setting(False, "evaluate the latest checkpoint in --log-dir (or --resume's), log it, and stop")
    prompt: str = setting("Hello, I'm a language model,", "prompt of the samples")
    num_samples: int = setting(4, "samples printed at each evaluation")
    max_new_tokens: int = setting(32, "length of each sample")
    sample: str = setting("", "print samples from this checkpoint and exit, with no training", path=True)
    export_hf: str = setting("", "write the latest checkpoint in --log-dir (or --resume's) here, for transformers",
                             path=True)
    checkpoint_every: int = setting(2500, "steps between checkpoints (0: only at the end and on SIGTERM/SIGINT)")
    keep_checkpoints: int = setting(2, "how many of the latest checkpoints to keep")
    resume: str = setting("auto", "auto: the latest checkpoint in --log-dir; or a checkpoint's path", path=True)
    max_bad_steps: int = setting(5, "stop after this many steps in a row with a non-finite loss or gradient norm")
    # experiment tracking
    wandb_project: str = setting("", "also log to this Weights & Biases project (empty: off; pip install wandb)")
    wandb_run_name: str = setting("", "the W&B run's name (empty: W&B makes one up)")
    # hardware and speed
    device: str = setting("auto", "auto picks cuda, then mps, then cpu", ["auto", "cpu", "cuda", "mps"])
    dtype: str = setting("auto", "auto: bf16 on Ampere and newer, fp16 on older GPUs, fp32 elsewhere",
                         ["auto", "fp32", "tf32", "bf16", "fp16"])
    compile: Optional[bool] = setting(None, "torch.compile the model (default: on for CUDA)")
    compile_mode: str = setting("default", "max-autotune: faster kernels (compiles for minutes); reduce-overhead: CUDA "
                                "graphs", ["default", "max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead"])
    fused_adamw: bool = setting(True, "use the fused CUDA kernel of AdamW")
    fsdp: bool = setting(False, "shard weights, gradients, optimizer state over the processes (FSDP2), not copy them")
    fsdp_shards: Optional[int] = setting(None, "--fsdp's processes each tensor is split over, replicated across such "
                                         "groups (HSDP); 0: all (default: a node's, torchrun's LOCAL_WORLD_SIZE)")
    loss: str = setting("auto", "full: one cross-entropy over all (B*T, vocab) logits; chunked: a chunk of rows at a "
                        "time, never all the logits (less memory); auto: chunked on CUDA, where it is as fast, full "
                        "elsewhere, where it is not", ["auto", "full", "chunked"], model=True)


GPTConfig = settings.model_config_class(TrainConfig)  # the model's settings: those above marked model=True

# Presets: what a kind of run changes above (edit it here, not there), unless a flag gives it; the first lines name each
# (modern.py's PRESETS are the modern recipe's). A model that learns tiny Shakespeare in minutes on a laptop CPU, with
# no shards, or on any data with --preset shakespeare. Its vocab is unpadded (padding speeds up GPU matmuls, not a
# CPU's); the output layer costs most of a step, so depth is cheap (docs/LOG.md); 900 steps are 3 passes.
SHAKESPEARE = dict(
    data=os.path.join(HERE, "input.txt"), n_layer=8, n_head=4, n_embd=128, block_size=256, vocab_size=GPT2_VOCAB,
    batch_size=8, seq_len=128, total_batch_size=1024, max_steps=900, warmup_steps=50, max_lr=2e-3, eval_every=150,
    val_tokens=16384, hellaswag_every=0, core_every=0, checkpoint_every=0, prompt="\n", max_new_tokens=48,
    num_samples=3,
)
# Fine-tuning OpenAI's GPT-2 on it instead (--init-from gpt2): a far gentler learning rate, and fewer steps.
SHAKESPEARE_FINETUNE = dict(max_steps=100, warmup_steps=10, max_lr=3e-5, eval_every=25)
# --init-from NAME, on any data: OpenAI's model, MODEL_SIZES[NAME] and the model settings above at their defaults but
# how it computes (--block-size 1024, --vocab-size 50304, --recipe gpt2); a flag that says otherwise is refused
OPENAI_SHAPES = {f.name: f.default for f in fields(GPTConfig)
                 if f.name not in (*MODEL_SIZES["gpt2"], *settings.COMPUTE_ONLY)}
PRESETS = dict(SHAKESPEARE=SHAKESPEARE, SHAKESPEARE_FINETUNE=SHAKESPEARE_FINETUNE, OPENAI_SHAPES=OPENAI_SHAPES)


def parse_args(argv=None):
    """Returns the config and the names of the settings given on the command line."""
    parser = settings.flag_parser(TrainConfig, __doc__, presets_help(PRESETS, RECIPES))  # --n-layer for n_layer, ...
    parser.add_argument("--no-resume", dest="resume", action="store_const", const="none",
                        help="start fresh, moving an earlier run's files in --log-dir aside")
    given = vars(parser.parse_args(argv))
    return TrainConfig(**given), set(given)


# -----------------------------------------------------------------------------
# The model: GPT-2 exactly, so OpenAI's weights load into it one-to-one.

LAYER_NORM_EPS = 1e-5  # GPT-2's: added to the variance in every LayerNorm (config.json's layer_norm_epsilon)


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
        self.n_head, self.naive = config.n_head, config.attn == "naive"
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v of all heads in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_PROJECTION = True

    def forward(self, x, kv_cache=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
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
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2 used the tanh approximation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_PROJECTION = True

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=LAYER_NORM_EPS)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=LAYER_NORM_EPS)
        self.mlp = MLP(config)

    def forward(self, x, kv_cache=None):
        x = x + self.attn(self.ln_1(x), kv_cache)
        return x + self.mlp(self.ln_2(x))


class CrossEntropyWithPointwiseBackward(torch.autograd.Function):
    """F.cross_entropy(logits, targets, ignore_index=-1), the log-sum-exp of each row kept for a pointwise backward.
    Compiled, F.cross_entropy's own backward reduces each row, and inductor gives its gradient a (B*T, V) buffer beside
    the saved logits (6 GiB at micro-batch 64); a pointwise one, it writes over the logits, no longer needed."""

    @staticmethod
    def forward(ctx, logits, targets):
        logits_fp32 = logits.float()  # (N, V) as autocast's cross-entropy computes: compile fuses the cast away
        lse = logits_fp32.logsumexp(dim=-1)  # (N,)
        valid = targets != -1  # (N,)
        target_logits = logits_fp32.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)  # (N,)
        n_valid = valid.sum()
        ctx.save_for_backward(logits, targets, lse, n_valid)
        return ((lse - target_logits) * valid).sum() / n_valid

    @staticmethod
    def backward(ctx, grad_loss):
        logits, targets, lse, n_valid = ctx.saved_tensors
        is_target = torch.arange(logits.size(1), device=logits.device) == targets[:, None]  # (N, V), -1 rows: none
        scale = (targets != -1)[:, None] * (grad_loss / n_valid)  # (N, 1): the rows left out get no gradient
        softmax = (logits.float() - lse[:, None]).exp()  # (N, V), 0 for the padding ids at -inf
        return ((softmax - is_target.float()) * scale).to(logits.dtype), None


def cross_entropy(logits, targets):
    """The mean cross-entropy of logits (N, V) over the targets (N,) that are not -1. Compiled, its backward writes the
    gradient over the logits (CrossEntropyWithPointwiseBackward); eager, F.cross_entropy's own kernels need less."""
    if torch.compiler.is_compiling():
        return CrossEntropyWithPointwiseBackward.apply(logits, targets)
    return F.cross_entropy(logits, targets, ignore_index=-1)


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.n_tokens = min(config.vocab_size, GPT2_VOCAB)  # rows past this are padding
        vocab_mask = torch.zeros(config.vocab_size)  # added to the logits: 0 for GPT-2's tokens,
        vocab_mask[GPT2_VOCAB:] = float("-inf")  # -inf for the padding ids, which get no probability and no gradient
        padded = config.vocab_size > GPT2_VOCAB
        self.register_buffer("vocab_mask", vocab_mask if padded else None, persistent=False)  # not saved
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, eps=LAYER_NORM_EPS),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            if hasattr(module, "RESIDUAL_PROJECTION"):  # keeps the residual stream's variance from growing with depth
                std *= (2 * self.config.n_layer) ** -0.5
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None, kv_cache=None, at=None):
        """Returns (logits, loss). Without targets: the logits (B, T, vocab_size) of the tokens idx (B, T), with the
        padding ids at -inf; with at, only those of the chosen B*T positions (CORE scores a few); idx may follow the
        tokens of kv_cache. With targets: (None, the mean loss over the targets that are not -1), as training never
        needs the logits themselves."""
        past = kv_cache[0][0].size(2) if kv_cache and kv_cache[0] else 0
        pos = torch.arange(past, past + idx.size(1), dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        for i, block in enumerate(self.transformer.h):
            x = block(x, None if kv_cache is None else kv_cache[i])
        x = self.transformer.ln_f(x)  # (B, T, C)
        if targets is None:
            return self.logits(x if at is None else x.flatten(0, 1)[at]), None
        if self.config.loss == "chunked":  # a chunk of rows at a time: no (B*T, V) logits in memory
            return None, chunked_cross_entropy(x.flatten(0, 1), self.lm_head.weight, targets.flatten(), self.vocab_mask)
        return None, cross_entropy(self.logits(x).flatten(0, 1), targets.flatten())  # compiled: 6 GiB less at B=64

    def logits(self, x):
        logits = self.lm_head(x)  # (B, T, V)
        if self.vocab_mask is not None:  # in the logits' dtype: bf16 stays bf16; compile fuses the add into the loss
            logits = logits + self.vocab_mask.to(logits.dtype)
        return logits

    @classmethod
    def from_pretrained(cls, name, config=None, cache_dir=None):
        """OpenAI's GPT-2 `name` (gpt2, gpt2-medium, gpt2-large, gpt2-xl), downloaded once into the cache; or, if name
        is a directory, the GPT-2 there (--export-hf's, or the Hub's). A config, if given, has that model's shapes."""
        local = os.path.isdir(name)
        path = os.path.join(name, "model.safetensors") if local else hub_weights(f"openai-community/{name}", cache_dir)
        if config is None:
            config = GPTConfig(**(hf_layouts.gpt2_shape(name, LAYER_NORM_EPS) if local else MODEL_SIZES[name]))
        model = cls(config)
        with torch.no_grad():  # the keys and shapes checked, OpenAI's Conv1D weights transposed for nn.Linear
            fix = "export it again" if local else "delete it to download it again"
            hf_layouts.load_gpt2_layout(path, model.state_dict(), model.n_tokens, name, fix)
        return model


@torch.no_grad()
def generate(model, prompt_tokens, num_samples, max_new_tokens, generator, top_k=50):
    """The prompt and max_new_tokens sampled after it, top-k from the softmax. A KV cache makes each new token cost
    one position; once the context outgrows the block, the window slides: each token is predicted from the last
    block_size, recomputed."""
    device, block_size = model.lm_head.weight.device, model.config.block_size
    tokens = torch.tensor(prompt_tokens, dtype=torch.long, device=device).repeat(num_samples, 1)  # (N, P)
    kv_cache = [[] for _ in model.transformer.h]
    logits, _ = model(tokens[:, -block_size:], kv_cache=kv_cache)
    for _ in range(max_new_tokens):
        probs = F.softmax(logits[:, -1].float(), dim=-1)  # (N, V): exactly 0 for the padding ids, at -inf
        top_probs, top_ids = torch.topk(probs, min(top_k, probs.size(-1)), dim=-1)  # (N, k)
        choice = torch.multinomial(top_probs, 1, generator=generator)  # (N, 1)
        next_ids = torch.gather(top_ids, -1, choice)  # (N, 1)
        tokens = torch.cat([tokens, next_ids], dim=1)
        if tokens.size(1) == len(prompt_tokens) + max_new_tokens:
            break  # no logits needed after the last token
        if kv_cache[0][0].size(2) < block_size:
            logits, _ = model(next_ids, kv_cache=kv_cache)
        else:  # the positions are full: start the cache again from the last block_size tokens
            kv_cache = [[] for _ in model.transformer.h]
            logits, _ = model(tokens[:, -block_size:], kv_cache=kv_cache)
    return tokens.tolist()


# -----------------------------------------------------------------------------
# Data: token shards read from their files as the stream reaches them, or a text file tokenized in memory.


def check_token_ids(tokens, vocab_size, source):
    n_tokens = min(vocab_size, GPT2_VOCAB)  # the ids the model scores: padding rows are not tokens
    if len(tokens) and int(tokens.max()) >= n_tokens:
        raise DataError(f"{source} holds token id {int(tokens.max())}, but the model scores ids below {n_tokens} only "
                        f"(--vocab-size {vocab_size}, capped at GPT-2's {GPT2_VOCAB}); re-create the data with the "
                        f"GPT-2 tokenizer")


class TokenStream:
    """The training tokens as one endless stream: every shard end to end, in an order reshuffled each epoch. A step
    takes the next total_batch_size tokens (and one more, the last target), cut into chunks of B*T: micro-step m of rank
    r reads chunk m*world + r, so any split of a batch over processes and accumulation steps trains on the same tokens.
    """

    def __init__(self, shards, names, seed):
        nonempty = [i for i, shard in enumerate(shards) if len(shard)]  # an empty shard would stall seek()
        self.shards, self.names, self.seed = [shards[i] for i in nonempty], [names[i] for i in nonempty], seed
        self.lengths = [len(shard) for shard in self.shards]  # read once: each step seeks through them
        self.epoch, self.index, self.offset = 0, 0, 0  # now in shard order(epoch)[index], at token offset

    def order(self, epoch):
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))

    def seek(self, epoch, index, offset, n):
        """The position n tokens on from (epoch, index, offset)."""
        offset += n
        while offset >= (length := self.lengths[self.order(epoch)[index]]):
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
        return torch.from_numpy(np.concatenate(pieces, dtype=np.int64))  # cast as it copies: one pass

    def next_step(self, B, T, accum_steps, rank, world_size, vocab_size):
        """This rank's micro-batches (x, y) for one optimizer step, then moves past the whole global batch."""
        # every rank reads and checks the whole global batch, in one read (Run.read_step votes on it)
        window = self.read(accum_steps * world_size * B * T + 1, vocab_size)
        batches = []
        for micro in range(accum_steps):
            start = (micro * world_size + rank) * B * T
            buf = window[start: start + B * T + 1]
            batches.append((buf[:-1].view(B, T), buf[1:].view(B, T)))  # inputs, and targets one token later
        step_tokens = accum_steps * world_size * B * T
        self.epoch, self.index, self.offset = self.seek(self.epoch, self.index, self.offset, step_tokens)
        return batches

    def state_dict(self):
        """The position, and what it means something over: the seed (the shard order) and each shard's file name
        and length (the same shards moved to another directory are the same)."""
        return {"epoch": self.epoch, "index": self.index, "offset": self.offset, "seed": self.seed,
                "shards": [[os.path.basename(name), length] for name, length in zip(self.names, self.lengths)]}

    def load_state_dict(self, state):
        self.epoch, self.index, self.offset = state["epoch"], state["index"], state["offset"]


def read_text(path):
    """A text file's tokens: the first 90% to train on, the last 10% to validate."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--data {path}: cannot read it as UTF-8 text ({e})")
    tokens = np.array(gpt2_tokenizer().encode_ordinary(text), dtype=np.uint16)
    split = int(0.9 * len(tokens))
    return tokens[:split], tokens[split:]


def load_data(cfg):
    """The train stream and the fixed validation tokens, from a shard directory or a text file."""
    if not os.path.exists(cfg.data):
        raise UsageError(f"--data {cfg.data}: no such file or directory; make FineWeb shards with "
                         f"`python fineweb.py`, or pass a text file")
    if os.path.isdir(cfg.data):
        names, val_paths = shard_paths(cfg.data, training=not cfg.eval_only)
        train_shards, val_shards = [open_shard(p) for p in names], [open_shard(p) for p in val_paths]
    elif cfg.data.endswith(SHARD_SUFFIXES):
        raise UsageError(f"--data {cfg.data} is a single shard; pass the directory that holds the train and val shards")
    else:
        text_train, text_val = read_text(cfg.data)
        train_shards, names, val_shards = [text_train], [cfg.data], [text_val]
    train_tokens = sum(len(s) for s in train_shards)
    if train_tokens < cfg.total_batch_size + 1 and not cfg.eval_only:  # an evaluation reads the validation split
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
# Optimization: AdamW with decay on the weight matrices only, warmup then cosine decay.


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


def get_lr(step, max_lr, cfg):
    """Linear warmup to max_lr, then down to min_lr_ratio * max_lr along a cosine, reached at the last step."""
    min_lr = max_lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return max_lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - 1 - cfg.warmup_steps))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


# The one place a recipe is chosen (--recipe): its model, optimizers, schedule, presets, refusals and export.
RECIPES = {
    "gpt2": settings.Recipe(model=GPT, optimizers=gpt2_optimizers, get_lr=get_lr, presets={},
                            settings=("max_lr", "weight_decay"), check_settings=lambda cfg, given: require(
                                cfg, ("weight_decay",), lambda v: v >= 0, "zero or more"),
                            hf_format=hf_layouts.gpt2(LAYER_NORM_EPS), from_pretrained=GPT.from_pretrained, named="",
                            memory=settings.StepMemory(optimizer_bytes=(8, 8), ddp_logits_copies=1,  # AdamW's 2 moments
                                                       saved_per_token=(36, 6, 2), saved_per_token_eager=(64, 8, 4),
                                                       logits_peak_eager={"full": 12, "chunked": 20})),
    "modern": modern.RECIPE,
}


def make_optimizers(model, cfg, device_type):
    """The recipe's optimizers. Each parameter group keeps its peak learning rate as max_lr, which set_lr scales."""
    fused = cfg.fused_adamw and device_type == "cuda"  # one kernel for all parameters, not one per tensor
    return RECIPES[cfg.recipe].optimizers(model, cfg, fused)


def set_lr(optimizers, step, cfg):
    """Every parameter group's learning rate at step, from its own peak, along the recipe's schedule."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = RECIPES[cfg.recipe].get_lr(step, group["max_lr"], cfg)


# -----------------------------------------------------------------------------
# Processes, devices and precision: one process per GPU under torchrun, TF32, bf16 autocast, torch.compile, DDP.


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
    rank, local_rank, world_size = processes()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    check_device(device, local_rank, world_size, fsdp)
    if device == "cuda":
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    device_type = device.split(":")[0]
    if world_size > 1 or fsdp:
        ranks.before_any_process_group()
        # an hour, not 10 minutes: rank 0 alone may download GPT-2 XL or write a large checkpoint while the others wait
        backend, device_id = ("nccl", torch.device(device)) if device_type == "cuda" else ("gloo", None)
        alone = {} if world_size > 1 else dict(store=dist.HashStore(), rank=0, world_size=1)  # no torchrun needed
        dist.init_process_group(backend=backend, device_id=device_id, timeout=datetime.timedelta(hours=1), **alone)
    return Env(rank, local_rank, world_size, device, device_type)


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


def autocast_context(device_type, dtype):
    """Matmuls in bf16/fp16 with float32 master weights; a no-op for fp32 and tf32."""
    if dtype in ("bf16", "fp16"):
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)
    return contextlib.nullcontext()


def make_model(cfg, device, pretrained=False):
    """The recipe's model, on device: random weights, the same on every rank, or --init-from's if pretrained."""
    torch.manual_seed(cfg.seed)
    config = GPTConfig(**{f.name: getattr(cfg, f.name) for f in fields(GPTConfig)})  # settings of the same names
    load = RECIPES[cfg.recipe].from_pretrained  # OpenAI's weights, or an export directory's (of the recipe it fixed)
    model = load(cfg.init_from, config, cfg.cache_dir or None) if pretrained else model_of(config)
    return model.to(device)


def model_of(config):
    """A new model, random weights, of the recipe and shapes in config: a GPTConfig, or its fields as a dict (as a
    checkpoint records them)."""
    config = config if isinstance(config, GPTConfig) else GPTConfig(**config)
    return RECIPES[config.recipe].model(config)


def compile_model(model, cfg):
    """torch.compile fuses kernels; static shapes: evaluation's batch shapes get graphs of their own."""
    return torch.compile(model, dynamic=False, mode=cfg.compile_mode) if cfg.compile else model


def wrap_model(model, cfg, env):
    """What trains and evaluates: the model compiled and, under torchrun, in DDP, which all-reduces the gradients; or
    with --fsdp, sharded in place first (fsdp.py), so that the optimizers must be made after this."""
    if cfg.fsdp:
        return compile_model(fsdp.shard_model(model, cfg, env), cfg)
    compiled = compile_model(model, cfg)
    if env.world_size == 1:
        return compiled
    # the buffers (vocab mask, rotary tables) never change: no broadcast every forward (torch 2.13 renamed the option)
    ddp, option = nn.parallel.DistributedDataParallel, "forward_sync_buffers"  # the old name warns on every rank
    option = option if option in inspect.signature(ddp).parameters else "broadcast_buffers"  # torch before 2.13
    return ddp(compiled, device_ids=[env.local_rank] if env.device_type == "cuda" else None, **{option: False})


def gradient_sync(model, on):
    """Whether backward reduces the gradients over the ranks (on) or only adds them up: once per step, at its end."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP (also through torch.compile's wrapper)
        model.set_requires_gradient_sync(on)
    elif not on and isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


# -----------------------------------------------------------------------------
# The training step: gradient accumulation over micro-batches, one all-reduce, clipping, then the optimizers.


class StepResult(NamedTuple):
    loss: float  # the mean over the whole batch of every rank
    grad_norm: float  # before clipping
    finite: bool  # False for a non-finite loss or norm: no step; fp16's overflowed norm is True, its step skipped too


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
                _, loss = model(x, y)
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
# Evaluation: the validation loss, samples, HellaSwag and CORE (evaluation/).


@torch.no_grad()
def evaluate_val(model, val, B, T, device, autocast_ctx, rank, world_size):
    """Mean loss per token over the fixed validation set; rank r takes every world_size-th batch of B sequences. Every
    rank runs as many batches, the last ones empty: under FSDP each forward pass gathers weights from all ranks."""
    n_seq = (len(val) - 1) // T
    totals = torch.zeros(2, device=device)  # loss sum, token count
    for first in range(rank * B, math.ceil(n_seq / (world_size * B)) * world_size * B, world_size * B):
        rows = max(0, min(B, n_seq - first))
        buf = torch.from_numpy(val[first * T: (first + rows) * T + 1].astype(np.int64))
        x = torch.zeros(B, T, dtype=torch.long)  # a short last batch is padded, so shapes never change
        y = torch.full((B, T), -1, dtype=torch.long)
        x[:rows], y[:rows] = buf[:-1].view(rows, T), buf[1:].view(rows, T)
        with autocast_ctx:
            _, loss = model(x.to(device), y.to(device))
        if rows:  # an empty batch's loss is 0 / 0
            totals += torch.stack([loss.float() * rows * T, torch.tensor(float(rows * T), device=device)])
    if world_size > 1:
        dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


# Control characters a model samples (escape, carriage return, bell, backspace) would garble the terminal: each is
# shown as its Unicode symbol (␛, ␍, ␇, ␈) instead; line breaks and tabs stay
CONTROL_SYMBOLS = {c: 0x2400 + c for c in range(32) if chr(c) not in "\n\t"} | {0x7F: 0x2421}


def print_samples(model, cfg, enc, device, autocast_ctx, seed, step, rows, show=True):
    """Prints --num-samples continuations of --prompt as text, line breaks and all, each under a header line, sampling
    at most rows at a time (if show: the other ranks sample too, as under FSDP each lends its slices of the weights,
    but print nothing)."""
    prompt = enc.encode_ordinary(cfg.prompt) or [EOT]
    recipe = RECIPES[cfg.recipe].named or "GPT-2's recipe"
    can_sample, lines = run_log.sample_notes(model, prompt, recipe)  # and what to know of them, or why there are none
    if can_sample:
        generator = torch.Generator(device=device).manual_seed(seed)
        with autocast_ctx:  # rows at a time: a run's micro-batch, which fits in training, or --sample's --batch-size
            samples = [tokens for first in range(0, cfg.num_samples, rows) for tokens in
                       generate(model, prompt, min(rows, cfg.num_samples - first), cfg.max_new_tokens, generator)]
        for i, tokens in enumerate(samples):
            lines += [f"--- sample {i + 1}/{len(samples)} (step {step}) ---",
                      enc.decode(tokens).translate(CONTROL_SYMBOLS)]
        lines.append("--- end of samples ---")
    if show:
        print("\n".join(lines), flush=True)


def evaluate(run):
    """The evaluations due at run.step, logged, each once: the validation loss with samples, HellaSwag and CORE; no
    more once a stop signal is voted for, before or between forward passes (run.begin_evaluation, run.evaluating)."""
    cfg, env, step = run.cfg, run.env, run.step
    val_due, benchmarks_due = run.evaluations_due()
    if not run.begin_evaluation(val_due or bool(benchmarks_due)):
        return
    with run.evaluating():  # a stop signal ends them at the next forward pass: the resumed run does them
        if val_due:
            run.validated(evaluate_val(run.compiled, run.val, run.micro_batch, cfg.seq_len, env.device,
                                       run.autocast_ctx, env.rank, env.world_size))
            if cfg.num_samples > 0:  # eager, so that growing lengths never recompile
                print_samples(run.model, cfg, gpt2_tokenizer(), env.device, run.autocast_ctx, cfg.seed, step,
                              run.micro_batch, show=run.master)
        for benchmark in benchmarks_due:  # each at the micro-batch, on every rank
            run_log.log_evaluation(run, *benchmark.evaluate_run(run, run.benchmarks[benchmark]))


# -----------------------------------------------------------------------------
# The run: its settings resolved, then set up from them (Run), and restored from its checkpoint


def draft_config(flags, given, env):
    """The settings as the layers before the checkpoint's make them (resolution.draft_settings: the presets, the model
    preset, the device): they say where the run's log directory and checkpoint are."""
    return draft_settings(flags, given, env, RECIPES, MODEL_SIZES, PRESETS)


def final_config(draft, env, ckpt=None, ckpt_path=None):
    """The run's settings (resolution.final_settings: draft's, then what the checkpoint resumed keeps, all checked),
    frozen; rank 0 prints the lines that say which are not their defaults, and why."""
    resumed = None if ckpt is None else (ckpt["train_config"],
                                         asdict(saved_model_config(ckpt, GPTConfig, ckpt_path)), ckpt_path)
    checks = (core_score.check, fsdp.check_settings, speedups.check, run_log.check_settings)  # before anything is read
    cfg, lines = final_settings(draft, env, RECIPES, checks, resumed)
    if env.rank == 0 and lines:
        print("\n".join(lines))
    return cfg


def set_up(draft, env):
    """The run: its settings, the data, the model (random, OpenAI's, or its checkpoint's), compiled and wrapped, the
    optimizers, all restored from the run's checkpoint if it has one (in draft's log directory); None if that
    checkpoint is the run's end, evaluated."""
    ckpt, ckpt_path = resume.find_resume_checkpoint(draft, env.rank, env.world_size)
    cfg = final_config(draft, env, ckpt, ckpt_path)
    set_tf32(cfg.dtype != "fp32")
    stream, val = load_data(cfg)
    benchmarks = {module: module.load_run(cfg) for module in BENCHMARKS if getattr(cfg, module.EVERY)}
    model = make_model(cfg, env.device, pretrained=ckpt is None and cfg.init_from != "scratch")
    speedups.apply(cfg, model)  # each speed-up asked for: before the model compiles
    compiled = wrap_model(model, cfg, env)
    run = Run(cfg, env, RECIPES[cfg.recipe], stream, val, benchmarks, model, compiled,
              optimizers=make_optimizers(model, cfg, env.device_type),
              scaler=torch.amp.GradScaler(env.device_type, enabled=cfg.dtype == "fp16"),  # fp16 underflows
              autocast_ctx=autocast_context(env.device_type, cfg.dtype), log=run_log.RunLog(cfg.log_dir))
    if ckpt is not None:
        resume.restore(run, ckpt, ckpt_path)
        if resume.nothing_left(run):
            return None
    del ckpt  # its tensors are loaded: what it read is no longer held while the micro-batch is tried
    said = run.choose_micro_batch(gradient_sync)  # the micro-batch that fits, found before any file moves
    run.catch_stop_signals()  # from here on, a stop signal ends the run with a checkpoint
    log_directory.move_aside_for_run(run)  # an old run's files, or the checkpoints after the one resumed
    run_log.first_lines(run, said)  # what runs: the model, the data, the micro-batch
    run.start_training()  # the launch's first step, and its clock
    return run


# -----------------------------------------------------------------------------
# The training loop


def train(run):
    """The training loop, from run.step to --max-steps, evaluating as it goes and at the end. Around each step the
    run (Run) keeps itself safe: checkpoints, a stop on SIGTERM or Ctrl-C at the same step on every rank."""
    cfg = run.cfg
    evaluate(run)  # at the launch's first step: step 0's, or a resumed step's not yet done
    while run.before_step():  # False at --max-steps or once a stop signal is voted for; saves a checkpoint due
        batches = run.read_step()  # this rank's micro-batches; data one rank cannot read stops every rank here
        set_lr(run.optimizers, run.step, cfg)
        result = train_step(run.compiled, run.optimizers, run.scaler, batches, run.autocast_ctx, cfg.grad_clip)
        run.after_step(result)  # prints the log line, counts the step, votes on a stop signal, saves the end
        evaluate(run)  # those due at the step reached: all of them at --max-steps
    run.finish()  # saves the end evaluated, or where a signal stopped the run, and says how it ended


def start(flags, given):
    """Trains as the settings say (or with --eval-only, evaluates): in its process group, with its log directory held,
    the run set up, then trained to the end. The run lives in this frame alone, which is gone once main tears the
    process group down: a DDP model still alive then would keep gloo's threads running at exit, which can abort it."""
    env = set_up_distributed(flags.device, flags.fsdp)
    with ranks.failing_together():  # a node whose files refuse the settings stops every rank, not itself alone
        draft = draft_config(flags, given, env)  # where the run is: its log directory and checkpoint
    with log_directory.locked(draft, env):
        run = set_up(draft, env)
        if run is not None:
            with run_log.wandb(run), run.errors_in_one_line():  # W&B's run, if there is one
                evaluate(run) if run.cfg.eval_only else train(run)


def main(argv=None):
    """Trains (or evaluates) as the settings say, or runs a command of checkpoint_commands.py. A UsageError ends the
    process with its one line on stderr and exit code 2, never a traceback, once the process group is torn down."""
    cfg, given = parse_args(argv)
    signal_handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    error = None
    try:
        check_paths(cfg, given, MODEL_SIZES)
        with microbatch.out_of_memory_in_one_line(cfg):
            if cfg.export_hf:
                checkpoint_commands.export_hf(cfg, argv or sys.argv[1:], RECIPES, BENCHMARKS, model_of,
                                              GPT.from_pretrained)
            elif cfg.sample:
                env = set_up_distributed(cfg.device)
                checkpoint_commands.sample(cfg, given, env, model_of, autocast_context, print_samples)
            else:
                start(cfg, given)
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
