"""The modern recipe (--recipe modern): its model against independent references (the loss at init, rotary against
rotations written out, the soft-capped chunked loss against float64, the KV cache against recomputing, FLOPs against
the parameters), its optimizers and schedule, and the trainer with it: exact resume, fp16 and bf16 with two
optimizers, HellaSwag through --eval-only, the Shakespeare preset, the refusals. (DDP and compile with it:
tests/test_train.py; W&B: tests/test_wandb.py.)"""
import contextlib
import dataclasses
import functools
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from test_hellaswag import TINY_MODEL, checkpoint_holding, eval_only, labelled_by_hand, tiny_model
from test_model import no_cache_sample
from test_samples import sample_without_a_cache

import train_gpt2
from helpers import (
    TINY,
    assert_tensors_equal,
    chunked_case,
    expect_usage_error,
    final_hidden,
    load_ckpt,
    needs_muon,
    past_flags,
    printed_samples,
    random_ids,
    read_log,
    resolved,
    run_main,
    tiny_gpt,
    train_records,
    val_records,
    write_jsonl,
)
from machinery import run_log, tokenizer
from machinery.tokenizer import GPT2_VOCAB
from train_gpt2 import TrainConfig, generate
from variations import modern
from variations.losses import chunked_cross_entropy
from variations.modern import get_lr, rotary_tables, rotate

MODERN = ["--recipe", "modern"]
pytestmark = needs_muon


def modern_gpt(**kwargs):
    return tiny_gpt(recipe="modern", **kwargs)


@pytest.mark.parametrize("vocab_size, n_tokens", [(50304, GPT2_VOCAB), (128, 128)])
def test_the_loss_at_init_is_exactly_log_vocab(vocab_size, n_tokens):
    """The output layer starts at zero: every real token gets the same logit, the padding none."""
    model = modern_gpt(vocab_size=vocab_size)
    _, loss = model(random_ids(2, 32, n_tokens), random_ids(2, 32, n_tokens, seed=2))
    assert loss.item() == pytest.approx(math.log(n_tokens), abs=1e-6)  # ln(50257) = 10.8249...
    params = dict(model.named_parameters())
    assert "transformer.wpe.weight" not in params  # positions are rotary
    assert model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr()  # untied
    assert all(p.dim() == 2 for p in params.values())  # no biases, no norm gains
    zero = [name for name, p in params.items() if not p.any()]
    assert sorted(zero) == sorted(["lm_head.weight"] + [f"transformer.h.{i}.{part}.c_proj.weight" for i in range(2)
                                                        for part in ("attn", "mlp")])


def rotated_by_hand(x, position, base=10000.0):
    """x (hs,) with each pair (x[i], x[i + hs/2]) turned by the angle position * base**(-2i/hs), in float64."""
    half = x.numel() // 2
    out = torch.empty(x.numel(), dtype=torch.float64)
    for i in range(half):
        angle = position * base ** (-2 * i / x.numel())
        a, b = x[i].item(), x[i + half].item()
        out[i], out[i + half] = a * math.cos(angle) + b * math.sin(angle), b * math.cos(angle) - a * math.sin(angle)
    return out


def test_rotary_turns_each_pair_by_its_positions_angle_and_scores_depend_on_distance_only():
    T, hs = 12, 8
    cos, sin = rotary_tables(hs, T)
    q, k = torch.randn(1, 1, T, hs, dtype=torch.float64), torch.randn(1, 1, T, hs, dtype=torch.float64)
    rotated = rotate(q, cos, sin)
    for position in range(T):
        torch.testing.assert_close(rotated[0, 0, position], rotated_by_hand(q[0, 0, position], position), rtol=1e-6,
                                   atol=1e-6)
    same_q, same_k = q[:, :, :1].expand(1, 1, T, hs), k[:, :, :1].expand(1, 1, T, hs)  # one vector at every position
    scores = rotate(same_q, cos, sin)[0, 0] @ rotate(same_k, cos, sin)[0, 0].T  # (T, T): positions m, n
    for distance in range(-3, 4):
        along = torch.diagonal(scores, offset=distance)
        torch.testing.assert_close(along, along[:1].expand_as(along), rtol=1e-6, atol=1e-6)  # float32 tables
    assert not torch.allclose(torch.diagonal(scores, 0)[:1], torch.diagonal(scores, 1)[:1])  # distance does count


