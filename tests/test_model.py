"""The GPT-2 model of train_gpt2.py: shapes, tying, init, loss at init, causality, attention against a naive
reference, overfitting one batch, the Hugging Face names, and sampling with a KV cache."""
import functools
import math

import pytest
import torch
import torch.nn.functional as F

import train_gpt2
from helpers import VOCAB, final_hidden, random_ids, tiny_gpt
from machinery import run_log
from train_gpt2 import GPT, GPT2_VOCAB, GPTConfig, generate

tiny = functools.partial(tiny_gpt, vocab_size=VOCAB)  # 128 ids, unless a test is about GPT-2's padded vocabulary


def test_shapes():
    model = tiny()
    idx = random_ids(3, 32, 128)
    logits, no_loss = model(idx)  # without targets: the logits, no loss (the lecture's interface)
    assert isinstance(logits, torch.Tensor) and logits.shape == (3, 32, 128) and no_loss is None
    no_logits, loss = model(idx, idx)  # training's call, with targets: the loss, and no logits to write out
    assert isinstance(loss, torch.Tensor) and loss.shape == () and loss.dtype == torch.float32 and no_logits is None
    with torch.no_grad():  # forward is its pieces: the trunk's hidden states, then the logits or the loss
        hidden = final_hidden(model, idx)
        assert hidden.shape == (3, 32, 64)
        assert torch.equal(model.logits(hidden), model(idx)[0])
        assert torch.equal(F.cross_entropy(model.logits(hidden).flatten(0, 1), idx.flatten()), model(idx, idx)[1])
    padded = tiny(vocab_size=50304)  # the padding ids have logits, at -inf (tests/test_loss.py)
    assert padded.transformer.wte.weight.shape == (50304, 64)
    logits, _ = padded(random_ids(2, 5, GPT2_VOCAB))
    assert logits.shape == (2, 5, 50304) and logits.dtype == torch.float32
    assert torch.all(logits[..., GPT2_VOCAB:] == float("-inf")) and torch.all(logits[..., :GPT2_VOCAB].isfinite())
    assert set(padded.state_dict()) == set(model.state_dict())  # the mask is a constant, not saved in checkpoints


def test_weight_tying():
    model = tiny()
    assert model.lm_head.weight is model.transformer.wte.weight
    # counted once: the hand count of the tiny model's parameters
    V, P, C, L = 128, 32, 64, 2
    per_block = 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + 2 * C + (C * 4 * C + 4 * C) + (4 * C * C + C)
    assert sum(p.numel() for p in model.parameters()) == V * C + P * C + L * per_block + 2 * C
    _, loss = model(random_ids(2, 8, 128), random_ids(2, 8, 128, seed=2))
    loss.backward()
    assert model.transformer.wte.weight.grad is model.lm_head.weight.grad


def test_init_statistics():
    L = 4
    model = tiny(n_layer=L, n_embd=256, block_size=256, vocab_size=512)
    residual = 0.02 / math.sqrt(2 * L)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        elif ".ln_" in name or name.startswith("transformer.ln_f"):
            assert torch.all(p == 1), name
        else:
            want = residual if name.endswith("c_proj.weight") else 0.02
            assert abs(p.std().item() - want) < 0.03 * want, (name, p.std().item(), want)
            assert abs(p.mean().item()) < 0.05 * want, name


@pytest.mark.parametrize("vocab_size, n_tokens", [(50304, GPT2_VOCAB), (128, 128)])
def test_loss_at_init_is_log_vocab(vocab_size, n_tokens):
    model = tiny(vocab_size=vocab_size)
    idx, targets = random_ids(4, 32, n_tokens), random_ids(4, 32, n_tokens, seed=3)
    (logits, _), (_, loss) = model(idx), model(idx, targets)
    assert abs(loss.item() - math.log(n_tokens)) < 0.05, (loss.item(), math.log(n_tokens))
    # the loss is the mean cross-entropy, computed here by hand; -1 targets are left out
    logp = logits.double().log_softmax(-1)
    by_hand = -logp.gather(-1, targets.unsqueeze(-1)).mean()
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-5)
    masked = targets.clone()
    masked[:, 16:] = -1
    _, loss_masked = model(idx, masked)
    by_hand_masked = -logp[:, :16].gather(-1, targets[:, :16].unsqueeze(-1)).mean()
    assert loss_masked.item() == pytest.approx(by_hand_masked.item(), rel=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "naive"])
