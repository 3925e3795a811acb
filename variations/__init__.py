"""
What a reader compares with GPT-2's recipe in train_gpt2.py.

- modern: --recipe modern, what the field has learnt since (rotary positions, RMSNorm, ReLU², Muon, ...)
- losses: the cross-entropies: the compiled full loss with a pointwise backward, and --loss chunked
- speedups: speed-ups off until a GPU ranks them: --coordinate-descent, --fp8-head
"""
