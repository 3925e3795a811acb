"""
What a reader compares with GPT-2's recipe in train_gpt2.py, or what a recipe swaps in or exports through.

- modern: --recipe modern, what the field has learnt since (rotary positions, RMSNorm, ReLU², Muon and its sharded
  form, ...)
- hf_layouts: each recipe's model as a class of transformers, both ways (GPT2LMHeadModel, NanoChatForCausalLM)
- losses: --loss chunked, a chunk of rows at a time, and the modern recipe's soft-cap
- speedups: off until a GPU ranks them: --coordinate-descent, --fp8-head
"""