def test_qk_norm_then_rotary_is_nanochats_rotary_then_qk_norm():
    """What transformers' NanoChatForCausalLM does to a head's queries and keys, written out from its code: it turns
    them first, x * cos + rotate_half(x) * sin with rotate_half(x1, x2) = (x2, -x1) and the angles of both halves
    alike, from frequencies 1 / rope_theta**(2i / head size), then RMS-norms them with rms_norm_eps. That is ours, which
    norms first (F.rms_norm, float32's epsilon), then rotates: a norm with no weight commutes with a rotation."""
    x = torch.randn(2, 3, 16, 8, generator=torch.Generator().manual_seed(0)) * 3  # (B, nh, T, hs)
    cos, sin = rotary_tables(8, 16)
    inverse_frequencies = 1.0 / modern.ROTARY_BASE ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    angles = torch.arange(16, dtype=torch.float32)[:, None] * inverse_frequencies  # (T, hs/2)
    cos_both, sin_both = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    turned = x * cos_both + torch.cat([x2, -x1], dim=-1) * sin_both
    rms_norm_eps = torch.finfo(torch.float32).eps  # what an export's config.json says (tests/test_export.py)
    theirs = turned * torch.rsqrt(turned.pow(2).mean(-1, keepdim=True) + rms_norm_eps)
    torch.testing.assert_close(rotate(modern.rms_norm(x), cos, sin), theirs, rtol=1e-6, atol=1e-6)