def test_causality(attn):
    model = tiny(attn=attn)
    idx = random_ids(2, 32, 128)
    with torch.no_grad():
        before, _ = model(idx)
        for t in (0, 13, 31):
            changed = idx.clone()
            changed[:, t] = (changed[:, t] + 1) % 128
            after, _ = model(changed)
            assert torch.allclose(before[:, :t], after[:, :t], rtol=0, atol=1e-6), t
            assert not torch.allclose(before[:, t], after[:, t], atol=1e-4), t  # the change does reach position t


def reference_attention(q, k, v):
    """Causal attention one query at a time, in float64: query i of the last T sees keys 0..S-T+i."""
    q, k, v = q.double(), k.double(), v.double()
    T, S = q.size(-2), k.size(-2)
    out = torch.empty_like(q)
    for i in range(T):
        visible = S - T + i + 1
        scores = q[..., i: i + 1, :] @ k[..., :visible, :].transpose(-2, -1) / math.sqrt(q.size(-1))
        out[..., i: i + 1, :] = scores.softmax(dim=-1) @ v[..., :visible, :]
    return out.float()


def test_attention_matches_naive_reference():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 16, generator=g) for _ in range(3))
    want = reference_attention(q, k, v)
    assert torch.allclose(train_gpt2.naive_attention(q, k, v), want, atol=1e-5)
    assert torch.allclose(F.scaled_dot_product_attention(q, k, v, is_causal=True), want, atol=1e-5)
    # the last 5 queries against all 32 keys (the KV-cache case)
    assert torch.allclose(train_gpt2.naive_attention(q[..., -5:, :], k, v), want[..., -5:, :], atol=1e-5)
    # the whole attention layer: c_attn, heads, causal attention, c_proj
    for attn in ("sdpa", "naive"):
        layer = tiny(attn=attn).transformer.h[0].attn
        x = torch.randn(2, 32, 64, generator=g)
        with torch.no_grad():
            qkv = x @ layer.c_attn.weight.T + layer.c_attn.bias
            heads = [t.view(2, 32, 4, 16).transpose(1, 2) for t in qkv.split(64, dim=2)]
            y = reference_attention(*heads).transpose(1, 2).reshape(2, 32, 64)
            assert torch.allclose(layer(x), y @ layer.c_proj.weight.T + layer.c_proj.bias, atol=1e-5), attn
    # the whole model, same weights, --attn sdpa vs --attn naive
    sdpa, naive = tiny(attn="sdpa"), tiny(attn="naive")
    naive.load_state_dict(sdpa.state_dict())
    idx = random_ids(2, 32, 128)
    with torch.no_grad():
        assert torch.allclose(sdpa(idx)[0], naive(idx)[0], atol=1e-5)


