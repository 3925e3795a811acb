"""
GPT-2's tokenizer, from the shipped gpt2.tiktoken (tiktoken's r50k_base): no network needed.
"""

import functools
import os

import tiktoken
from tiktoken.load import load_tiktoken_bpe

HERE = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # the repository, where gpt2.tiktoken is

GPT2_VOCAB = 50257  # tokens of the GPT-2 tokenizer
EOT = 50256  # <|endoftext|>, which separates documents
GPT2_BPE_FILE = os.path.join(HERE, "gpt2.tiktoken")  # GPT-2's BPE ranks, shipped (tiktoken's r50k_base)


@functools.cache
def gpt2_tokenizer():
    """The GPT-2 BPE from the shipped gpt2.tiktoken (tiktoken's r50k_base): no network needed. Read once per process:
    parsing its 50,000 ranks takes a noticeable fraction of a second, and evaluations and samples ask for it often."""
    ranks = load_tiktoken_bpe(GPT2_BPE_FILE)
    pattern = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    return tiktoken.Encoding("gpt2", pat_str=pattern, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": EOT})
