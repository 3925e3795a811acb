"""
The cross-entropy of --loss chunked, for GPT-2's model in train_gpt2.py and the modern recipe's in modern.py, and the
modern recipe's soft-cap (GPT-2's full loss is train_gpt2.py's own).

--loss chunked: the output layer's matmul and the cross-entropy a chunk of rows at a time, so that no (B*T, V) tensor
ever exists: at micro-batch 64 x 1024 and GPT-2's 50304-wide vocabulary, the full loss holds 6.1 GiB of bf16 logits
for its backward. Each chunk's gradients are computed in the forward pass, while its logits exist; backward only
scales them by the loss's own gradient. That is also why it cannot run with --dtype fp16: its gradients exist before
the gradient scaler scales the loss.

The chunks run inside a custom op (chunked_sums), which torch.compile calls as one opaque kernel; when the model is
compiled, each chunk is compiled on its own. A loop that the compiler traces is unrolled into the model's graph, and
inductor, free to order and fuse the chunks' independent kernels, ran every chunk's matmul first and all their
softmaxes in one fused kernel: every chunk's logits and gradient were alive at once (39.7 GiB at micro-batch 64 on an
H100, against the full loss's 28.95; docs/LOG.md, 2026-11-27, has the evidence).
"""

import math
from typing import Optional

import torch

CHUNK_ROWS = 8192  # 8192 rows of 50304 bf16 logits are 0.77 GiB; the matmuls of 8192 rows still fill a GPU


def soft_cap(logits, cap):
    """cap * tanh(logits / cap): logits near 0 pass unchanged, large ones level off below cap (the modern recipe)."""
    return cap * torch.tanh(logits / cap)


def chunk_sums(x, weight, targets, mask, cap, need_grads):
    """One chunk of rows: the cross-entropy of the logits x @ weight.T (soft-capped, if cap) + mask summed over the
    targets that are not -1, and if need_grads, that sum's gradients for x (n, C) and weight (V, C), in their dtype."""
    logits = (x @ weight.T).float()  # (n, V)
    capped = logits = soft_cap(logits, cap) if cap else logits
    if mask is not None:
        logits = logits + mask
    lse = logits.logsumexp(dim=-1)  # (n,)
    valid = targets != -1  # (n,)
    safe_targets = targets.clamp(min=0)  # -1 would index out of range; those rows count for nothing anyway
    loss = ((lse - logits.gather(1, safe_targets[:, None]).squeeze(1)) * valid).sum()
    if not need_grads:
        return loss, None, None
    # d loss_i / d logits_i = softmax_i - one_hot(target_i), zero for the rows left out; pointwise, so compile fuses it
    is_target = torch.arange(logits.size(1), device=x.device) == safe_targets[:, None]  # (n, V)
    grad = (logits - lse[:, None]).exp() - is_target.float()
    if cap:
        grad = grad * (1 - (capped / cap).square())  # d soft_cap(z) / dz = 1 - tanh(z / cap)**2
    grad = (grad * valid[:, None]).to(x.dtype)
    return loss, grad @ weight, grad.T @ x


@torch.library.custom_op("train_gpt2::chunked_sums", mutates_args=())
def chunked_sums(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, mask: Optional[torch.Tensor],
                 cap: Optional[float], chunk_rows: int, need_grads: bool,
                 compiled: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """chunk_sums over all rows, a chunk at a time: the summed loss and, if need_grads, its gradients for x (in x's
    dtype) and weight (float32 sums of the chunks'), else two empty tensors. compiled: each chunk torch.compiled."""
    step = torch.compile(chunk_sums, dynamic=False) if compiled else chunk_sums  # looked up now: tests swap it
    n_chunks = math.ceil(x.size(0) / chunk_rows)
    rows = math.ceil(x.size(0) / n_chunks)  # as even as they go: at most two shapes to compile
    loss_sum = torch.zeros((), device=x.device)
    grad_x = torch.empty_like(x) if need_grads else x.new_empty(0)
    grad_w = torch.zeros(weight.shape, device=x.device) if need_grads else x.new_empty(0)
    with torch.autocast(x.device.type, enabled=False):  # the caller chose the matmuls' dtype: x's and weight's
        for start in range(0, x.size(0), rows):
            loss, chunk_grad_x, chunk_grad_w = step(x[start:start + rows], weight, targets[start:start + rows], mask,
                                                    cap, need_grads)
            loss_sum += loss
            if need_grads:
                grad_x[start:start + rows] = chunk_grad_x
                grad_w += chunk_grad_w
    return loss_sum, grad_x, grad_w


@chunked_sums.register_fake
def _(x, weight, targets, mask, cap, chunk_rows, need_grads, compiled):
    loss_sum = x.new_empty((), dtype=torch.float32)
    if not need_grads:
        return loss_sum, x.new_empty(0), x.new_empty(0)
    return loss_sum, torch.empty_like(x), weight.new_empty(weight.shape, dtype=torch.float32)


class ChunkedCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of the logits x @ weight.T (soft-capped, if cap) + mask over the targets that are not
    -1, a chunk of rows at a time (chunked_sums)."""

    @staticmethod
    def forward(ctx, x, weight, targets, mask, cap, dtype, chunk_rows, need_grads):
        ctx.dtypes = x.dtype, weight.dtype
        # the matmuls in the autocast dtype, as lm_head's are
        loss_sum, grad_x, grad_w = chunked_sums(x.to(dtype), weight.to(dtype), targets, mask, cap, chunk_rows,
                                                need_grads, torch.compiler.is_compiling())
        n_valid = (targets != -1).sum()
        ctx.save_for_backward(grad_x, grad_w, n_valid)
        return loss_sum / n_valid

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w, n_valid = ctx.saved_tensors
        scale = grad_loss / n_valid
        return (grad_x * scale).to(ctx.dtypes[0]), (grad_w * scale).to(ctx.dtypes[1]), *[None] * 6


def chunked_cross_entropy(x, weight, targets, mask=None, cap=None, chunk_rows=CHUNK_ROWS):
    """F.cross_entropy(soft_cap(x @ weight.T) + mask, targets, ignore_index=-1) with no (N, V) tensor: chunk_rows rows
    of logits at a time."""
    device_type = x.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    need_grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)  # evaluation needs none
    return ChunkedCrossEntropy.apply(x, weight, targets, mask, cap, dtype, chunk_rows, need_grads)
