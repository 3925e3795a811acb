"""
The commands of train_gpt2.py that train nothing: `--sample PATH` prints samples from a checkpoint, and
`--export-hf DIR` writes a checkpoint (or OpenAI's weights) as a Hugging Face model directory (hf_format.py). Neither
sets up a run. It never imports train_gpt2: what they need of it (the recipes, whose hf_format says which class of
transformers each one's model is; the benchmarks, whose lines the model card gives; model_of, which makes a model of a
checkpoint's settings; GPT.from_pretrained) is handed over.
"""

import contextlib
import os
import shlex
from dataclasses import asdict

from machinery import (
    checkpoints,
    checks,
    environment,
    files,
    hf_format,
    model_card,
    ranks,
    resume,
    run_log,
    settings,
    tokenizer,
)
from machinery.errors import UsageError


def sample(cfg, given, env, model_of, autocast_context, print_samples):
    """--sample PATH: prints samples from the checkpoint's model, and says which it is, as many at a time as its run's
    micro-batch (which fitted its training), or --batch-size if given. Under torchrun every rank samples, as
    print_samples asks of them, and rank 0 alone prints."""
    model, step, micro_batch = model_to_sample(cfg, env, model_of)
    rows = cfg.batch_size if "batch_size" in given or not micro_batch else micro_batch
    autocast_ctx = autocast_context(env.device_type, environment.resolve_dtype(cfg.dtype, env.device_type))
    print_samples(model, cfg, tokenizer.gpt2_tokenizer(), env.device, autocast_ctx, cfg.seed, step, rows,
                  show=env.rank == 0)


def model_to_sample(cfg, env, model_of):
    """The checkpoint of --sample PATH's model on this process's device, its step and its run's micro-batch (None if
    it kept none); rank 0 says which it is."""
    checks.require(cfg, ("num_samples", "max_new_tokens"), lambda v: v >= 0, "zero or more")
    checks.require(cfg, ("batch_size",), lambda v: v > 0, "positive")  # the samples made at a time
    with ranks.failing_together():
        try:
            ckpt = checkpoints.load(cfg.sample)
        except ValueError as e:
            raise UsageError(f"--sample {cfg.sample}: cannot load it as a checkpoint ({e})")
    damaged = checkpoints.damage(ckpt, cfg.sample, env.rank, env.world_size)
    if damaged:
        checkpoints.release(ckpt)
        raise UsageError(f"--sample {cfg.sample}: cannot load it as a checkpoint ({damaged})")
    model = checkpoints.model_from_checkpoint(ckpt, cfg.sample, model_of).to(env.device)
    if env.rank == 0:
        print(f"checkpoint of step {ckpt['step']} ({checkpoints.val_loss_in_words(ckpt)}), prompt {cfg.prompt!r}")
    return model, ckpt["step"], ckpt.get("micro_batch")


def export_hf(cfg, argv, recipes, benchmarks, model_of, from_pretrained):
    """--export-hf DIR: the latest checkpoint in --log-dir (or --resume's, or OpenAI's weights with --init-from) as a
    Hugging Face model directory, which transformers loads as its own class of the model's recipe (GPT-2's:
    GPT2LMHeadModel; the modern one's: NanoChatForCausalLM); on the CPU, in one process: under torchrun, rank 0 writes
    it, and the other ranks end at once (each writing it, all but one would fail, finding it written). Its model card
    gives each of benchmarks' scores (evaluation/'s modules) that the run logged at the checkpoint's step."""
    if environment.processes()[0] != 0:
        return
    files.refuse_unless_new_directory(cfg.export_hf, "--export-hf")  # now, not after a long load
    if cfg.init_from != "scratch" and os.path.isdir(cfg.init_from):
        raise UsageError(f"--export-hf: --init-from {cfg.init_from} is a Hugging Face model directory already; copy "
                         f"it, or export a checkpoint of a run that starts from it")
    if cfg.init_from != "scratch":
        model = from_pretrained(cfg.init_from, cache_dir=cfg.cache_dir or None)
        source, about = f"OpenAI's {cfg.init_from}", model_card.published_facts(cfg.init_from)
        scores = [(b.NAME, b.card_line(None, published=cfg.init_from)) for b in benchmarks]
    else:
        ckpt, source = resume.find_resume_checkpoint(cfg, rank=0, world_size=1)  # one process: on the CPU
        if ckpt is None:
            raise UsageError(f"--export-hf {cfg.export_hf}: no checkpoint in --log-dir {cfg.log_dir}; pass the "
                             f"run's --log-dir, --resume PATH, or --init-from gpt2")
        model = checkpoints.model_from_checkpoint(ckpt, source, model_of)
        init_from = ckpt["train_config"]["init_from"]
        about = model_card.checkpoint_facts(source, ckpt["step"], ckpt["train_config"],
                                            checkpoints.val_loss_in_words(ckpt),
                                            None if init_from == "scratch"
                                            else settings.pretrained_in_words(init_from, model_card.name_only))
        scores = [(b.NAME, b.card_line(logged_evaluation(source, ckpt["step"], b.KEY))) for b in benchmarks]
    fmt = recipes[model.config.recipe].hf_format
    n_params = hf_format.export(cfg.export_hf, fmt, model.state_dict(), asdict(model.config), model.n_tokens,
                                dict(about, scores=scores, command=command_in_card(argv)))
    print(f"exported {source} to {cfg.export_hf}: a {fmt.architecture} of {n_params / 1e6:.2f}M parameters for Hugging "
          f"Face's transformers (AutoModelForCausalLM.from_pretrained({cfg.export_hf!r}))")


def command_in_card(argv):
    """The export's command line as its model card records it: each absolute path (given alone, or as --flag=PATH)
    by its last part, model_card.name_only's (--log-dir /home/alice/runs/run1 as --log-dir run1)."""
    # The card is published with the model: the directories of the user's machine mean nothing to its readers and may
    # name the user, while the names of the run, its checkpoint and the export say which they were. Relative paths
    # are kept as typed: from where the user stood, they are the user's own naming, not the machine's layout.
    def shown(arg):
        flag, equals, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        return flag + equals + (model_card.name_only(value) if os.path.isabs(value) else value)

    return shlex.join(["python", "train_gpt2.py", *map(shown, argv)])


def logged_evaluation(checkpoint, step, key):
    """The record holding key (a benchmark's KEY) that the run logged of the weights at step (its log.jsonl,
    beside the checkpoint): the latest, or None. --eval-only's of another checkpoint of that step is not theirs."""
    log = os.path.join(os.path.dirname(os.path.normpath(checkpoint)), run_log.LOG_FILE)
    records = []
    with contextlib.suppress(OSError):
        records = [record for _, record in files.json_records(log) if record is not None]  # None: a damaged line
    measured = [record for record in records if record.get("step") == step and key in record
                and record.get("init_from", checkpoint) == checkpoint]
    return measured[-1] if measured else None
