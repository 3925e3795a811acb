"""
GPT-2's tokenizer, from the shipped gpt2.tiktoken (tiktoken's r50k_base): no network needed. The same ranks give the
tokenizer's files that an export holds for transformers: vocab.json and merges.txt (the merges recovered from the
ranks), tokenizer.json, tokenizer_config.json and special_tokens_map.json.
"""

import functools
import json
import os

import tiktoken
from tiktoken.load import load_tiktoken_bpe

HERE = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # the repository, where gpt2.tiktoken is

GPT2_VOCAB = 50257  # tokens of the GPT-2 tokenizer
EOT = 50256  # <|endoftext|>, which separates documents
EOT_TEXT = "<|endoftext|>"
GPT2_BPE_FILE = os.path.join(HERE, "gpt2.tiktoken")  # GPT-2's BPE ranks, shipped (tiktoken's r50k_base)


@functools.cache
def gpt2_tokenizer():
    """The GPT-2 BPE from the shipped gpt2.tiktoken (tiktoken's r50k_base): no network needed. Read once per process:
    parsing its 50,000 ranks takes a noticeable fraction of a second, and evaluations and samples ask for it often."""
    ranks = load_tiktoken_bpe(GPT2_BPE_FILE)
    pattern = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    return tiktoken.Encoding("r50k_base", pat_str=pattern, mergeable_ranks=ranks, special_tokens={EOT_TEXT: EOT})


# -----------------------------------------------------------------------------
# The tokenizer's files for transformers


def byte_stand_ins():
    """GPT-2's printable character for each byte: vocab.json and merges.txt hold tokens as text, where a space,
    which separates the two halves of a merge, or a control byte cannot stand for itself. Printable bytes keep their
    own character; the others take the characters from 256 on (the space becomes "Ġ")."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = (b for b in range(256) if b not in printable)
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def bpe_parts(token, ranks, max_rank):
    """The parts that byte-pair merging of token's bytes ends with, using only the merges ranked below max_rank."""
    parts = [bytes([b]) for b in token]
    while True:
        pairs = [(ranks.get(a + b, max_rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs, default=(max_rank, 0))
        if rank >= max_rank:
            return parts
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def recover_merges(ranks):
    """GPT-2's merges in priority order, from its BPE ranks: each token of several bytes, in rank order, is the merge
    of the two parts that merging its bytes with the lower ranks alone ends with."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            left, right = bpe_parts(token, ranks, rank)  # two: the token itself is the next merge
            merges.append((left, right))
    return merges


EOT_SPEC = {"content": EOT_TEXT, "single_word": False, "lstrip": False, "rstrip": False, "normalized": True,
            "special": True}


@functools.cache  # the same for every export, and a second or more of work: made once in a process
def bpe_files():
    """{file name: contents} of GPT-2's byte-pair encoding, from the shipped BPE ranks: vocab.json and merges.txt (what
    GPT2Tokenizer reads), and the same in tokenizer.json (what the `tokenizers` library reads)."""
    ranks = load_tiktoken_bpe(GPT2_BPE_FILE)
    stand_in = byte_stand_ins()

    def text(token):
        return "".join(stand_in[b] for b in token)

    vocab = {**{text(token): rank for token, rank in ranks.items()}, EOT_TEXT: EOT}
    merges = [f"{text(left)} {text(right)}" for left, right in recover_merges(ranks)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [{"id": EOT, **EOT_SPEC}],
        "normalizer": None,
        "pre_tokenizer": byte_level,  # with use_regex, GPT-2's split into words (tokenizer.py's pattern) comes first
        "post_processor": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                  "merges": merges},
    }
    return {
        "vocab.json": json.dumps(vocab, ensure_ascii=False),
        "merges.txt": "#version: 0.2\n" + "\n".join(merges) + "\n",
        "tokenizer.json": json.dumps(tokenizer, ensure_ascii=False),
    }


def tokenizer_files(block_size):
    """{file name: contents} of GPT-2's tokenizer: its byte-pair encoding (bpe_files), the context length, and the
    special token."""
    special = {"bos_token": EOT_TEXT, "eos_token": EOT_TEXT, "unk_token": EOT_TEXT}
    tokenizer_config = {
        "tokenizer_class": "GPT2Tokenizer", **special, "add_prefix_space": False, "add_bos_token": False,
        "model_max_length": block_size, "errors": "replace",
        "clean_up_tokenization_spaces": False,  # decoding gives the text back as it was, " ." and " 's" included
        "added_tokens_decoder": {str(EOT): EOT_SPEC},
    }
    return {**bpe_files(), "tokenizer_config.json": json.dumps(tokenizer_config, indent=2),
            "special_tokens_map.json": json.dumps(special, indent=2)}
