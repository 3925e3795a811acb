"""On a CUDA GPU only, skipped elsewhere: the trainer's default step (inductor, bf16 autocast, fused AdamW) on a tiny
model, both losses compiled by inductor against float64, the chunked loss's memory, the FP8 head of speedups.py
under inductor, and benchmarks/profile_step.py's summary against its table. The rest of the suite pins the CPU."""
import copy
import math

import pytest
import torch

import train_gpt2
from helpers import chunked_case, float64_loss_and_grads, reference, tiny_gpt, with_loud_padding
from machinery.tokenizer import GPT2_VOCAB
from train_gpt2 import TrainConfig, cross_entropy
from variations import speedups
from variations.losses import chunked_cross_entropy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def tiny(loss="full"):
    return tiny_gpt(block_size=64, loss=loss).cuda()


def batch(B=4, T=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, GPT2_VOCAB, (B, T), generator=g), torch.randint(0, GPT2_VOCAB, (B, T), generator=g)
    y[1, 40:] = -1
    return x, y


@pytest.fixture(autouse=True)
def fresh_compiler():
    torch._dynamo.reset()
    yield
    train_gpt2.set_tf32(False)


@pytest.mark.parametrize("loss_impl", ["full", "chunked"])
def test_compiled_bf16_training_step(loss_impl):
    """train_step as train() runs it with the CUDA defaults (and --loss chunked): the loss at init is ln(50257), as
    the float32 eager model computes it to bf16's precision, and three steps on one batch lower it."""
    cfg = TrainConfig(compile=True, dtype="bf16", loss=loss_impl, max_lr=1e-3, warmup_steps=0)
    train_gpt2.set_tf32(True)
    model = with_loud_padding(tiny(loss_impl))
    x, y = batch()  # on the CPU: train_step pins and copies them, as in training
    with torch.no_grad():
        want = copy.deepcopy(model)(x.cuda(), y.cuda())[1].item()
    optimizers = train_gpt2.make_optimizers(model, cfg, "cuda")
    assert all(optimizer.defaults["fused"] for optimizer in optimizers)
    train_gpt2.set_lr(optimizers, 0, cfg)  # no warmup: the peak, 1e-3, for every step
    compiled = train_gpt2.compile_model(model, cfg)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    autocast_ctx = train_gpt2.autocast_context("cuda", cfg.dtype)
    losses = [train_gpt2.train_step(compiled, optimizers, scaler, [(x, y)], autocast_ctx, 1.0).loss for _ in range(3)]
    assert losses[0] == pytest.approx(want, rel=1e-2)
    assert abs(losses[0] - math.log(GPT2_VOCAB)) < 0.1, losses
    assert losses[2] < losses[0] - 0.01, losses
    assert torch.all(model.lm_head.weight.grad[GPT2_VOCAB:] == 0)


@pytest.mark.parametrize("loss_impl", ["full", "chunked"])
def test_loss_compiled_by_inductor_matches_float64(loss_impl):
    """In float32 (TF32 off), the compiled loss and every gradient against a float64 cross-entropy over the 50257
    real ids, computed on a float64 copy of the model."""
    train_gpt2.set_tf32(False)
    model = with_loud_padding(tiny(loss_impl))
    reference_model = copy.deepcopy(model).double()
    x, y = (t.cuda() for t in batch())
    want = reference(reference_model, x, y)
    want.backward()
    _, loss = torch.compile(model, dynamic=False)(x, y)
    loss.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference_model.parameters()):
        torch.testing.assert_close(p.grad.double(), q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_chunked_cross_entropy_on_cuda():
    x, w, targets, mask = (t.cuda() for t in chunked_case(N=300, C=64, V=1024))
    want_loss, want_dx, want_dw = float64_loss_and_grads(x, w, targets, mask)
    for autocast, tolerance in ((False, 1e-5), (True, 2e-2)):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = chunked_cross_entropy(xi, wi, targets, mask, chunk_rows=128)
        loss.backward()
        assert abs(loss.item() - want_loss.item()) < tolerance * want_loss.item()
        assert (xi.grad.double() - want_dx).norm() < tolerance * want_dx.norm()
        assert (wi.grad.double() - want_dw).norm() < tolerance * want_dw.norm()


# -----------------------------------------------------------------------------
# The speed-ups of speedups.py and the chunked loss, under inductor (benchmarks/speed_ladder.py measures their speed)


def test_the_compiled_chunked_loss_holds_one_chunk_of_logits_at_a_time():
    """Compiled by inductor, at 16384 rows of GPT-2's padded vocabulary in chunks of 1024: the full loss's peak is
    at least its bf16 logits (1.5 GiB); the chunked loss's, under half of them. The same loss to rounding."""
    x, targets = torch.randn(16384, 64, device="cuda"), torch.randint(0, GPT2_VOCAB, (16384,), device="cuda")
    w = 0.02 * torch.randn(50304, 64, device="cuda")
    mask = torch.zeros(50304, device="cuda")
    mask[GPT2_VOCAB:] = float("-inf")
    losses = {"full": lambda x, w: cross_entropy(x @ w.T + mask.to(torch.bfloat16), targets),
              "chunked": lambda x, w: chunked_cross_entropy(x, w, targets, mask, chunk_rows=1024)}
    peaks, values = {}, {}
    for name, loss_of in losses.items():
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        compiled = torch.compile(loss_of, dynamic=False)
        for _ in range(3):  # the first two compile (the chunks' graphs, for each dispatch state of the op)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = compiled(xi, wi)
            loss.backward()
            torch.cuda.synchronize()
            peaks[name], values[name] = torch.cuda.max_memory_allocated() - before, loss.item()
            xi.grad = wi.grad = None
    logits_bytes = 16384 * 50304 * 2
    assert peaks["full"] >= logits_bytes and peaks["chunked"] < 0.5 * logits_bytes, peaks
    assert values["chunked"] == pytest.approx(values["full"], rel=1e-3)


def compiled_bf16_loss_and_grads(model, x, y):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = torch.compile(model, dynamic=False)(x, y)
    loss.backward()
    return loss.item(), [p.grad.float() for p in model.parameters()]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < speedups.FP8_CAPABILITY,
                    reason="needs a GPU of compute capability 8.9 or later")
