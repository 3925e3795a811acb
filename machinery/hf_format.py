"""
A model as a Hugging Face model directory, which `transformers` loads offline with from_pretrained as a class of its
own, with no code of ours: the machinery of `train_gpt2.py --export-hf`, which teaches nothing about the models, and of
its inverse, `--init-from DIR` (and GPT.from_pretrained, which also reads OpenAI's weights).
A recipe's Format (settings.Recipe's hf_format; variations/hf_layouts.py has each recipe's) says which class its model
is and how the files lay it out. train_gpt2.py hands over the model's state dict, its config and the facts of its model
card; this module writes

- model.safetensors (the weights in the class's layout), config.json and generation_config.json;
- the tokenizer files, made from the shipped gpt2.tiktoken with no network (tokenizer.py);
- README.md, the model card (model_card.py);

into a new directory beside the one asked for, renamed into place once whole (files.write_directory). It needs json
and safetensors only, never transformers, and never imports train_gpt2 (which imports it).
"""

import json
import os
import re
from typing import Callable, NamedTuple

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from machinery import files, model_card, tokenizer
from machinery.errors import UsageError
from machinery.tokenizer import EOT, GPT2_VOCAB

# -----------------------------------------------------------------------------
# A model as a class of transformers: its Format, and its config.json read and checked


class Format(NamedTuple):
    """A recipe's model as a class of transformers (settings.Recipe's hf_format): which class, and its files' layout
    both ways: --export-hf writes it, --init-from DIR reads it."""
    architecture: str  # transformers' class, which config.json names
    model_type: str  # config.json's: transformers picks the class by it, and --init-from DIR the recipe
    needs: str  # the model card's line on the transformers that loads it ("": any)
    layout: Callable  # (state_dict, n_tokens) -> the weights as the class names them, the first n_tokens token rows
    load_layout: Callable  # (path, state_dict, n_tokens, name, fix): such a file's weights into train_gpt2.py's
    config: Callable  # (shape, model_config, dtype) -> config.json
    model_settings: Callable  # (config.json, its path) -> the model settings it fixes; refuses one ours cannot compute
    about: Callable  # (shape, model_config, n_params) -> the model card's first sentence: what the model is


def read_weights(path, fix):
    try:
        return load_file(path)
    except Exception as e:
        raise UsageError(f"{path} is not a readable safetensors file ({e}); {fix}")


def read_config(directory, what):
    """An export directory's config.json, and its path; refused in one line if it is not a JSON object."""
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            config = files.parse_json(f.read())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
        return config, path
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: not the config.json of {what} ({type(e).__name__}: {e})")


def check_computes_as_ours(found, ours, path, model):
    """Refuses, in one line, a config.json whose model computes otherwise than ours: found and ours map its fields to
    the values they mean (transformers' default where it is missing)."""
    for key, value in found.items():
        if value != ours[key]:
            raise UsageError(f"{path}: {key} is {value!r}, and train_gpt2.py's {model} has {ours[key]!r}; it loads "
                             f"only a model it computes as transformers does (edit config.json to {ours[key]!r} if "
                             f"you accept the difference)")


def is_whole(value):
    return isinstance(value, int) and not isinstance(value, bool)  # JSON's true is no number of layers


def real_tokens(vocab_size, path):
    if not (is_whole(vocab_size) and 0 < vocab_size <= GPT2_VOCAB):
        raise UsageError(f"{path}: vocab_size {json.dumps(vocab_size)} is not GPT-2's vocabulary (at most "
                         f"{GPT2_VOCAB:,} ids); train_gpt2.py tokenizes with GPT-2's BPE alone")
    return vocab_size


def shape_fields(config, path, names):
    """The model settings n_layer, n_head, n_embd, block_size, vocab_size from the config.json at path, whose
    fields names gives in that order: each a positive whole number, the heads dividing the width evenly; refused in
    one line that names the field and its value as the file writes it. Raises KeyError for a missing field."""
    values = [config[name] for name in names]
    for name, value in zip(names[:4], values):
        if not (is_whole(value) and value > 0):
            raise UsageError(f"{path}: {name} is {json.dumps(value)}, not a positive whole number; correct it, or "
                             f"export the model again")
    n_layer, n_head, n_embd, block_size, vocab_size = values
    if n_embd % n_head:
        raise UsageError(f"{path}: {names[2]} {n_embd} is not a multiple of {names[1]} {n_head} (the heads share the "
                         f"width evenly); correct it, or export the model again")
    return dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size,
                vocab_size=real_tokens(vocab_size, path))


# -----------------------------------------------------------------------------
# The export


def generation_config(vocab_size, block_size):
    """Sampling as train_gpt2.py's samples do it: top-k 50 from the softmax, to the end of the model's context at
    most. Without max_length, transformers' text-generation pipeline adds 256 new tokens to any prompt, past the
    positions of a smaller context (the Shakespeare preset's 256), where GPT-2's position table has no row."""
    eot = EOT if vocab_size > EOT else None
    return {"do_sample": True, "top_k": 50, "max_length": block_size, "bos_token_id": eot, "eos_token_id": eot,
            "pad_token_id": eot}


def save_weights(weights, path):
    """Writes weights (a dict of tensors) to the safetensors file at path; an I/O error is raised as an OSError of
    its errno, which safetensors' own SafetensorError gives only in its text ("No space left on device (os error
    28)")."""
    try:
        save_file(weights, path, metadata={"format": "pt"})  # transformers refuses a file without "format"
    except SafetensorError as e:
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), path) from e


def export(out_dir, fmt, state_dict, config, n_tokens, about):
    """Writes out_dir as the Hugging Face model of Format fmt: the weights of train_gpt2.py's state_dict in its
    layout, the shapes of its model config (dict) with its first n_tokens token ids (the padding rows are left out),
    GPT-2's tokenizer, and a model card of about (model_card.model_card's: the facts, the benchmarks' lines, the
    command). Returns the number of parameters."""
    weights = fmt.layout(state_dict, n_tokens)
    shape = dict({k: config[k] for k in ("n_layer", "n_head", "n_embd", "block_size")}, vocab_size=n_tokens)
    dtype = str(next(iter(weights.values())).dtype).removeprefix("torch.")
    n_params = sum(tensor.numel() for tensor in weights.values())

    def fill(directory):
        path = os.path.join(directory, "model.safetensors")
        save_weights(weights, path)
        os.chmod(path, os.stat(directory).st_mode & 0o666)  # safetensors makes it private: the umask's, as the rest
        files.sync_file(path)
        files.write_text(directory, "config.json", json.dumps(fmt.config(shape, config, dtype), indent=2))
        generation = generation_config(shape["vocab_size"], shape["block_size"])
        files.write_text(directory, "generation_config.json", json.dumps(generation, indent=2))
        for name, contents in tokenizer.tokenizer_files(shape["block_size"]).items():
            files.write_text(directory, name, contents)
        files.write_text(directory, "README.md", model_card.model_card(fmt, shape, config, n_params, about))

    files.write_directory(out_dir, fill, "--export-hf", "an export")
    return n_params
