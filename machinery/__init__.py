"""
The run's machinery, which train_gpt2.py calls by plain names; it imports nothing outside this folder.

- settings: the settings, their presets, flags and checks
- run_state: a training run, and what keeps it safe (signals, bad data, steps gone non-finite)
- checkpoints: what a checkpoint holds, saving, resuming; checkpoint_files: their files, whole or not at all;
  sharded_checkpoints: --fsdp's slices
- log_directory: the log directory, its lock, an old run moved aside; run_log: what a run prints and logs (log.jsonl,
  W&B, MFU)
- microbatch: the micro-batch that fits, and out-of-memory errors
- fsdp: --fsdp's sharding (FSDP2) and its Muon
- hf_format: the Hugging Face format, written and read; checkpoint_commands: --sample and --export-hf
- ranks: how the processes agree; files: JSON, atomic writes, locks; downloads; tokenizer: GPT-2's BPE;
  shard_files: the token shards; errors: the one-line errors
"""
