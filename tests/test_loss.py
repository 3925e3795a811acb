"""The loss: the padding ids of a 50304-row vocabulary kept out of the softmax by an additive mask, and the chunked
linear + cross-entropy (--loss chunked), each against a float64 cross-entropy over GPT-2's 50257 real ids."""
import contextlib
import dataclasses
import math
import os

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import train_gpt2
from evaluation import hellaswag
from helpers import (
    REPO,
    chunked_case,
    float64_loss_and_grads,
    last_json,
    random_ids,
    reference,
    run_script,
    tiny_gpt,
    with_loud_padding,
)
from machinery.tokenizer import GPT2_VOCAB
from train_gpt2 import CrossEntropyWithPointwiseBackward
from variations import losses
from variations.losses import ChunkedCrossEntropy, chunked_cross_entropy

LOSSES = ["full", "chunked"]


@pytest.mark.parametrize("loss_impl", LOSSES)
def test_padding_ids_are_out_of_the_loss(loss_impl):
    model = with_loud_padding(tiny_gpt(loss=loss_impl))
    idx, targets = random_ids(2, 32), random_ids(2, 32, seed=2)
    targets[1, 20:] = -1  # left out of the mean
    (logits, _), (_, loss) = model(idx), model(idx, targets)
    assert loss.item() == pytest.approx(reference(model, idx, targets).item(), rel=1e-6)
    assert logits.shape == (2, 32, 50304)
    probs = logits.softmax(-1)
    assert torch.all(probs[..., GPT2_VOCAB:] == 0) and probs[..., :GPT2_VOCAB].sum(-1).sub(1).abs().max() < 1e-5
    loss.backward()
    grad = model.lm_head.weight.grad
    assert torch.all(grad[GPT2_VOCAB:] == 0)  # padding ids never appear as inputs, and the loss gives them no gradient
    assert grad[:GPT2_VOCAB].abs().sum() > 0


