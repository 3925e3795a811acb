"""
The commands of train_gpt2.py that train nothing: `--sample PATH` prints samples from a checkpoint, and
`--export-hf DIR` writes a checkpoint (or OpenAI's weights) as a Hugging Face model directory (hf_export.py). Neither
sets up a run. It never imports train_gpt2: what they need of it (model_of, which makes a model of a checkpoint's
settings; GPT.from_pretrained) is handed over.
"""

import os
import shlex
from dataclasses import asdict

import checkpoints
import hf_export
import plumbing
import settings
from plumbing import UsageError


def sample(cfg, env, model_of, autocast_context, print_samples):
    """--sample PATH: prints samples from the checkpoint's model, and says which it is. Under torchrun every rank
    samples, as print_samples asks of them, and rank 0 alone prints."""
    model, step = model_to_sample(cfg, env, model_of)
    autocast_ctx = autocast_context(env.device_type, settings.resolve_dtype(cfg.dtype, env.device_type))
    print_samples(model, cfg, plumbing.gpt2_tokenizer(), env.device, autocast_ctx, cfg.seed, step, cfg.batch_size,
                  show=env.rank == 0)


def model_to_sample(cfg, env, model_of):
    """The checkpoint of --sample PATH's model on this process's device, and its step; rank 0 says which it is."""
    settings.require(cfg, ("num_samples", "max_new_tokens"), lambda v: v >= 0, "zero or more")
    try:
        ckpt = checkpoints.load(cfg.sample)
    except ValueError as e:
        raise UsageError(f"--sample {cfg.sample}: cannot load it as a checkpoint ({e})")
    model = checkpoints.model_from_checkpoint(ckpt, cfg.sample, model_of).to(env.device)
    if env.rank == 0:
        print(f"checkpoint of step {ckpt['step']} ({checkpoints.val_loss_in_words(ckpt)}), prompt {cfg.prompt!r}")
    return model, ckpt["step"]


def export_hf(cfg, argv, model_of, from_pretrained):
    """--export-hf DIR: the latest checkpoint in --log-dir (or --resume's, or OpenAI's weights with --init-from) as a
    Hugging Face model directory, which transformers loads as a GPT-2; on the CPU, in one process: under torchrun,
    rank 0 writes it, and the other ranks end at once (each writing it, all but one would fail, finding it written)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    hf_export.check_new_directory(cfg.export_hf)  # now, not after a long load
    if cfg.init_from != "scratch":
        model = from_pretrained(cfg.init_from, cache_dir=cfg.cache_dir or None)
        source, about = f"OpenAI's {cfg.init_from}", hf_export.published_facts(cfg.init_from)
    else:
        ckpt, source = checkpoints.find_resume_checkpoint(cfg, rank=0, world_size=1)  # one process: on the CPU
        if ckpt is None:
            raise UsageError(f"--export-hf {cfg.export_hf}: no checkpoint in --log-dir {cfg.log_dir}; pass the "
                             f"run's --log-dir, --resume PATH, or --init-from gpt2")
        if ckpt["model_config"]["recipe"] != "gpt2":  # transformers would load it as a GPT-2 that computes otherwise
            raise UsageError(f"--export-hf: {source} holds a model of --recipe {ckpt['model_config']['recipe']}, "
                             f"which GPT-2's Hugging Face format cannot hold; only GPT-2's recipe exports")
        model = checkpoints.model_from_checkpoint(ckpt, source, model_of)
        about = hf_export.checkpoint_facts(source, ckpt["step"], ckpt["train_config"],
                                           checkpoints.val_loss_in_words(ckpt))
    command = shlex.join(["python", "train_gpt2.py", *argv])
    n_params = hf_export.export(cfg.export_hf, model.state_dict(), asdict(model.config), model.n_tokens,
                                dict(about, command=command))
    print(f"exported {source} to {cfg.export_hf}: a GPT-2 of {n_params / 1e6:.2f}M parameters for Hugging Face's "
          f"transformers (AutoModelForCausalLM.from_pretrained({cfg.export_hf!r}))")

