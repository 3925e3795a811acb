"""
The run's machinery for any recipe, which train_gpt2.py calls by plain names. It imports nothing outside this folder,
and names no recipe and no benchmark: what one recipe or benchmark needs is handed over (tests/test_structure.py).

- the settings: settings (declaring one; Recipe), presets (what a kind of run changes), resolution (the layers in
  order, then frozen), checks (the refusals); environment: torchrun's variables, the device, the precision
- the run: run_state (Run: where it stands, and what moves it on), run_log (what it prints and logs),
  log_directory (its lock; an old run moved aside), signals (SIGTERM, SIGINT), microbatch (the micro-batch that fits),
  memory (what a process has, and running out), step_memory (what a step needs)
- checkpoints (what one holds; its files, written whole) and resume (which one, put back); sharded_checkpoints:
  --fsdp's slices; fsdp: sharding with FSDP2
- hf_format (a model as a Hugging Face directory), model_card; checkpoint_commands: --sample and --export-hf
- ranks: how the processes agree; files: written whole, read back, JSON; locks; downloads: the one downloader;
  tokenizer: GPT-2's BPE and its files; shard_files: the token shards; errors: the one-line errors
"""
