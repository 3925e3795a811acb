"""
Cross-entropies with gradients of their own, for GPT-2's model in train_gpt2.py and the modern recipe's in modern.py.

--loss chunked: the output layer's matmul and the cross-entropy a chunk of rows at a time.

The full loss forms all (B*T, V) logits, and keeps them for the backward pass: at micro-batch 64 x 1024 and GPT-2's
50304-wide vocabulary, 13 GB of float32 logits, and their gradient as much again. Here only (chunk, V) tensors ever
exist. Each chunk's gradients are computed in the forward pass, while its logits exist; backward only scales them by
the loss's own gradient. That is also why it cannot run with --dtype fp16: its gradients exist before the gradient
scaler scales the loss.

The full loss, compiled (cross_entropy_with_pointwise_backward): F.cross_entropy's backward is a reduction over each
row (the log-softmax's), which inductor fuses with the gradient it writes, so the gradient gets a (B*T, V) buffer of
its own beside the saved logits: 6 GiB more at micro-batch 64. Here the forward keeps each row's log-sum-exp, so the
backward is pointwise, and inductor writes the gradient over the logits it no longer needs.
"""

import torch


def soft_cap(logits, cap):
    """cap * tanh(logits / cap): logits near 0 pass unchanged, large ones level off below cap (the modern recipe)."""
    return cap * torch.tanh(logits / cap)


class ChunkedCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of the logits x @ weight.T (soft-capped, if cap) + mask over the targets that are not
    -1, a chunk of rows at a time."""

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
                logits = soft_cap(logits, cap)
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


class CrossEntropyWithPointwiseBackward(torch.autograd.Function):
    """F.cross_entropy(logits, targets, ignore_index=-1), the log-sum-exp of each row kept for a pointwise backward."""

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
    return torch.nn.functional.cross_entropy(logits, targets, ignore_index=-1)