def test_the_mask_keeps_bf16_logits_in_bf16():
    """Under bf16 autocast lm_head gives bf16 logits; adding the float32 mask as it is would promote them to a float32
    (B, T, V) copy, the memory the mask is there to save. The padding ids still get no probability, and the loss stays
    within bf16's rounding of the float64 one."""
    model = with_loud_padding(tiny_gpt())
    idx, targets = random_ids(2, 32), random_ids(2, 32, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (logits, _), (_, loss) = model(idx), model(idx, targets)
    assert logits.dtype == torch.bfloat16
    assert torch.all(logits[..., GPT2_VOCAB:] == float("-inf")) and torch.isfinite(logits[..., :GPT2_VOCAB]).all()
    assert loss.item() == pytest.approx(reference(model, idx, targets).item(), rel=1e-2)


def test_uniform_logits_give_the_log_of_the_real_vocab():
    """Every logit equal (a zero lm_head): the uniform distribution over the 50257 real ids, ln(50257) = 10.8249, not
    ln(50304) = 10.8260 as with the padding in the softmax. At init the loss is near both (within ~0.05)."""
    model = tiny_gpt()
    idx, targets = random_ids(4, 32), random_ids(4, 32, seed=3)
    assert abs(model(idx, targets)[1].item() - math.log(GPT2_VOCAB)) < 0.05
    with torch.no_grad():
        model.lm_head.weight.zero_()
    for loss_impl in LOSSES:
        model.config = dataclasses.replace(model.config, loss=loss_impl)  # the same weights, the other loss
        assert model(idx, targets)[1].item() == pytest.approx(math.log(GPT2_VOCAB), rel=1e-6, abs=0)


def test_weight_decay_still_shrinks_the_padding_rows():
    """The padding rows get no gradient, so AdamW's update to them is its decoupled weight decay alone."""
    model = with_loud_padding(tiny_gpt())
    cfg = train_gpt2.TrainConfig(weight_decay=0.1, max_lr=1e-2, warmup_steps=0)
    optimizers = train_gpt2.make_optimizers(model, cfg, "cpu")
    train_gpt2.set_lr(optimizers, 0, cfg)  # no warmup: step 0 is at the peak, 1e-2
    assert [group["lr"] for opt in optimizers for group in opt.param_groups] == pytest.approx([1e-2, 1e-2], rel=1e-12)
    before = model.lm_head.weight[GPT2_VOCAB:].detach().clone()
    train_gpt2.train_step(model, optimizers, torch.amp.GradScaler("cpu", enabled=False),
                          [(random_ids(2, 32), random_ids(2, 32, seed=2))], contextlib.nullcontext(), grad_clip=1.0)
    torch.testing.assert_close(model.lm_head.weight[GPT2_VOCAB:], before * (1 - 1e-2 * 0.1), rtol=1e-6, atol=0)


def test_generate_gives_padding_ids_no_probability():
    model = with_loud_padding(tiny_gpt()).eval()
    out = train_gpt2.generate(model, [1, 2, 3], 4, 20, torch.Generator().manual_seed(0))
    assert max(max(row) for row in out) < GPT2_VOCAB
    with torch.no_grad():
        logits, _ = model(torch.tensor(out))
    assert torch.all(logits[..., GPT2_VOCAB:] == float("-inf"))


def test_hellaswag_scores_ignore_the_padding_rows():
    model = tiny_gpt().eval()
    tokens = random_ids(2, 4 * 24).view(2, 4, 24)
    mask = torch.zeros(2, 4, 24, dtype=torch.bool)
    mask[..., 10:] = True
    with torch.no_grad():
        before, count = hellaswag.ending_losses(model, tokens, mask)
        with_loud_padding(model)
        after, _ = hellaswag.ending_losses(model, tokens, mask)
    assert torch.equal(before, after) and torch.all(count == 14)


# -----------------------------------------------------------------------------
# The full loss compiled: its backward one pointwise pass (CrossEntropyWithPointwiseBackward), against float64


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_the_pointwise_backward_matches_float64(dtype, tolerance):
    """Its loss and the logits' gradient, with -1 targets and -inf padding ids, under a scaled upstream gradient (1 /
    accumulation steps in train_step), against F.cross_entropy in float64."""
    x, w, targets, mask = chunked_case()
    logits = (x @ w.T + mask).to(dtype)
    want = logits.double().requires_grad_()
    want_loss = F.cross_entropy(want, targets, ignore_index=-1)
    (want_loss / 3).backward()
    logits.requires_grad_()
    loss = CrossEntropyWithPointwiseBackward.apply(logits, targets)
    (loss / 3).backward()
    assert loss.dtype == torch.float32 and logits.grad.dtype == dtype
    torch.testing.assert_close(loss.double(), want_loss.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(logits.grad.double(), want.grad, rtol=tolerance, atol=tolerance * 1e-2)
    assert torch.all(logits.grad[3:9] == 0) and torch.all(logits.grad[:, -20:] == 0)  # -1 rows, padding ids


def test_the_compiled_full_loss_takes_the_pointwise_backward_and_eager_keeps_f_cross_entropy(monkeypatch):
    """Compiled, the model's full loss is CrossEntropyWithPointwiseBackward; eager (the CPU's default), it is
    F.cross_entropy itself, so eager losses are those of F.cross_entropy bit for bit."""
    calls = []
    forward = CrossEntropyWithPointwiseBackward.forward
    monkeypatch.setattr(CrossEntropyWithPointwiseBackward, "forward",
                        staticmethod(lambda ctx, *args: calls.append(1) or forward(ctx, *args)))
    model = tiny_gpt(block_size=32)
    x, y = random_ids(2, 32, seed=1), random_ids(2, 32, seed=2)
    _, eager = model(x, y)
    assert not calls
    assert torch.equal(eager, F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten(), ignore_index=-1))
    _, compiled = torch.compile(model, backend="aot_eager", dynamic=False, fullgraph=True)(x, y)
    assert calls
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=0)


# -----------------------------------------------------------------------------
# chunked_cross_entropy on its own, against float64