def trained_looking(model):
    """Nonzero output layer and projections: at init they are zero, and every prediction is the same."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.normal_(0.0, 0.3)
    return model.eval()


def test_causality_and_the_kv_cache_with_rotary_positions():
    """A token never sees the future; cached steps (rotary positions offset by the cache) give the logits of the whole
    sequence, and generate samples what recomputing without a cache samples, also once the window slides."""
    model = trained_looking(modern_gpt(vocab_size=128))
    seq = random_ids(2, 20, 128)
    changed = seq.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 128
    with torch.no_grad():
        (full, _), (after_change, _) = model(seq), model(changed)
        assert torch.equal(full[:, :12], after_change[:, :12]) and not torch.allclose(full[:, 12], after_change[:, 12])
        cache = [[] for _ in model.transformer.h]
        steps = [model(seq[:, :6], kv_cache=cache)[0]] + [model(seq[:, t: t + 1], kv_cache=cache)[0]
                                                          for t in range(6, 20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)
    prompt = [5, 17, 99]
    assert generate(model, prompt, 2, 12, torch.Generator().manual_seed(0), top_k=1) == no_cache_sample(
        model, prompt, 2, 12, None, top_k=1)
    small = trained_looking(modern_gpt(vocab_size=128, block_size=8))
    sampled = generate(small, prompt, 3, 30, torch.Generator().manual_seed(7))
    assert sampled == sample_without_a_cache(small, prompt, 3, 30, torch.Generator().manual_seed(7))


def test_logits_are_soft_capped():
    model = trained_looking(modern_gpt(vocab_size=128))
    idx, cap = random_ids(2, 16, 128), model.config.logit_softcap
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
        raw, (logits, _) = model.lm_head(final_hidden(model, idx)), model(idx)
    assert raw.abs().max() > 2 * cap and logits.abs().max() <= cap
    torch.testing.assert_close(logits, cap * torch.tanh(raw / cap))


@pytest.mark.parametrize("chunk_rows", [5, 1000])
def test_the_soft_capped_chunked_loss_matches_float64(chunk_rows):
    cap = 3.0  # the logits of chunked_case reach ~10: the cap bends them
    x, w, targets, mask = chunked_case()
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    want = F.cross_entropy(cap * torch.tanh(x64 @ w64.T / cap) + mask.double(), targets, ignore_index=-1)
    want.backward()
    x.requires_grad_(), w.requires_grad_()
    loss = chunked_cross_entropy(x, w, targets, mask, cap, chunk_rows=chunk_rows)
    loss.backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-7)
    uncapped = chunked_cross_entropy(x.detach(), w.detach(), targets, mask)
    assert abs(uncapped.item() - loss.item()) > 0.1  # the cap changed the loss: the test can fail


def loss_and_grads(model, x, y):
    model.zero_grad()
    _, loss = model(x, y)
    loss.backward()
    return loss.item(), {name.removeprefix("_orig_mod."): p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("compiled", [False, True])
def test_the_chunked_loss_and_compile_give_the_full_eager_loss(compiled, monkeypatch):
    x, y = random_ids(2, 32), random_ids(2, 32, seed=2)
    want_loss, want_grads = loss_and_grads(trained_looking(modern_gpt()).train(), x, y)
    model = trained_looking(modern_gpt(loss="chunked")).train()
    if compiled:  # traced by dynamo and AOTAutograd as for inductor; aot_eager generates no code (fast on a CPU)
        torch._dynamo.reset()
        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))  # the chunks' too
        model = torch.compile(model, dynamic=False, fullgraph=True)
    loss, grads = loss_and_grads(model, x, y)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_muon_takes_the_blocks_matrices_and_adam_the_embedding_and_head_at_their_rates():
    model = modern_gpt(vocab_size=128)
    cfg = TrainConfig(recipe="modern", muon_lr=0.03, embed_lr=0.5, head_lr=0.007)
    muon, adam = train_gpt2.make_optimizers(model, cfg, "cpu")
    assert isinstance(muon, torch.optim.Muon) and isinstance(adam, torch.optim.Adam)
    names = {id(p): name for name, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in muon.param_groups[0]["params"]) == sorted(
        f"transformer.h.{i}.{matrix}.weight" for i in range(2) for matrix in ("attn.c_attn", "attn.c_proj",
                                                                              "mlp.c_fc", "mlp.c_proj"))
    assert [(g["params"], g["max_lr"]) for g in adam.param_groups] == [([model.transformer.wte.weight], 0.5),
                                                                      ([model.lm_head.weight], 0.007)]
    assert muon.param_groups[0]["max_lr"] == 0.03 and adam.defaults["betas"] == (0.8, 0.95)
    owned = [p for opt in (muon, adam) for g in opt.param_groups for p in g["params"]]
    assert len(owned) == len({id(p) for p in owned}) == len(list(model.parameters()))  # each exactly once


def test_an_fp16_overflow_in_one_optimizers_gradients_skips_both():
    """The gradient scaler skips only the optimizer whose own gradients overflowed; clipping by the infinite norm
    would have zeroed Muon's, and its momentum moved the weights anyway. Neither may step."""
    model = trained_looking(modern_gpt(vocab_size=128)).train()  # at init, the blocks' gradients are all zero
    optimizers = train_gpt2.make_optimizers(model, TrainConfig(recipe="modern"), "cpu")
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    batches = [(random_ids(2, 16, 128), random_ids(2, 16, 128, seed=2))]
    train_gpt2.train_step(model, optimizers, scaler, batches, contextlib.nullcontext(), 1.0)  # a step that counts
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    momentum = [buffer.clone() for buffer in optimizers[0].state_dict()["state"][0].values()]
    assert all(buffer.any() for buffer in momentum)  # Muon has momentum to move the weights by
    overflow = model.lm_head.weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))  # Adam's only
    result = train_gpt2.train_step(model, optimizers, scaler, batches, contextlib.nullcontext(), 1.0)
    overflow.remove()
    assert result.finite and not math.isfinite(result.grad_norm)  # logged as a skipped step, not a non-finite one
    assert scaler.get_scale() == 512.0  # and the scale backs off
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert all(torch.equal(a, b) for a, b in zip(momentum, optimizers[0].state_dict()["state"][0].values()))


