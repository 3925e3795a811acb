"""
HellaSwag evaluation for GPT-2 style models: https://github.com/rowanz/hellaswag

Each example is a context and 4 possible endings, one of them right. The model
"picks" the ending it finds least surprising: we render context + ending for all
4 endings, run them through the model and compare the losses on the ending tokens.
- acc_norm: the ending with the lowest mean per-token loss (the number people quote:
  GPT-2 124M gets 0.2945, GPT-3 124M 0.337)
- acc: the ending with the lowest summed loss (favors short endings)

The evaluation takes any model that maps token ids (B, T) to (logits, loss); only the command line below imports
train_gpt2.py, to build one. Used by train_gpt2.py (--hellaswag-every) and on its own, also on OpenAI's GPT-2:
    python hellaswag.py --init-from gpt2
    python hellaswag.py --checkpoint log/ckpt_019073.pt
    torchrun --standalone --nproc_per_node=8 hellaswag.py --checkpoint log/ckpt_019073.pt
"""

import argparse
import json
import math
import os
import sys
import uuid

import requests
import torch
import torch.distributed as dist
import torch.nn.functional as F

# the validation split is the one everybody reports (the test split has no labels)
HELLASWAG_FILE = "hellaswag_val.jsonl"
HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data"
HELLASWAG_VAL_EXAMPLES = 10042
EXAMPLES_PER_BATCH = 8  # x4 endings = 32 rows per forward pass


class EvalError(Exception):
    """A one-line, user-facing problem with a download, the HellaSwag file or OpenAI's weights."""


def default_cache_dir():
    # the same cache directory train_gpt2.py keeps the GPT-2 weights in
    return os.environ.get("GPT2_CACHE_DIR") or os.path.expanduser("~/.cache/train_gpt2")

# -----------------------------------------------------------------------------
# the data: download once, check, read


class BadFile(Exception):
    """What is wrong with a file's contents, without its name: the caller says which file and what to do about it."""


def parse_examples(path, expected_count=None):
    """The examples of a HellaSwag jsonl file: one JSON object per line with ctx, 4 endings, label. Raises BadFile."""
    examples = []
    try:
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    example = json.loads(line)
                except json.JSONDecodeError as e:
                    raise BadFile(f"line {line_number} is not valid JSON ({e})")
                if not (isinstance(example, dict) and isinstance(example.get("ctx"), str)
                        and isinstance(example.get("endings"), list) and len(example["endings"]) == 4
                        and all(isinstance(ending, str) for ending in example["endings"])
                        and example.get("label") in (0, 1, 2, 3)):
                    raise BadFile(f"line {line_number} is not a HellaSwag example: it needs a string 'ctx', "
                                  f"a list of 4 string 'endings' and a 'label' in 0..3")
                examples.append(example)
    except UnicodeDecodeError as e:
        raise BadFile(f"it is not UTF-8 text ({e})")
    if not examples:
        raise BadFile("it has no examples")
    if expected_count is not None and len(examples) != expected_count:
        raise BadFile(f"it has {len(examples)} examples, expected {expected_count}")
    return examples


def read_examples(path, expected_count, fix):
    """parse_examples, with one-line errors that name the file and end with fix, what to do about it."""
    if not os.path.isfile(path):
        raise EvalError(f"HellaSwag file {path} not found: pass --hellaswag-file PATH to a copy of {HELLASWAG_FILE}")
    try:
        return parse_examples(path, expected_count)
    except BadFile as e:
        raise EvalError(f"HellaSwag file {path}: {e}; {fix}")
    except OSError as e:
        raise EvalError(f"cannot read HellaSwag file {path} ({e}); {fix}")


def download(url, path, check, what, hint, headers=None):
    """
    Fetches url to path: the file appears whole and passed by check(temp_path), which raises BadFile, or not at all.
    what names the kind of file and hint says where else to get it, in the one-line errors.
    """
    cache_dir = os.path.dirname(path)
    # a unique temp name in the same directory: the rename is atomic and concurrent downloads (nodes sharing the
    # cache) don't mix. os.open applies the umask to 0o666, so that a shared $GPT2_CACHE_DIR stays shared
    # (tempfile.mkstemp would make the file private to this user).
    tmp_path = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        os.makedirs(cache_dir, exist_ok=True)
        with open(os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f, \
                requests.get(url, headers=headers, stream=True, timeout=60) as response:
            response.raise_for_status()
            for chunk in response.iter_content(chunk_size=1 << 20):
                f.write(chunk)
        check(tmp_path)  # never cache a truncated or wrong file
        os.replace(tmp_path, path)
    except BadFile as e:
        raise EvalError(f"downloaded {url} is not a valid {what} ({e}); nothing was cached; retry, or {hint}")
    except requests.RequestException as e:  # before OSError, which it subclasses
        raise EvalError(f"could not download {url} ({e}); {hint}")
    except OSError as e:
        raise EvalError(f"cannot write to the cache directory {cache_dir} ({e}); "
                        f"pass --cache-dir or set $GPT2_CACHE_DIR to a writable directory")
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)


