"""speedups.py on the CPU: what each speed-up computes against an independent reference, that each is refused in one
line where it cannot run, before anything is read; the defaults the GPU's ranking chose (the chunked loss and the
micro-batch search going up, on CUDA), and that search's losses. What needs a GPU (float8 under inductor, the chunked
loss's memory) is in tests/test_cuda.py."""
import pytest
import torch
import torch._inductor.config

import train_gpt2
from helpers import (
    TINY,
    expect_usage_error,
    random_ids,
    read_log,
    resolved,
    run_main,
    tiny_gpt,
    train_records,
    val_records,
)
from machinery import microbatch
from train_gpt2 import TrainConfig
from variations import speedups
from variations.speedups import E4M3_MAX, Float8Head, Float8Matmul, to_float8

CPU = train_gpt2.Env(rank=0, local_rank=0, world_size=1, device="cpu", device_type="cpu")
CUDA = train_gpt2.Env(rank=0, local_rank=0, world_size=1, device="cuda", device_type="cuda")


@pytest.mark.parametrize("flags, fragments", [
    (["--fp8-head"], ["--fp8-head needs a CUDA GPU of compute capability 8.9 or later", "on cpu"]),
    (["--coordinate-descent"], ["--coordinate-descent is an option of torch.compile", "pass --compile"]),
    (["--grow-batch-size", "--no-fit-batch-size"], ["--grow-batch-size", "--no-fit-batch-size", "drop one"]),
])
def test_a_speed_up_that_cannot_run_here_is_refused_in_one_line(shards, tmp_path, capsys, flags, fragments):
    expect_usage_error(TINY + ["--data", shards, "--log-dir", tmp_path / "log", *flags], capsys, *fragments)


def test_a_speed_up_is_refused_before_anything_is_read(tmp_path, capsys):
    """The refusal comes from the settings, before the data, the benchmarks' files or any weights are read: here a
    HellaSwag file that is not there would be the first error met."""
    expect_usage_error(TINY + ["--data", tmp_path / "no_shards", "--log-dir", tmp_path / "log", "--fp8-head",
                               "--vocab-size", 50304, "--hellaswag-every", 1, "--hellaswag-file",
                               tmp_path / "missing.jsonl"], capsys, "--fp8-head needs a CUDA GPU")


def test_the_fp8_head_is_refused_where_its_matmul_cannot_run(monkeypatch):
    """On a GPU below compute capability 8.9, or with what its float8 matmul or bf16 backward cannot take."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(train_gpt2.UsageError, match=r"compute capability 8.9 or later .* this GPU's is 8.0; drop it"):
        speedups.check(TrainConfig(fp8_head=True, dtype="bf16"), CUDA)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for config, words in ((dict(dtype="fp16"), "--dtype fp16"), (dict(dtype="bf16", loss="chunked"), "--loss chunked"),
                          (dict(dtype="bf16", vocab_size=50257, n_embd=768), "not 50257 and 768")):
        with pytest.raises(train_gpt2.UsageError, match=words):
            speedups.check(TrainConfig(fp8_head=True, **config), CUDA)
    speedups.check(TrainConfig(fp8_head=True, dtype="bf16", n_embd=768), CUDA)  # an H100's default run


@torch._inductor.config.patch(coordinate_descent_tuning=False)  # and back to torch's own after
def test_apply_switches_on_what_is_asked_for_and_nothing_else():
    """The compile option is this process's: switched on only when asked for."""
    model = tiny_gpt()
    head = model.lm_head
    speedups.apply(TrainConfig(), model)
    assert not torch._inductor.config.coordinate_descent_tuning
    assert model.lm_head is head
    speedups.apply(TrainConfig(compile=True, coordinate_descent=True), model)
    assert torch._inductor.config.coordinate_descent_tuning


# -----------------------------------------------------------------------------
# The defaults the GPU's ranking chose: on CUDA alone


@pytest.mark.parametrize("flags, loss, grow", [
    ([], "chunked", True),  # an H100: as fast, 15% less memory; 2% faster
    (["--dtype", "fp16"], "full", True),  # the chunks' gradients would exist before fp16's loss scaling
    (["--fp8-head"], "full", True),  # the float8 head is the full loss's matmul
    (["--no-fit-batch-size"], "chunked", False),  # the micro-batch as given: no search, up or down
    (["--loss", "full", "--no-grow-batch-size"], "full", False),
])
def test_cuda_defaults_to_the_chunked_loss_and_a_growing_micro_batch(tmp_path, monkeypatch, flags, loss, grow):
    """As an H100 resolves them (bf16, compute capability 9.0): the flags, or what can run with them, win."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    cfg = resolved(["--data", tmp_path, *flags], CUDA)
    assert (cfg.loss, cfg.grow_batch_size) == (loss, grow)


@pytest.mark.parametrize("capability", [(7, 0), (7, 5)], ids=["V100", "T4"])
def test_a_card_without_bf16_defaults_to_fp16_and_the_full_loss(tmp_path, monkeypatch, capability):
    """A V100 or a T4 has no bf16: the default run takes fp16, and so the full loss. The loss decided by the flag's
    dtype (auto) rather than the one resolved made it the chunked one, and a V100's default run was refused by its own
    defaults ("--loss chunked cannot run with --dtype fp16")."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    cfg = resolved(["--data", tmp_path], CUDA)
    assert (cfg.dtype, cfg.loss, cfg.grow_batch_size) == ("fp16", "full", True)


def test_elsewhere_the_full_loss_and_the_micro_batch_as_given(tmp_path):
    """A CPU runs the chunked loss at half the full one's speed (the quick start's step)."""
    cfg = resolved(["--data", tmp_path], CPU)
    assert (cfg.loss, cfg.grow_batch_size) == ("full", False)


