"""
Each recipe's model as a class of transformers, both ways (a machinery/hf_format.py Format, which settings.Recipe's
hf_format holds): GPT-2's recipe as GPT2LMHeadModel, the modern recipe's as NanoChatForCausalLM (transformers 5.0 and
later). A layout names the weights as that class does, writes its config.json, and reads such a directory back (OpenAI's
own GPT-2 among them) into the model settings that our recipe computes alike, refusing in one line a model it would
compute otherwise. hf_format.py writes and reads the files themselves.
"""

import functools
import json
import re

from machinery.errors import UsageError
from machinery.hf_format import Format, check_computes_as_ours, read_config, read_weights, shape_fields
from machinery.tokenizer import EOT

# -----------------------------------------------------------------------------
# GPT-2's recipe as GPT2LMHeadModel

# the weights OpenAI's Conv1D stores (in, out), where nn.Linear has (out, in)
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def gpt2_layout(state_dict, n_tokens):
    """train_gpt2.py's GPT-2 weights in GPT-2's Hugging Face layout, as GPT.from_pretrained reads them: the Conv1D
    weights (in, out) again, the first n_tokens token rows alone (the padding past GPT-2's 50257 is never scored),
    and no lm_head, which is the token embedding."""
    weights = {}
    for key, tensor in state_dict.items():
        if key == "lm_head.weight":
            continue
        if key.endswith(CONV1D):
            tensor = tensor.t()
        if key == "transformer.wte.weight":
            tensor = tensor[:n_tokens]
        weights[key] = tensor.contiguous()  # safetensors stores whole, dense tensors
    return weights


def load_gpt2_layout(path, state_dict, n_tokens, name, fix):
    """The weights of the safetensors file at path, in GPT-2's Hugging Face layout (OpenAI's own, or an export's),
    copied into train_gpt2.py's GPT-2 state_dict: the inverse of gpt2_layout. The token rows past n_tokens (padding)
    are zeroed. Refuses, in one line that names path and ends with fix, a file that is not GPT-2 `name`'s whole."""
    weights = read_weights(path, fix)
    loaded = set()
    state_dict["transformer.wte.weight"].zero_()  # the rows past OpenAI's 50257 are padding: never used or scored
    for key, tensor in weights.items():
        key = "transformer." + key.removeprefix("transformer.")
        if key.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers, not weights
            continue
        if key not in state_dict:
            raise UsageError(f"{path}: unexpected tensor {key}; is it a GPT-2 checkpoint?")
        if key.endswith(CONV1D):  # OpenAI's Conv1D stores (in, out); nn.Linear wants (out, in)
            tensor = tensor.t()
        # all of GPT-2's token rows, n_tokens of them: a file with fewer would leave tokens at zero
        target = state_dict[key][:n_tokens] if key == "transformer.wte.weight" else state_dict[key]
        if target.shape != tensor.shape:
            raise UsageError(f"{path}: {key} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)} for "
                             f"{name}")
        target.copy_(tensor)
        loaded.add(key)
    missing = set(state_dict) - loaded - {"lm_head.weight"}  # lm_head is tied to wte
    if missing:
        raise UsageError(f"{path} lacks {sorted(missing)[:3]}...; {fix}")


def gpt2_config(shape, model_config, dtype, layer_norm_eps):
    """config.json of GPT2LMHeadModel. A vocabulary smaller than GPT-2's (a toy model's --vocab-size 128) has no
    <|endoftext|>, so it names no bos or eos token (transformers warns of one beyond the vocabulary)."""
    eot = EOT if shape["vocab_size"] > EOT else None
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "n_layer": shape["n_layer"], "n_head": shape["n_head"], "n_embd": shape["n_embd"],
        "n_inner": None,  # None: 4 * n_embd
        "n_positions": shape["block_size"], "n_ctx": shape["block_size"], "vocab_size": shape["vocab_size"],
        "activation_function": "gelu_new",  # GELU's tanh approximation, as GPT-2 and train_gpt2.py have it
        "layer_norm_epsilon": layer_norm_eps, "initializer_range": 0.02,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,  # trained without dropout: fine-tune it the same
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "bos_token_id": eot, "eos_token_id": eot, "tie_word_embeddings": True, "use_cache": True,
        "torch_dtype": dtype, "dtype": dtype,  # transformers 4 reads the first, 5 the second
    }