def download_once_per_node(url, path, check, what, hint, headers=None):
    """
    One process per node downloads (the cache may be node-local); the others wait for it, then all read the file.
    A failed download fails every rank with its one-line error: the ranks would otherwise die in the collective
    with tracebacks around it. The group may span nodes, so all ranks learn whether any node's download failed.
    """
    error = None
    if int(os.environ.get("LOCAL_RANK", 0)) == 0 and not os.path.exists(path):
        print(f"downloading {url} to {path}")
        try:
            download(url, path, check, what, hint, headers)
        except EvalError as e:
            error = str(e)
    error = first_error_of_any_rank(error)  # also the wait: it returns once every node's download has ended
    if error is not None:
        raise EvalError(error)


def first_error_of_any_rank(error):
    """The first rank's error message (or None), on every rank: a rank that stopped alone would leave the others
    waiting in their next collective, forever under NCCL, or dying in it with tracebacks. All ranks must call it."""
    if dist.is_available() and dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    return error


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
        context = enc.encode(example["ctx"])
        for ending in example["endings"]:
            # the space belongs to the ending: GPT-2's tokenizer attaches it to the next word
            ending_tokens = enc.encode(" " + ending)
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

# -----------------------------------------------------------------------------
# standalone: python hellaswag.py --checkpoint PATH | --init-from gpt2


def main():
    parser = argparse.ArgumentParser(description="HellaSwag accuracy of a GPT-2 checkpoint or of OpenAI's GPT-2.")
    model_source = parser.add_mutually_exclusive_group(required=True)
    model_source.add_argument("--checkpoint", help="a checkpoint written by train_gpt2.py")
    model_source.add_argument("--init-from", choices=["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"],
                              help="OpenAI's GPT-2 weights, downloaded once")
    parser.add_argument("--hellaswag-file", help=f"a local copy of {HELLASWAG_FILE}, for offline machines")
    parser.add_argument("--cache-dir", help="where downloads are kept (default: $GPT2_CACHE_DIR or ~/.cache/train_gpt2)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                        help="auto picks cuda, then mps, then cpu")
    args = parser.parse_args()

    # run as a script, this module is __main__: train_gpt2's `import hellaswag` must find it rather than load a second
    # copy, whose EvalError (raised by downloads of OpenAI's weights) would be another class, not caught as one
    sys.modules.setdefault("hellaswag", sys.modules[__name__])
    # imported here, not at the top: train_gpt2.py imports this module
    from train_gpt2 import (GPT, UsageError, autocast_context, gpt2_tokenizer, load_checkpoint, model_from_checkpoint,
                            resolve_dtype, run_then_tear_down, setup_distributed)

    def evaluate_the_model():
        ddp = setup_distributed(args.device)
        if args.checkpoint:
            try:
                model = model_from_checkpoint(load_checkpoint(args.checkpoint))
            except Exception as e:  # a missing, truncated or foreign file: torch and pickle raise many kinds
                raise UsageError(f"--checkpoint {args.checkpoint}: cannot load it as a train_gpt2.py checkpoint ({e})")
        else:
            model = GPT.from_pretrained(args.init_from, cache_dir=args.cache_dir)
        model.to(ddp.device)
        examples = load_examples(args.hellaswag_file, args.cache_dir)
        prepared = prepare(examples, gpt2_tokenizer(), model.config.block_size)
        autocast_ctx = autocast_context(ddp.device_type, resolve_dtype("auto", ddp.device_type))
        return ddp.rank, evaluate(model, prepared, ddp.device, autocast_ctx, ddp.rank, ddp.world_size)

    rank, (acc_norm, acc, n) = run_then_tear_down(evaluate_the_model)
    if rank == 0:
        print(f"HellaSwag ({n} examples): acc_norm {acc_norm:.4f} (GPT-2 124M: 0.2945, GPT-3 124M: 0.337), acc {acc:.4f}")
        print(f"acc_norm={acc_norm:.6f} acc={acc:.6f} n={n}")


if __name__ == "__main__":
    main()
