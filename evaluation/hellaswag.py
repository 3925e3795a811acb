"""
HellaSwag evaluation for GPT-2 style models: https://github.com/rowanz/hellaswag

Each example is a context and 4 possible endings, one of them right. The model
"picks" the ending it finds least surprising: we render context + ending for all
4 endings, run them through the model and compare the losses on the ending tokens.
- acc_norm: the ending with the lowest mean per-token loss (the number people quote:
  GPT-2 124M gets 0.2945, GPT-3 124M 0.337)
- acc: the ending with the lowest summed loss (favors short endings)

The evaluation takes any model that answers as train_gpt2.py's does, logits, loss = model(idx), with logits
(B, T, V). train_gpt2.py runs it during training (--hellaswag-every), and on a checkpoint or OpenAI's GPT-2 with
--eval-only:
    python train_gpt2.py --eval-only --init-from gpt2 --hellaswag-every 1
    python train_gpt2.py --eval-only --resume log/ckpt_019073.pt --hellaswag-every 1
"""

import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from machinery.downloads import default_cache_dir, download_once_per_node
from machinery.errors import BadFile, UsageError
from machinery.files import json_lines
from machinery.tokenizer import gpt2_tokenizer

# the validation split is the one everybody reports (the test split has no labels)
HELLASWAG_FILE = "hellaswag_val.jsonl"
HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data"
HELLASWAG_VAL_EXAMPLES = 10042
EVERY = "hellaswag_every"  # the training run's setting of the steps between its evaluations
NAME, KEY = "HellaSwag", "hellaswag_acc_norm"  # on a model card; the score its log records hold
EXAMPLES_PER_BATCH = 8  # x4 endings = 32 rows per forward pass


# -----------------------------------------------------------------------------
# the data: download once, check, read


def parse_examples(path, expected_count=None):
    """The examples of a HellaSwag jsonl file: one JSON object per line with ctx, 4 endings, label. Raises BadFile."""
    examples = []
    for line_number, example, error in json_lines(path):
        if isinstance(error, UnicodeDecodeError):
            raise BadFile(f"it is not UTF-8 text ({error})")
        if error is not None:
            raise BadFile(f"line {line_number} is not valid JSON ({error})")
        if not (isinstance(example, dict) and isinstance(example.get("ctx"), str)
                and isinstance(example.get("endings"), list) and len(example["endings"]) == 4
                and all(isinstance(ending, str) for ending in example["endings"])
                and type(example.get("label")) is int and 0 <= example["label"] <= 3):  # true is no label
            raise BadFile(f"line {line_number} is not a HellaSwag example: it needs a string 'ctx', "
                          f"a list of 4 string 'endings' and an integer 'label' in 0..3")
        examples.append(example)
    if not examples:
        raise BadFile("it has no examples")
    if expected_count is not None and len(examples) != expected_count:
        raise BadFile(f"it has {len(examples)} examples, expected {expected_count}")
    return examples


def read_examples(path, expected_count, fix):
    """parse_examples, with one-line errors that name the file and end with fix, what to do about it."""
    if not os.path.isfile(path):
        raise UsageError(f"HellaSwag file {path} not found: pass --hellaswag-file PATH to a copy of {HELLASWAG_FILE}")
    try:
        return parse_examples(path, expected_count)
    except BadFile as e:
        raise UsageError(f"HellaSwag file {path}: {e}; {fix}")
    except OSError as e:
        raise UsageError(f"cannot read HellaSwag file {path} ({e}); {fix}")


def load_examples(path=None, cache_dir=None):
    """The HellaSwag validation examples: from a local file if path is given, else downloaded once into cache_dir."""
    if path is not None:  # the user's copy may be a deliberate subset: it is not held to the full size
        return read_examples(path, None, f"fix it, or pass --hellaswag-file a good copy of {HELLASWAG_FILE}")
    base_url = os.environ.get("HELLASWAG_URL", HELLASWAG_URL).rstrip("/")
    cached_path = os.path.join(cache_dir or default_cache_dir(), HELLASWAG_FILE)
    # a mirror (HELLASWAG_URL) is held to the full size too: the cached file must be the one the numbers are quoted on
    download_once_per_node(f"{base_url}/{HELLASWAG_FILE}", cached_path,
                           lambda p: parse_examples(p, HELLASWAG_VAL_EXAMPLES), "HellaSwag file",
                           f"pass --hellaswag-file PATH (a local copy of {HELLASWAG_FILE})")
    return read_examples(cached_path, HELLASWAG_VAL_EXAMPLES, "delete it to download it again")


def load(path, cache_dir, block_size):
    """The validation examples, from path or downloaded into cache_dir (load_examples; "" for either: the default),
    tokenized once (prepare)."""
    return prepare(load_examples(path or None, cache_dir or None), gpt2_tokenizer(), block_size)


def load_run(cfg):
    """The examples of a training run's HellaSwag evaluations, per its settings (train_gpt2.py's TrainConfig)."""
    return load(cfg.hellaswag_file, cfg.cache_dir, cfg.block_size)


# -----------------------------------------------------------------------------
# tokenize once, into fixed-shape tensors