def gpt2_settings(config, path, layer_norm_eps):
    """The model settings of a GPT2LMHeadModel's config.json, ours or one from the Hub (OpenAI's own among them), whose
    layer norms must be ours (layer_norm_eps)."""
    try:
        shape = shape_fields(config, path, ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size"))
    except KeyError as e:
        raise UsageError(f"{path}: not the config.json of a Hugging Face GPT-2 (KeyError: {e})")
    n_embd = shape["n_embd"]
    activation = config.get("activation_function", "gelu_new")
    found = {"activation_function": {"gelu_pytorch_tanh": "gelu_new"}.get(activation, activation),  # the same GELU
             "n_inner": config.get("n_inner") or 4 * n_embd,
             "layer_norm_epsilon": config.get("layer_norm_epsilon", 1e-5),  # GPT2Config's default
             "scale_attn_weights": config.get("scale_attn_weights", True),
             "scale_attn_by_inverse_layer_idx": config.get("scale_attn_by_inverse_layer_idx", False),
             "tie_word_embeddings": config.get("tie_word_embeddings", True)}
    ours = {"activation_function": "gelu_new", "n_inner": 4 * n_embd, "layer_norm_epsilon": layer_norm_eps,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "tie_word_embeddings": True}
    check_computes_as_ours(found, ours, path, "GPT-2")
    return shape


def gpt2_shape(directory, layer_norm_eps):
    """The model settings of a Hugging Face GPT-2's directory (GPT.from_pretrained's, given no config)."""
    return gpt2_settings(*read_config(directory, "a Hugging Face GPT-2"), layer_norm_eps)


def gpt2_about(shape, model_config, n_params):
    return (f"A GPT-2 ({shape['n_layer']} layers, {shape['n_head']} heads, width {shape['n_embd']}, context of "
            f"{shape['block_size']} tokens), {n_params:,} parameters ({n_params / 1e6:.2f}M; the output layer is the "
            f"token embedding).")


def gpt2(layer_norm_eps):
    """The Format of train_gpt2.py's model, whose layer norms add layer_norm_eps to the variance."""
    return Format(architecture="GPT2LMHeadModel", model_type="gpt2", needs="", layout=gpt2_layout,
                  load_layout=load_gpt2_layout, config=functools.partial(gpt2_config, layer_norm_eps=layer_norm_eps),
                  model_settings=functools.partial(gpt2_settings, layer_norm_eps=layer_norm_eps), about=gpt2_about)


# -----------------------------------------------------------------------------
# The modern recipe as NanoChatForCausalLM

# modern.py's names of a block's weights, and NanoChatForCausalLM's (its c_attn is theirs q_proj, k_proj, v_proj)
NANOCHAT_NAMES = {"attn.c_proj": "self_attn.o_proj", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}


def nanochat_views(state_dict, n_tokens):
    """{name in NanoChatForCausalLM's layout: the view of modern.py's tensor it is}, the one map both ways. Only the
    first n_tokens rows of the embedding and the head: theirs has no mask to keep the padding ids out of the softmax."""
    views = {"model.embed_tokens.weight": state_dict["transformer.wte.weight"][:n_tokens],
             "lm_head.weight": state_dict["lm_head.weight"][:n_tokens]}
    for key, tensor in state_dict.items():
        if key.startswith("transformer.h."):
            layer, name = re.fullmatch(r"transformer\.h\.(\d+)\.(\w+\.\w+)\.weight", key).groups()
            prefix = f"model.layers.{layer}."
            if name == "attn.c_attn":  # the queries, keys and values in one matmul, theirs in three
                views.update({f"{prefix}self_attn.{part}.weight": rows
                              for part, rows in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3))})
            else:
                views[f"{prefix}{NANOCHAT_NAMES[name]}.weight"] = tensor
    return views


def nanochat_layout(state_dict, n_tokens):
    """modern.py's weights in NanoChatForCausalLM's layout; copies, as safetensors stores no two views of one tensor."""
    return {key: view.clone() for key, view in nanochat_views(state_dict, n_tokens).items()}


def load_nanochat_layout(path, state_dict, n_tokens, name, fix):
    """The weights of a NanoChatForCausalLM's safetensors file at path into modern.py's state_dict, its token rows
    past n_tokens (padding) zeroed. Refuses, in one line, a file that is not `name`'s whole."""
    weights, views = read_weights(path, fix), nanochat_views(state_dict, n_tokens)
    unexpected, missing = sorted(set(weights) - set(views)), sorted(set(views) - set(weights))
    if unexpected or missing:
        what = f"unexpected tensor {unexpected[0]}" if unexpected else f"lacks {missing[0]}"
        raise UsageError(f"{path}: {what}; {fix}")
    state_dict["transformer.wte.weight"].zero_()  # the padding rows: never used or scored
    state_dict["lm_head.weight"].zero_()
    for key, view in views.items():
        if view.shape != weights[key].shape:
            raise UsageError(f"{path}: {key} has shape {tuple(weights[key].shape)}, expected {tuple(view.shape)} for "
                             f"{name}")
        view.copy_(weights[key])