# -----------------------------------------------------------------------------
# --fp8-head: torch._scaled_mm runs float8 on the CPU too


def test_to_float8_scales_each_row_to_the_formats_largest_value():
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(0)) * torch.tensor([1e-3, 1, 30, 1e3, 1, 0])[:, None]
    x8, scale = to_float8(x)
    assert x8.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    assert x8.float().abs().amax(dim=1).tolist() == [E4M3_MAX] * 5 + [0]  # each row's largest, and a row of zeros
    # e4m3 keeps 3 bits of mantissa: half a unit in the last place is 2**-4 of a value, in its normal range (2**-6 up)
    normal = x8.float().abs() >= 2**-6
    error = (x8.float() * scale - x).abs()
    assert torch.all(error[normal] <= 2**-4 * x.abs()[normal] * (1 + 1e-6))


def test_the_float8_matmul_is_its_emulation_and_its_backward_bf16s():
    """Forward: the float8 operands (to_float8) dequantized and multiplied in float64, rounded to bf16 once. Backward:
    the bf16 matmuls of autocast, exactly. (torch._scaled_mm sums in float32: a product can round to the bf16 next to
    the float64 one.)"""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(40, 64, generator=g) * torch.logspace(-2, 2, 40)[:, None]).requires_grad_()  # rows of any scale
    w = torch.randn(96, 64, generator=g) * 0.1
    w[5] = 0  # an all-zero row, as the modern recipe's head starts
    w.requires_grad_()
    (x8, x_scale), (w8, w_scale) = to_float8(x.detach()), to_float8(w.detach())
    emulated = ((x8.double() * x_scale.double()) @ (w8.double() * w_scale.double()).T).to(torch.bfloat16)
    out = Float8Matmul.apply(x, w)
    assert out.dtype == torch.bfloat16
    atol = 1e-5 * emulated.abs().max().item()  # float32's summation error, where a sum nearly cancels
    torch.testing.assert_close(out.float(), emulated.float(), rtol=2**-7, atol=atol)  # one bf16 rounding apart
    exact = x.detach().double() @ w.detach().double().T
    relative = ((out.double() - exact).norm() / exact.norm()).item()
    assert 1e-3 < relative < 0.05, relative  # float8, and close
    grad = torch.randn(40, 96, generator=g)
    out.backward(grad)
    assert x.grad.dtype == w.grad.dtype == torch.float32
    assert torch.equal(x.grad, (grad.bfloat16() @ w.detach().bfloat16()).float())
    assert torch.equal(w.grad, (grad.bfloat16().T @ x.detach().bfloat16()).float())


def test_the_float8_head_shares_the_tied_weight_and_leaves_evaluation_in_bf16():
    model = tiny_gpt(n_embd=64)
    with torch.no_grad():
        want_logits, _ = model(random_ids(2, 32))
    idx, targets = random_ids(2, 32), random_ids(2, 32, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, want_loss = model(idx, targets)
    keys = list(model.state_dict())
    model.lm_head = Float8Head.sharing(model.lm_head)
    assert model.lm_head.weight is model.transformer.wte.weight and list(model.state_dict()) == keys
    with torch.no_grad():
        assert torch.equal(model(random_ids(2, 32))[0], want_logits)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx, targets)
    loss.backward()
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-2) and loss.item() != want_loss.item()
    assert model.lm_head.weight.grad is not None


# -----------------------------------------------------------------------------
# --grow-batch-size


def test_next_larger_cuts_the_step_exactly():
    assert microbatch.next_larger(64, 128) == 128
    assert microbatch.next_larger(64, 64) is None
    assert microbatch.next_larger(4, 24) == 8
    assert microbatch.next_larger(5, 30) == 10
    assert microbatch.next_larger(4, 12) == 12  # not 8: 12 sequences are no whole number of micro-batches of 8


def test_the_micro_batch_grows_where_a_step_fits_to_the_same_losses(shards, tmp_path, capsys, monkeypatch):
    """TINY's step is 8 sequences, --batch-size 4 x 2 accumulation steps; with --grow-batch-size the search tries 8,
    which fits on a CPU, and trains 8 x 1: the same tokens a step, so the same losses to rounding. Never up to a
    micro-batch that ran out of memory after it was chosen (out_of_memory.json's)."""
    args = TINY + ["--data", shards, "--max-steps", "2", "--warmup-steps", "1"]
    code, out, err = run_main(args + ["--log-dir", tmp_path / "given"], capsys)
    assert code == 0, err
    code, out, err = run_main(args + ["--log-dir", tmp_path / "grown", "--grow-batch-size"], capsys)
    assert code == 0, err
    assert "micro-batch 8, up from 4 (--grow-batch-size): a step of it fits; found in " in out
    assert "batch 256 tokens = 8 x 32 x 1 accumulation steps" in out.replace(",", "")
    given, grown = read_log(tmp_path / "given"), read_log(tmp_path / "grown")
    assert [r["micro_batch"] for r in given + grown if "event" in r] == [4, 8]
    assert {step: r["train_loss"] for step, r in train_records(grown).items()} == \
        pytest.approx({step: r["train_loss"] for step, r in train_records(given).items()}, rel=1e-5)
    assert val_records(grown)[2]["val_loss"] == pytest.approx(val_records(given)[2]["val_loss"], rel=1e-5)
    monkeypatch.setattr(microbatch, "recorded_on_this_rank", lambda run: {"micro_batch": 8})
    code, out, err = run_main(args + ["--log-dir", tmp_path / "recorded", "--grow-batch-size"], capsys)
    assert code == 0, err
    assert [r["micro_batch"] for r in read_log(tmp_path / "recorded") if "event" in r] == [4]

