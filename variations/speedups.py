"""
Speed-ups past the lecture's, for train_gpt2.py, each behind a setting that is off by default until a GPU call ranks it
against the trainer's defaults (benchmarks/speed_ladder.py --rungs, benchmarks/gpu_check.py): a winner becomes a
default, a loser is removed. train_gpt2.TrainConfig inherits Settings, so each is a flag; resolution.final_settings
refuses in one line one that cannot run here (check), and set_up switches on the rest for the run's process (apply).

- --coordinate-descent: inductor tunes each kernel's launch settings (longer compiles); not yet ranked
- --fp8-head: the output layer's matmul, the model's largest, in float8 with a scale per row; its backward in bf16.
  3.0% faster on an H100 (2026-11-28), held off until its CUDA test passes there (README, Speed)

The ranked winners are the trainer's own defaults now: --loss chunked on CUDA (losses.py) and the micro-batch
search going up as well as down on CUDA (--grow-batch-size, microbatch.py).
"""

from dataclasses import dataclass

import torch
import torch.nn as nn

from machinery.errors import UsageError
from machinery.settings import setting

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448: float8 e4m3's largest finite value
FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 matmuls


@dataclass(frozen=True)
class Settings:
    """The speed-ups' settings, each off by default: train_gpt2.py's TrainConfig inherits them."""
    coordinate_descent: bool = setting(False, "inductor tunes each kernel's launch settings by coordinate descent "
                                       "(longer compiles)", memory=True)
    fp8_head: bool = setting(False, "the output layer's matmul in float8 with a scale per row, its backward in bf16 "
                             "(CUDA, compute capability 8.9 or later)", memory=True, full_loss=True)


def check(cfg, env):
    """Refuses, in one line naming the flag, a speed-up that cannot run on the run's device (env.device)."""
    if cfg.coordinate_descent and not cfg.compile:
        raise UsageError("--coordinate-descent is an option of torch.compile, which is off (its default without CUDA); "
                         "pass --compile, or drop it")
    if cfg.fp8_head:
        check_fp8_head(cfg, torch.device(env.device))


def check_fp8_head(cfg, device):
    """Refuses --fp8-head where torch._scaled_mm's float8 matmul or its bf16 backward cannot run."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is None or capability < FP8_CAPABILITY:
        where = f"this run is on {device.type}" if capability is None else "this GPU's is {}.{}".format(*capability)
        raise UsageError(f"--fp8-head needs a CUDA GPU of compute capability 8.9 or later (Ada, Hopper), and {where}; "
                         f"drop it")
    if cfg.dtype != "bf16":
        raise UsageError(f"--fp8-head computes its backward in bf16, and this run is --dtype {cfg.dtype}; pass "
                         f"--dtype bf16, or drop it")
    if cfg.loss == "chunked":
        raise UsageError("--fp8-head is the output layer's matmul, which --loss chunked computes in its own chunks; "
                         "drop one of them")
    if cfg.vocab_size % 16 or cfg.n_embd % 16:
        raise UsageError(f"--fp8-head's float8 matmul needs --vocab-size and --n-embd multiples of 16, not "
                         f"{cfg.vocab_size} and {cfg.n_embd}; pad them, or drop it")


def apply(cfg, model):
    """Switches the speed-ups asked for on, in this process and on the model (its output layer in float8 with
    --fp8-head); final_settings refused those that cannot run here, before anything was read."""
    if cfg.coordinate_descent:
        from torch._inductor import config  # here: importing the compiler's configs takes a second or more

        config.coordinate_descent_tuning = True
    if cfg.fp8_head:
        model.lm_head = Float8Head.sharing(model.lm_head)


# -----------------------------------------------------------------------------
# --fp8-head


def to_float8(t):
    """t (rows, k) in float8 e4m3, each row scaled so that its largest magnitude is the format's largest, and the
    float32 scales (rows, 1) that undo it."""
    scale = t.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX  # an all-zero row stays zero
    return (t / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


class Float8Matmul(torch.autograd.Function):
    """x (N, k) @ weight.T (k, V), both in float8 (to_float8) and the result in bf16; the backward's matmuls in bf16,
    as autocast's are."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.dtypes = x.dtype, weight.dtype
        ctx.save_for_backward(x.to(torch.bfloat16), weight.to(torch.bfloat16))
        (x8, x_scale), (w8, w_scale) = to_float8(x), to_float8(weight)
        return torch._scaled_mm(x8, w8.T, scale_a=x_scale, scale_b=w_scale.T, out_dtype=torch.bfloat16)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.to(torch.bfloat16)
        return (grad @ weight).to(ctx.dtypes[0]), (grad.T @ x).to(ctx.dtypes[1])


class Float8Head(nn.Linear):
    """The output layer, its matmul in float8 in training (Float8Matmul); without gradients (evaluation, samples),
    nn.Linear's, in bf16 under autocast."""

    @classmethod
    def sharing(cls, head):
        """A Float8Head with head's weight, the same parameter (GPT-2 ties it to the embedding)."""
        fp8_head = cls(head.in_features, head.out_features, bias=False, device="meta")
        fp8_head.weight = head.weight
        return fp8_head

    def forward(self, x):
        if not torch.is_grad_enabled():
            return super().forward(x)
        return Float8Matmul.apply(x.flatten(0, -2), self.weight).unflatten(0, x.shape[:-1])