def nanochat_config(shape, model_config, dtype, rope_theta, rms_norm_eps):
    """config.json of NanoChatForCausalLM, whose forward pass is modern.py's: the QK-norm after the rotation (ours
    before it: a norm with no weight commutes with a rotation), the same pairs of halves turned the same way, the
    norms' epsilon ours in float32, the soft-cap ours. No pad token: its embedding would never train that row."""
    eot = EOT if shape["vocab_size"] > EOT else None
    return {
        "architectures": ["NanoChatForCausalLM"], "model_type": "nanochat",
        "num_hidden_layers": shape["n_layer"], "num_attention_heads": shape["n_head"],
        "num_key_value_heads": shape["n_head"], "hidden_size": shape["n_embd"],
        "intermediate_size": 4 * shape["n_embd"], "max_position_embeddings": shape["block_size"],
        "vocab_size": shape["vocab_size"], "hidden_act": "relu2", "rms_norm_eps": rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "final_logit_softcapping": model_config["logit_softcap"], "attention_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "initializer_range": 0.02, "bos_token_id": eot, "eos_token_id": eot,
        "pad_token_id": None, "use_cache": True, "dtype": dtype,
    }


def nanochat_settings(config, path, rope_theta, rms_norm_eps):
    """The model settings of a NanoChatForCausalLM's config.json, ours or one from the Hub."""
    try:
        shape = shape_fields(config, path, ("num_hidden_layers", "num_attention_heads", "hidden_size",
                                            "max_position_embeddings", "vocab_size"))
    except KeyError as e:
        raise UsageError(f"{path}: not the config.json of a NanoChatForCausalLM (KeyError: {e})")
    hidden, heads = shape["n_embd"], shape["n_head"]
    cap = config.get("final_logit_softcapping", 15.0)  # NanoChatConfig's default, for a config.json without it
    if not (isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0):  # None: no soft-cap
        raise UsageError(f"{path}: final_logit_softcapping is {cap!r}, and train_gpt2.py's modern recipe soft-caps "
                         f"its logits always; it cannot load this model")
    rope = config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0)}
    if not isinstance(rope, dict):
        raise UsageError(f"{path}: rope_parameters is {json.dumps(rope)}, not an object such as "
                         f"{json.dumps({'rope_type': 'default', 'rope_theta': rope_theta})}; correct it, or export "
                         f"the model again")
    found = {"hidden_act": config.get("hidden_act", "relu2"),
             "intermediate_size": config.get("intermediate_size", 8192),
             "num_key_value_heads": config.get("num_key_value_heads") or heads,
             "head_dim": config.get("head_dim") or hidden // heads,
             "attention_bias": config.get("attention_bias", False),
             "tie_word_embeddings": config.get("tie_word_embeddings", False),
             "rms_norm_eps": config.get("rms_norm_eps", 1e-6),  # transformers' default; ours is float32's epsilon
             "rope_parameters": (rope.get("rope_type", "default"), rope.get("rope_theta"))}
    ours = {"hidden_act": "relu2", "intermediate_size": 4 * hidden, "num_key_value_heads": heads,
            "head_dim": hidden // heads, "attention_bias": False, "tie_word_embeddings": False,
            "rms_norm_eps": rms_norm_eps, "rope_parameters": ("default", rope_theta)}
    check_computes_as_ours(found, ours, path, "modern recipe")
    if hidden // heads % 2:  # its rotary positions turn a head's values in pairs
        raise UsageError(f"{path}: hidden_size {hidden} / num_attention_heads {heads} = head size {hidden // heads}, "
                         f"and train_gpt2.py's modern recipe turns queries and keys in pairs of values (rotary "
                         f"positions), which needs an even head size; it cannot load this model")
    return dict(shape, logit_softcap=float(cap))


def nanochat_about(shape, model_config, n_params):
    cap = model_config["logit_softcap"]
    return (f"A GPT of train_gpt2.py's modern recipe (`--recipe modern`: rotary positions, QK-norm, RMSNorm with no "
            f"weights, ReLU², no biases, an untied output layer, logits soft-capped at {cap:g}), {shape['n_layer']} "
            f"layers, {shape['n_head']} heads, width {shape['n_embd']}, context of "
            f"{shape['block_size']} tokens, {n_params:,} parameters ({n_params / 1e6:.2f}M). transformers computes it "
            f"as its own `NanoChatForCausalLM`: no code of train_gpt2.py comes with it.")


def nanochat(rope_theta, rms_norm_eps):
    """The Format of modern.py's model, which turns its queries and keys by rotary frequencies from 1 down to about
    1/rope_theta, and normalizes with rms_norm_eps."""
    needs = ("transformers 5.0 or later, the first with `NanoChatForCausalLM` (`pip install -U "
             "\"transformers>=5.0\"`; an older one says it does not recognize `model_type` `nanochat`). Load it in "
             "float32, config.json's dtype: train_gpt2.py soft-caps the logits in float32, and transformers in the "
             "dtype it loads the model in")
    return Format(architecture="NanoChatForCausalLM", model_type="nanochat", needs=needs, layout=nanochat_layout,
                  load_layout=load_nanochat_layout,
                  config=functools.partial(nanochat_config, rope_theta=rope_theta, rms_norm_eps=rms_norm_eps),
                  model_settings=functools.partial(nanochat_settings, rope_theta=rope_theta, rms_norm_eps=rms_norm_eps),
                  about=nanochat_about)