@pytest.mark.parametrize("chunk_rows", [5, 16, 1000])
@pytest.mark.parametrize("masked, cap", [(True, None), (False, None), (True, 3.0), (False, 3.0)])
def test_chunked_cross_entropy_matches_float64(chunk_rows, masked, cap):
    """With and without the padding ids' mask and the modern recipe's soft-cap (3: the logits here reach ~10, so it
    bends them), with -1 targets (a whole chunk of them when chunk_rows is 5), in chunks that do and do not divide the
    37 rows."""
    x, w, targets, mask = chunked_case()
    mask = mask if masked else None
    want_loss, want_dx, want_dw = float64_loss_and_grads(x, w, targets, mask, cap)
    x.requires_grad_(), w.requires_grad_()
    loss = chunked_cross_entropy(x, w, targets, mask, cap, chunk_rows=chunk_rows)
    (0.5 * loss).backward()  # the gradient of the loss is 1 / accumulation steps in train_step
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(x.grad.double(), 0.5 * want_dx, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w.grad.double(), 0.5 * want_dw, rtol=1e-5, atol=1e-7)
    assert torch.all(x.grad[3:9] == 0) and (not masked or torch.all(w.grad[-20:] == 0))
    (0.5 * chunked_cross_entropy(x, w, targets, mask, cap, chunk_rows=chunk_rows)).backward()  # gradients add
    torch.testing.assert_close(w.grad.double(), want_dw, rtol=1e-5, atol=1e-7)


def test_chunked_cross_entropy_under_bf16_autocast():
    """The matmuls in bf16 as lm_head's are under autocast, the softmax and the sums in float32: within bf16's rounding
    of the float64 numbers, and as close to them as the full cross-entropy under the same autocast."""
    x, w, targets, mask = chunked_case(N=64, C=64, V=512)
    want_loss, want_dx, want_dw = float64_loss_and_grads(x, w, targets, mask)
    results = {}
    for impl in LOSSES:
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if impl == "chunked":
                loss = chunked_cross_entropy(xi, wi, targets, mask, chunk_rows=24)
            else:
                loss = F.cross_entropy(F.linear(xi, wi) + mask, targets, ignore_index=-1)
        loss.backward()
        assert loss.dtype == xi.grad.dtype == wi.grad.dtype == torch.float32
        results[impl] = [(loss.double() - want_loss).abs().item() / want_loss.item(),
                         ((xi.grad.double() - want_dx).norm() / want_dx.norm()).item(),
                         ((wi.grad.double() - want_dw).norm() / want_dw.norm()).item()]
    for impl, errors in results.items():
        assert max(errors) < 2e-2, (impl, errors)
    assert all(c < 2 * f + 1e-3 for c, f in zip(results["chunked"], results["full"])), results


def test_chunked_cross_entropy_computes_no_gradients_without_grad_mode(monkeypatch):
    """Its forward pass computes the gradients, while each chunk's logits exist, unless it is told they are not
    needed: evaluation (torch.no_grad) must tell it so, though the weights it gets require grad."""
    asked = []
    real_forward = ChunkedCrossEntropy.forward

    def spying_forward(ctx, *args):
        asked.append(args[-1])  # need_grads
        return real_forward(ctx, *args)

    monkeypatch.setattr(ChunkedCrossEntropy, "forward", staticmethod(spying_forward))
    x, w, targets, mask = chunked_case()
    x.requires_grad_(), w.requires_grad_()
    with torch.no_grad():
        loss = chunked_cross_entropy(x, w, targets, mask, chunk_rows=8)
    chunked_cross_entropy(x, w, targets, mask, chunk_rows=8)  # in grad mode: the spy sees the call that does need them
    assert asked == [False, True]
    assert loss.grad_fn is None
    want = float64_loss_and_grads(x.detach(), w.detach(), targets, mask)[0]
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)


# -----------------------------------------------------------------------------
# --loss chunked in the model: the same loss and gradients as --loss full, with weight tying, accumulation, compile


