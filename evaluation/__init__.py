"""
The benchmarks a run scores.

- hellaswag: HellaSwag's validation set, by the completion with the lowest loss per token
- core_score: the DCLM CORE score, 22 tasks as nanochat computes it
"""