def test_the_fp8_head_under_inductor():
    """Float8Matmul compiled: its float64 emulation to one bf16 rounding; a compiled bf16 step with --fp8-head: the
    bf16 head's loss and gradients to float8's precision."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(256, 64, generator=g).cuda(), (0.1 * torch.randn(512, 64, generator=g)).cuda()
    (a8, a_scale), (b8, b_scale) = speedups.to_float8(a), speedups.to_float8(b)
    a64, b64 = a8.double() * a_scale.double(), b8.double() * b_scale.double()
    emulated = (a64 @ b64.T).to(torch.bfloat16).double()
    out = torch.compile(lambda a, b: speedups.Float8Matmul.apply(a, b))(a, b).double()
    # Hopper's float8 matmuls add in fewer bits than float32 (about 14), so a sum that nearly cancels keeps an error
    # of about 2**-13 of its terms' magnitudes: 4.9e-4 here on an H100 (2026-11-28), where float32's is 1e-7
    magnitudes = a64.abs() @ b64.abs().T
    assert torch.all((out - emulated).abs() <= 2**-7 * emulated.abs() + 2**-11 * magnitudes)
    x, y = (t.cuda() for t in batch())
    want_loss, want_grads = compiled_bf16_loss_and_grads(tiny(), x, y)
    torch._dynamo.reset()
    model = tiny()
    speedups.apply(TrainConfig(fp8_head=True, dtype="bf16", n_embd=64, compile=True), model)
    assert isinstance(model.lm_head, speedups.Float8Head)
    loss, grads = compiled_bf16_loss_and_grads(model, x, y)
    assert loss == pytest.approx(want_loss, rel=1e-2) and loss != want_loss
    for grad, want in zip(grads, want_grads):
        assert (grad - want).norm() <= 0.1 * want.norm() + 1e-6


def test_the_profiles_summary_is_the_tables_cuda_total(tmp_path):
    """benchmarks/profile_step.py on the GPU: its summary's time a step, summed over the kernels alone, is the table's
    own "Self CUDA time total" over the steps profiled (each kernel counted once, not with its CPU operation too)."""
    import re
    import subprocess
    import sys

    from helpers import REPO

    result = subprocess.run([sys.executable, f"{REPO}/benchmarks/profile_step.py", "--n-layer", "2", "--n-head", "2",
                             "--n-embd", "64", "--batch-size", "4", "--seq-len", "64", "--block-size", "64",
                             "--warmup", "2", "--steps", "2", "--top", "5"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    total = re.search(r"Self CUDA time total: ([\d.]+)(ms|us|s)", result.stdout)
    table_ms = float(total.group(1)) * {"s": 1000, "ms": 1, "us": 1e-3}[total.group(2)] / 2
    summary_ms = float(re.search(r"^gpt2: ([\d.]+) ms a step; ", result.stdout, re.M).group(1))
    assert summary_ms == pytest.approx(table_ms, rel=0.02, abs=0.06), result.stdout[-2000:]