def test_overfits_one_batch():
    model = tiny()
    idx = random_ids(4, 33, 128)
    x, y = idx[:, :-1], idx[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(150):
        _, loss = model(x, y)
        first = first or loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert first > 4.5 and loss.item() < 0.1, (first, loss.item())


def hf_gpt2_shapes(n_layer=12, C=768, vocab=GPT2_VOCAB, block=1024):
    """openai-community/gpt2's tensors and shapes (Conv1D weights are (in, out)), written out by hand."""
    shapes = {"wte.weight": (vocab, C), "wpe.weight": (block, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for i in range(n_layer):
        shapes.update({
            f"h.{i}.ln_1.weight": (C,), f"h.{i}.ln_1.bias": (C,),
            f"h.{i}.attn.c_attn.weight": (C, 3 * C), f"h.{i}.attn.c_attn.bias": (3 * C,),
            f"h.{i}.attn.c_proj.weight": (C, C), f"h.{i}.attn.c_proj.bias": (C,),
            f"h.{i}.ln_2.weight": (C,), f"h.{i}.ln_2.bias": (C,),
            f"h.{i}.mlp.c_fc.weight": (C, 4 * C), f"h.{i}.mlp.c_fc.bias": (4 * C,),
            f"h.{i}.mlp.c_proj.weight": (4 * C, C), f"h.{i}.mlp.c_proj.bias": (C,),
        })
    return shapes


def test_names_and_shapes_map_onto_hugging_face_gpt2():
    hf = hf_gpt2_shapes()
    assert sum(math.prod(s) for s in hf.values()) == 124_439_808  # GPT-2 small's known parameter count
    with torch.device("meta"):
        model = GPT(GPTConfig(**train_gpt2.MODEL_SIZES["gpt2"]))  # the 124M model, 50304 rows
    ours = {k.removeprefix("transformer."): tuple(v.shape) for k, v in model.state_dict().items()
            if k != "lm_head.weight"}
    assert set(ours) == set(hf)
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    for name, shape in hf.items():
        if name.endswith(conv1d):
            shape = shape[::-1]  # nn.Linear is (out, in)
        if name == "wte.weight":
            shape = (50304, shape[1])  # padded to a multiple of 128
        assert ours[name] == shape, name
    assert sum(p.numel() for p in model.parameters()) == 124_439_808 + (50304 - GPT2_VOCAB) * 768


def test_generate_never_produces_padded_ids():
    model = tiny(vocab_size=50304)
    with torch.no_grad():  # make every padding row win the full, uncut logits by far
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.lm_head.weight[GPT2_VOCAB:] = 1.0
        h = model.transformer.ln_f(torch.zeros(1, 64))
        assert (h @ model.lm_head.weight.T).argmax().item() >= GPT2_VOCAB  # the test can fail
    out = generate(model, [1, 2, 3], 4, 12, torch.Generator().manual_seed(0))
    assert len(out) == 4 and all(len(row) == 15 for row in out)
    assert max(max(row) for row in out) < GPT2_VOCAB


def no_cache_sample(model, prompt, num_samples, max_new_tokens, generator, top_k):
    """generate() without a KV cache: the whole sequence goes through the model for each new token."""
    idx = torch.tensor(prompt).repeat(num_samples, 1)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            probs = model(idx)[0][:, -1].float().softmax(-1)
            if top_k == 1:
                nxt = probs.argmax(-1, keepdim=True)
            else:
                top_probs, top_ids = probs.topk(top_k, dim=-1)
                nxt = top_ids.gather(-1, torch.multinomial(top_probs, 1, generator=generator))
            idx = torch.cat([idx, nxt], dim=1)
    return idx.tolist()


@pytest.mark.parametrize("attn", ["sdpa", "naive"])
def test_kv_cache_matches_full_recompute(attn):
    model = tiny(attn=attn)
    seq = random_ids(2, 20, 128)
    with torch.no_grad():
        full, _ = model(seq)
        cache = [[] for _ in model.transformer.h]
        step_logits = [model(seq[:, :6], kv_cache=cache)[0]]
        for t in range(6, 20):
            step_logits.append(model(seq[:, t: t + 1], kv_cache=cache)[0])
    assert torch.allclose(torch.cat(step_logits, dim=1), full, atol=1e-5)
    prompt = [5, 17, 99]
    greedy = generate(model, prompt, 2, 12, torch.Generator().manual_seed(0), top_k=1)
    assert greedy == no_cache_sample(model, prompt, 2, 12, None, top_k=1)
    sampled = generate(model, prompt, 3, 12, torch.Generator().manual_seed(7))
    assert sampled == no_cache_sample(model, prompt, 3, 12, torch.Generator().manual_seed(7), top_k=50)
    assert len(set(map(tuple, sampled))) > 1  # really sampled
    # past the position table's 32 rows the window slides (tests/test_samples.py): all 100 tokens, after the prompt
    longer = generate(model, prompt, 1, 100, torch.Generator().manual_seed(0))
    assert len(longer[0]) == 3 + 100 and longer[0][:3] == prompt


@pytest.mark.parametrize("recipe", ["gpt2", "modern"])
def test_the_parameters_said_leave_out_the_vocabularys_padding(recipe):
    """GPT-2 124M is 124,439,808 parameters as OpenAI counts them (its 50,257 tokens): padded to 50,304 for speed, the
    run says the same, so that a model trained unpadded and loaded back padded (--init-from DIR) counts alike."""
    with torch.device("meta"):
        counts = {vocab: run_log.parameters(train_gpt2.RECIPES[recipe].model(GPTConfig(
            block_size=1024, vocab_size=vocab, n_layer=12, n_head=12, n_embd=768, recipe=recipe)))
            for vocab in (GPT2_VOCAB, 50304)}
    assert counts[GPT2_VOCAB] == counts[50304]
    if recipe == "gpt2":
        assert counts[50304] == 124_439_808