def prepare(examples, enc, block_size):
    """
    Tokenizes all examples once. Returns a dict of tensors, padded to one fixed row length L:
    tokens (N, 4, L): context + " " + ending, one row per ending, padded with end-of-text
    mask   (N, 4, L): True at the ending tokens, the ones we score
    labels (N,):      the index of the right ending
    Rows longer than block_size lose context tokens from the left, so that every ending fits.
    """
    rows, masks = [], []
    for example in examples:
        context = enc.encode_ordinary(example["ctx"])  # "<|endoftext|>" in the text is text, not the special token
        for ending in example["endings"]:
            # the space belongs to the ending: GPT-2's tokenizer attaches it to the next word
            ending_tokens = enc.encode_ordinary(" " + ending)
            row = (context + ending_tokens)[-block_size:]
            num_ending = min(len(ending_tokens), len(row))
            rows.append(row)
            masks.append([False] * (len(row) - num_ending) + [True] * num_ending)
    row_length = max(len(row) for row in rows)
    tokens = torch.full((len(rows), row_length), enc.eot_token, dtype=torch.long)  # (N*4, L)
    mask = torch.zeros((len(rows), row_length), dtype=torch.bool)  # (N*4, L)
    for i, (row, row_mask) in enumerate(zip(rows, masks)):
        tokens[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = torch.tensor(row_mask)
    labels = torch.tensor([example["label"] for example in examples], dtype=torch.long)  # (N,)
    return {"tokens": tokens.view(len(examples), 4, row_length), "mask": mask.view(len(examples), 4, row_length),
            "labels": labels}

# -----------------------------------------------------------------------------
# score


def ending_losses(model, tokens, mask):
    """
    Summed loss and token count over the ending tokens of each row.
    tokens, mask: (B, 4, L) on the model's device. Returns sum_loss (B, 4) float, num_tokens (B, 4).
    """
    B, _, L = tokens.shape
    tokens = tokens.view(B * 4, L)
    logits, _ = model(tokens)  # (B*4, L, V): a padded vocabulary's extra ids at -inf, out of the softmax
    V = logits.size(-1)
    # the logits at position t predict the token at t+1
    losses = F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), tokens[:, 1:].reshape(-1), reduction="none")
    losses = losses.view(B * 4, L - 1)
    target_mask = mask.view(B * 4, L)[:, 1:]  # (B*4, L-1)
    sum_loss = (losses * target_mask).sum(dim=1).view(B, 4)
    num_tokens = target_mask.sum(dim=1).view(B, 4)
    return sum_loss, num_tokens


def examples_per_batch(prepared, tokens):
    """As many examples per forward pass as fit in tokens (a training micro-batch's, which fits), up to
    EXAMPLES_PER_BATCH."""
    return max(1, min(EXAMPLES_PER_BATCH, tokens // (4 * prepared["tokens"].size(-1))))


def evaluate(model, prepared, device, autocast_ctx, rank=0, world_size=1, examples_per_batch=EXAMPLES_PER_BATCH):
    """
    HellaSwag accuracy of model on the prepared examples: returns (acc_norm, acc, n).
    The ranks split the examples (rank r takes every world_size-th) and all-reduce the counts.
    Every forward pass has the same shape (examples_per_batch*4, L), so a compiled model compiles once.
    """
    tokens, mask, labels = prepared["tokens"], prepared["mask"], prepared["labels"]
    num_examples = labels.size(0)
    my_examples = torch.arange(rank, num_examples, world_size)
    # every rank runs the same number of batches; the last ones are filled up with example 0, whose scores we drop
    num_batches = math.ceil(math.ceil(num_examples / world_size) / examples_per_batch)
    filler = torch.zeros(num_batches * examples_per_batch - len(my_examples), dtype=torch.long)
    batches = torch.cat([my_examples, filler]).view(num_batches, examples_per_batch)
    is_real = (torch.arange(batches.numel()) < len(my_examples)).view(num_batches, examples_per_batch)
    counts = torch.zeros(3, dtype=torch.long, device=device)  # correct (summed loss), correct_norm (mean loss), n
    was_training = model.training
    model.eval()
    with torch.no_grad(), autocast_ctx:
        for batch, batch_is_real in zip(batches, is_real):
            sum_loss, num_tokens = ending_losses(model, tokens[batch].to(device), mask[batch].to(device))  # (B, 4)
            predicted = sum_loss.argmin(dim=1)  # (B,)
            predicted_norm = (sum_loss / num_tokens).argmin(dim=1)  # (B,)
            batch_labels, batch_is_real = labels[batch].to(device), batch_is_real.to(device)
            counts[0] += ((predicted == batch_labels) & batch_is_real).sum()
            counts[1] += ((predicted_norm == batch_labels) & batch_is_real).sum()
            counts[2] += batch_is_real.sum()
    model.train(was_training)
    if world_size > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    correct, correct_norm, n = counts.tolist()
    return correct_norm / n, correct / n, n


def evaluate_run(run, prepared):
    """The HellaSwag evaluation of a training run (train_gpt2.py's Run) at its step, on its prepared examples (those
    load_run read), at its micro-batch: (its log record's results, its line)."""
    cfg, env = run.cfg, run.env
    per_batch = examples_per_batch(prepared, run.micro_batch * cfg.seq_len)
    acc_norm, acc, n = evaluate(run.compiled, prepared, env.device, run.autocast_ctx, env.rank, env.world_size,
                                per_batch)
    return ({KEY: acc_norm, "hellaswag_acc": acc}, f"hellaswag acc_norm {acc_norm:.4f} acc {acc:.4f} ({n} examples)")


def card_line(record, published=None):
    """A model card's line on HellaSwag: the scores of the weights' logged record (evaluate_run's, with its step), or
    None; and how lm-evaluation-harness measures it. Of OpenAI's weights (published, their name) it quotes none."""
    lm_eval = "`lm_eval --model hf --model_args pretrained=path/to/this/directory --tasks hellaswag` measures it"
    if record is None:
        return f"not measured at these weights; {lm_eval}"
    return (f"acc_norm {record[KEY]:.4f}, acc {record['hellaswag_acc']:.4f} at step {record['step']}, as "
            f"train_gpt2.py scores it (its log.jsonl); {lm_eval} the harness's way")
