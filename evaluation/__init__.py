"""
The benchmarks a run scores. Each names its setting (EVERY), reads its data once (load_run), scores a run at its
step (evaluate_run), and gives its line of a model card (NAME, KEY, card_line).

- hellaswag: HellaSwag's validation set, by the completion with the lowest loss per token
- core_score: the DCLM CORE score, 22 tasks as nanochat computes it; core_bundle: its data, fetched, checked and read
"""