def test_the_schedule_holds_then_cools_down_linearly():
    cfg = TrainConfig(recipe="modern", max_steps=101, warmup_steps=0, cooldown_frac=0.4, min_lr_ratio=0.1)
    assert [get_lr(s, 0.02, cfg) for s in (0, 30, 60)] == pytest.approx([0.02] * 3)  # held for the first 60%
    assert get_lr(80, 0.02, cfg) == pytest.approx(0.002 + 0.5 * 0.018)  # half-way down the 40 cool-down steps
    assert get_lr(100, 0.02, cfg) == pytest.approx(0.002, rel=1e-12)  # the last step: min_lr_ratio of the peak
    lrs = [get_lr(s, 0.02, cfg) for s in range(101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    cfg = dataclasses.replace(cfg, warmup_steps=10)
    assert get_lr(0, 0.02, cfg) == pytest.approx(0.002) and get_lr(9, 0.02, cfg) == pytest.approx(0.02)


@pytest.mark.parametrize("recipe", ["gpt2", "modern"])
def test_flops_per_token_counts_the_matmul_parameters(recipe):
    """6 x the parameters that multiply activations (all but the position table or, untied, the embedding table),
    counted on the model itself, plus attention's 12*L*C*T."""
    model = tiny_gpt(recipe=recipe, n_layer=3)
    lookups = {"gpt2": "transformer.wpe.weight", "modern": "transformer.wte.weight"}[recipe]
    n = sum(p.numel() for name, p in model.named_parameters() if name != lookups)
    assert run_log.flops_per_token(model, 32) == 6 * n + 12 * 3 * 64 * 32


# -----------------------------------------------------------------------------
# the trainer with --recipe modern


def test_a_resumed_run_is_bitwise_the_uninterrupted_one(shards, tmp_path, capsys):
    """A checkpoint of a modern run (both optimizers' state, the data position, the RNGs), resumed alone in a new log
    dir, trains on to the same weights, optimizer states and losses, bitwise (CPU, fp32)."""
    args = TINY + MODERN + ["--data", shards, "--max-steps", "8", "--checkpoint-every", "4", "--eval-every", "4"]
    code, _, err = run_main(args + ["--log-dir", tmp_path / "whole"], capsys)
    assert code == 0, err
    (tmp_path / "resumed").mkdir()
    shutil.copy(tmp_path / "whole" / "ckpt_000004.pt", tmp_path / "resumed")
    code, out, err = run_main(args + ["--log-dir", tmp_path / "resumed"], capsys)
    assert code == 0, err
    assert "resuming from the checkpoint of step 4" in out
    whole, resumed = load_ckpt(tmp_path / "whole" / "ckpt_000008.pt"), load_ckpt(tmp_path / "resumed" /
                                                                                  "ckpt_000008.pt")
    assert_tensors_equal(whole["model"], resumed["model"])
    assert len(whole["optimizers"]) == 2 and [set(s["state"]) for s in whole["optimizers"]] == [set(range(8)), {0, 1}]
    for mine, theirs in zip(resumed["optimizers"], whole["optimizers"]):
        assert_tensors_equal(mine["state"], theirs["state"])
    whole_log, resumed_log = train_records(read_log(tmp_path / "whole")), train_records(read_log(tmp_path / "resumed"))
    assert sorted(resumed_log) == [4, 5, 6, 7]
    for step in range(4, 8):
        assert resumed_log[step]["train_loss"] == whole_log[step]["train_loss"], step
        assert resumed_log[step]["lr"] == whole_log[step]["lr"]
    assert (whole_log[0]["lr"], whole_log[7]["lr"]) == pytest.approx((0.02, 0.002))  # Muon's rate, cooled down


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_autocast_trains_with_both_optimizers(shards, tmp_path, capsys, dtype):
    """bf16 and fp16 autocast (fp16 with the gradient scaler, which unscales and steps both optimizers) train as
    fp32 does, within their rounding."""
    args = TINY + MODERN + ["--data", shards, "--max-steps", "6", "--eval-every", "6"]
    logs = {}
    for name in ("fp32", dtype):
        code, _, err = run_main(args + ["--dtype", name, "--log-dir", tmp_path / name], capsys)
        assert code == 0, err
        logs[name] = read_log(tmp_path / name)
    for name, log in logs.items():
        assert len(train_records(log)) == 6 and not any(r.get("skipped") for r in log), name
    for mine, fp32 in zip(train_records(logs[dtype]).values(), train_records(logs["fp32"]).values()):
        assert mine["train_loss"] == pytest.approx(fp32["train_loss"], abs=0.02)
    assert val_records(logs[dtype])[6]["val_loss"] == pytest.approx(val_records(logs["fp32"])[6]["val_loss"], abs=0.02)
    ckpt = load_ckpt(tmp_path / dtype / "ckpt_000006.pt")
    assert all(state["state"] for state in ckpt["optimizers"])  # both stepped
    assert bool(ckpt["scaler"]) == (dtype == "fp16")  # the scaler's state is saved for a resume


def test_hellaswag_through_eval_only_scores_as_by_hand(shards, tmp_path, capsys):
    """--eval-only on a modern checkpoint, HellaSwag scored with its (soft-capped) logits: the accuracies of a
    forward pass per ending, computed by hand."""
    model = tiny_model(recipe="modern")
    examples, acc_norm, acc, _ = labelled_by_hand(model, tokenizer.gpt2_tokenizer(), 64)
    checkpoint = checkpoint_holding(model, shards, tmp_path / "log", capsys, *MODERN)
    write_jsonl(tmp_path / "hellaswag_val.jsonl", examples)
    code, out, err = run_main(eval_only(checkpoint, shards, tmp_path / "log", *MODERN,
                                        "--hellaswag-file", tmp_path / "hellaswag_val.jsonl"), capsys)
    assert code == 0, err
    assert out.strip().splitlines()[-1].startswith(f"step     1 | hellaswag acc_norm {acc_norm:.4f} acc {acc:.4f}")
    assert "val_loss" in read_log(tmp_path / "log")[-2]


def test_the_shakespeare_preset_takes_the_modern_recipes_rates(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no shards here
    env = train_gpt2.Env(0, 0, 1, "cpu", "cpu")
    cfg = resolved(MODERN, env)
    preset = modern.PRESETS["shakespeare"]
    assert (cfg.muon_lr, cfg.embed_lr, cfg.head_lr, cfg.warmup_steps) == (
        preset["muon_lr"], preset["embed_lr"], preset["head_lr"], preset["warmup_steps"])
    assert (cfg.n_layer, cfg.max_steps) == (8, 900)  # the rest of the Shakespeare preset
    cfg = resolved(MODERN + ["--muon-lr", "0.05"], env)
    assert cfg.muon_lr == 0.05
    cfg = resolved(MODERN + ["--data", str(tmp_path)], env)
    assert (cfg.max_steps, cfg.warmup_steps, cfg.muon_lr) == (3815, 0, 0.02)  # FineWeb's


@pytest.mark.parametrize("flags, fragments", [
    (MODERN + ["--init-from", "gpt2"], ["--init-from gpt2", "--recipe modern"]),
    (MODERN + ["--max-lr", "1e-3", "--weight-decay", "0"],
     ["--max-lr, --weight-decay are settings of --recipe gpt2 only, and this run is --recipe modern; drop them"]),
    (["--muon-lr", "0.1"], ["--muon-lr is a setting of --recipe modern only", "pass --recipe modern"]),
    (MODERN + ["--cooldown-frac", "0"], ["--cooldown-frac must be above 0 and at most 1"]),
    (MODERN + ["--logit-softcap", "0"], ["--logit-softcap must be positive"]),
    (MODERN + ["--n-embd", "34", "--n-head", "2", "--max-steps", "1"],  # rotate's RuntimeError in the search
     ["--recipe modern", "needs an even head size", "--n-embd 34 / --n-head 2 = head size 17",
      "pass --n-embd 36 (head size 18)"]),
    (MODERN + ["--n-embd", "36", "--n-head", "0", "--max-steps", "1"],  # --model gpt2's 12 heads: it trained
     ["--n-embd 36 / --n-head 12 = head size 3", "pass --n-embd 48 (head size 4)"]),
])
def test_settings_the_recipe_cannot_honour_are_refused(shards, tmp_path, capsys, flags, fragments):
    expect_usage_error(TINY + ["--data", shards, "--log-dir", tmp_path / "log"] + flags, capsys, *fragments)


def test_torch_without_muon_is_refused(shards, tmp_path, capsys, monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon")
    expect_usage_error(TINY + MODERN + ["--data", shards, "--log-dir", tmp_path], capsys,
                       "--recipe modern needs torch.optim.Muon, new in PyTorch 2.9")


def test_a_checkpoint_of_the_other_recipe_is_refused_and_an_older_one_is_gpt2(shards, tmp_path, capsys):
    """Resuming a GPT-2 checkpoint with --recipe modern names the difference; a checkpoint written before the
    recipes existed (no recipe in its model settings) resumes as the GPT-2 model it is."""
    args = TINY + ["--data", shards, "--log-dir", tmp_path / "log", "--max-steps", "2"]
    code, _, err = run_main(args, capsys)
    assert code == 0, err
    expect_usage_error(args + MODERN, capsys, "ckpt_000002.pt (step 2) does not fit",
                       "recipe: checkpoint gpt2, flags modern", "or another --log-dir to keep that run where it is")
    path = tmp_path / "log" / "ckpt_000002.pt"
    ckpt = load_ckpt(path)
    del ckpt["model_config"]["recipe"], ckpt["model_config"]["logit_softcap"]
    torch.save(ckpt, path)
    code, out, err = run_main(args[:-1] + ["3"], capsys)
    assert code == 0, err
    assert "resuming from the checkpoint of step 2" in out


def test_samples_from_a_modern_checkpoint(shards, tmp_path, capsys):
    code, _, err = run_main(TINY_MODEL + MODERN + ["--data", shards, "--log-dir", tmp_path, "--max-steps", "2"],
                            capsys)
    assert code == 0, err
    code, out, err = run_main(["--sample", tmp_path / "ckpt_000002.pt", "--num-samples", "2", "--max-new-tokens", "80",
                               "--device", "cpu"], capsys)  # past the block of 64: the window slides
    assert code == 0, err
    assert out.count("--- sample ") == 2 and "--- end of samples ---" in out



def test_the_zero_heads_samples_at_step_0_are_said_to_be_punctuation(shards, tmp_path, capsys):
    """At step 0 the modern recipe's output layer is all zeros: every token is as likely, and top-k keeps the first
    ids, punctuation. The samples say so then, and only then; GPT-2's random head never does."""
    flags = ["--data", shards, "--max-steps", "2", "--eval-every", "2", "--num-samples", "1", "--prompt", "Hi"]
    code, out, err = run_main(TINY_MODEL + MODERN + flags + ["--log-dir", tmp_path / "modern"], capsys)
    assert code == 0, err
    note = "(the output layer is all zeros, as the modern recipe starts it"
    assert out.count(note) == 1 and out.index(note) < out.index("--- sample 1/1 (step 0) ---")
    (*_, text), _ = printed_samples(out)
    first_ids = {tokenizer.gpt2_tokenizer().decode([i]) for i in range(50)}
    assert text.startswith("Hi") and set(text[2:]) <= set("".join(first_ids))  # each sampled token one of them
    code, out, err = run_main(TINY_MODEL + flags + ["--log-dir", tmp_path / "gpt2"], capsys)
    assert code == 0 and note not in out


def test_eval_only_evaluates_a_modern_checkpoint_as_it_was_trained(shards, tmp_path, capsys):
    """`--eval-only` in a modern run's log dir, without --recipe modern: it reads the recipe and shapes from the
    checkpoint, as --sample does, and gets the run's own validation loss; flags that say otherwise, and --no-resume
    (which would evaluate random weights into the run's log), are refused in a line that suggests nothing else."""
    args = TINY + ["--data", shards, "--log-dir", tmp_path]
    code, _, err = run_main(args + MODERN + ["--max-steps", "2"], capsys)
    assert code == 0, err
    trained = val_records(read_log(tmp_path))[2]["val_loss"]
    code, out, err = run_main(args + ["--eval-only"], capsys)
    assert code == 0, err
    assert past_flags(out)[0] == f"evaluating {tmp_path / 'ckpt_000002.pt'} (step 2)"
    assert "the modern recipe" in past_flags(out)[1]
    evaluated = read_log(tmp_path)[-1]
    assert evaluated["eval_only"] and evaluated["init_from"] == str(tmp_path / "ckpt_000002.pt")
    assert evaluated["val_loss"] == pytest.approx(trained, abs=1e-6)
    logged = len(read_log(tmp_path))
    line = expect_usage_error(args + ["--eval-only", "--no-resume"], capsys, "--eval-only evaluates a checkpoint",
                              "drop --no-resume")
    assert "--no-resume to" not in line
    expect_usage_error(args + ["--eval-only", "--n-layer", "4"], capsys, "as it was trained, and flags say otherwise",
                       "n_layer: checkpoint 2, flags 4", "drop them")
    assert len(read_log(tmp_path)) == logged  # the refusals evaluated nothing into the run's log