def loss_and_grads(model, batches):
    """train_step's forward and backward over micro-batches (SGD at lr 0, no clipping): the mean loss, the gradients."""
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.0)]
    result = train_gpt2.train_step(model, optimizers, torch.amp.GradScaler("cpu", enabled=False), batches,
                                   contextlib.nullcontext(), grad_clip=1e9)
    assert result.finite
    return result.loss, {name.removeprefix("_orig_mod."): p.grad for name, p in model.named_parameters()}


def test_chunked_model_matches_full_model_over_accumulated_micro_batches():
    batches = [(random_ids(2, 32, seed=s), random_ids(2, 32, seed=s + 10)) for s in range(2)]
    batches[1][1][0, :7] = -1
    full, full_grads = loss_and_grads(with_loud_padding(tiny_gpt(loss="full")), batches)
    chunked_model = with_loud_padding(tiny_gpt(loss="chunked"))
    chunked, chunked_grads = loss_and_grads(chunked_model, batches)
    assert chunked == pytest.approx(full, rel=1e-6)
    for name, grad in full_grads.items():  # wte's gradient is the embedding's plus lm_head's: they are one tensor
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    logits, _ = chunked_model(batches[0][0])  # logits asked for (no targets): the chunked model computes them too
    _, loss = chunked_model(*batches[0])
    assert logits.shape == (2, 32, 50304)
    assert loss.item() == pytest.approx(reference(chunked_model, *batches[0]).item(), rel=1e-6)


@pytest.mark.parametrize("loss_impl", LOSSES)
def test_loss_under_compile_matches_eager(loss_impl, monkeypatch):
    """Traced by dynamo and AOTAutograd as for inductor, in one graph (no code generated, as backend aot_eager: inductor
    takes ~30 s per tiny model on a CPU; tests/test_cuda.py compiles with inductor). The chunked loss's loop is one
    call of its custom op in the model's forward graph, which holds no row of logits: unrolled there, inductor ran all
    the chunks at once. Each chunk is compiled on its own (here too without code generated)."""
    batches = [(random_ids(3, 32), random_ids(3, 32, seed=2))]  # 96 rows: the logits' shape is no weight's
    eager_loss, eager_grads = loss_and_grads(with_loud_padding(tiny_gpt(loss=loss_impl)), batches)
    torch._dynamo.reset()
    graphs, compiled_functions, real_compile = [], [], torch.compile

    def keep_graph(graph, example_inputs):
        graphs.append(graph)
        return make_boxed_func(graph)

    monkeypatch.setattr(torch, "compile", lambda function, **options: compiled_functions.append(function)
                        or real_compile(function, **{**options, "backend": "aot_eager"}))
    model = with_loud_padding(tiny_gpt(loss=loss_impl))
    backend = aot_autograd(fw_compiler=keep_graph, bw_compiler=keep_graph)
    compiled = real_compile(model, backend=backend, dynamic=False, fullgraph=True)
    loss, grads = loss_and_grads(compiled, batches)
    assert loss == pytest.approx(eager_loss, rel=1e-6)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert torch.all(grads["transformer.wte.weight"][GPT2_VOCAB:] == 0)  # lm_head.weight, tied
    forward = [node for node in graphs[0].graph.nodes if node.op == "call_function"]
    rows_of_logits = [node for node in forward if isinstance(node.meta.get("val"), torch.Tensor)
                      and node.meta["val"].shape[-1:] == (50304,) and node.meta["val"].numel() >= 96 * 50304]
    chunk_loops = [node for node in forward if node.target == torch.ops.train_gpt2.chunked_sums.default]
    assert (len(chunk_loops), bool(rows_of_logits)) == ((1, False) if loss_impl == "chunked" else (0, True))
    assert compiled_functions == ([losses.chunk_sums] if loss_impl == "chunked" else [])


def test_chunked_loss_under_ddp(tmp_path):
    """2 processes x 2 accumulation steps of the chunked loss: DDP's averaged gradients are the whole batch's."""
    script = os.path.join(REPO, "tests", "scripts", "chunked_loss_under_ddp.py")
    assert last_json(run_script([], cwd=tmp_path, nproc=2, timeout=120, script=script)) < 1e-6
