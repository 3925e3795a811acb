"""
The loss alone, compiled as the trainer compiles it: the output layer's matmul and the cross-entropy of --rows rows,
forward and backward under bf16 autocast, --loss full against --loss chunked. For each, the peak memory above its
inputs, the median time of a forward and backward pass after the first (which compiles), and the loss.

    python benchmarks/loss_memory.py --device cuda       # one 64 x 1024 micro-batch of GPT-2 124M: 65536 x 768 x 50304
    python benchmarks/loss_memory.py --device cpu --rows 8192 --width 64 --chunk-rows 1024   # minutes on 2 cores
    git show 14b2ac3:chunked_loss.py > /tmp/old_chunked_loss.py    # the chunked loss whose loop was traced
    python benchmarks/loss_memory.py --device cpu --rows 8192 --width 64 --chunk-rows 1024 \\
        --chunked-from /tmp/old_chunked_loss.py

On CUDA the peak is torch.cuda.max_memory_allocated's. On a CPU it is the process's peak resident memory (VmHWM,
reset before the pass, Linux only): glibc hands blocks this large back to the system as they are freed, so it follows
the tensors alive. --no-compile runs them eagerly.
"""

import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
sys.path.insert(0, REPO)
import train_gpt2  # noqa: E402
from machinery.tokenizer import GPT2_VOCAB  # noqa: E402
from variations import losses  # noqa: E402

MIB = 2**20


def resident(field):
    """A field of /proc/self/status in bytes: VmRSS (now) or VmHWM (the peak)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def peak_of(step, device):
    """The bytes step() allocates at its peak, above what is allocated before it, and its result."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result = step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, result
    before = resident("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident memory starts again from now
    result = step()
    return resident("VmHWM:") - before, result


def measure(loss_of, inputs, args):
    """{peak_mib, ms, loss} of loss_of's forward and backward passes over inputs (x, w, targets, mask)."""
    x, w, targets, mask = inputs
    function = torch.compile(loss_of, dynamic=False) if args.compile else loss_of

    def step():
        x.grad = w.grad = None
        with torch.autocast(args.device, dtype=torch.bfloat16):
            loss = function(x, w, targets, mask)
        loss.backward()
        return loss.item()

    step()  # compiles
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    peak, loss = peak_of(step, args.device)
    return {"peak_mib": peak / MIB, "ms": 1000 * statistics.median(times), "loss": loss}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--rows", type=int, default=64 * 1024, help="B*T (default: 65536, a 64 x 1024 micro-batch)")
    parser.add_argument("--width", type=int, default=768, help="n_embd (default: 768, GPT-2 124M's)")
    parser.add_argument("--vocab", type=int, default=50304, help="the padded vocabulary (default: 50304)")
    parser.add_argument("--chunk-rows", type=int, default=losses.CHUNK_ROWS,
                        help=f"rows a chunk (default: {losses.CHUNK_ROWS}, the trainer's)")
    parser.add_argument("--steps", type=int, default=5, help="timed passes after the first (default: 5)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.compile each loss, as the trainer does on CUDA (default: on)")
    parser.add_argument("--chunked-from", default="", help="a losses.py (or an older chunked_loss.py) to take the "
                                                           "chunked loss from")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "error: --device cuda, but PyTorch sees no CUDA GPU; use --device cpu\n")
    chunked = losses
    if args.chunked_from:
        spec = importlib.util.spec_from_file_location("chunked_from", args.chunked_from)
        chunked = sys.modules["chunked_from"] = importlib.util.module_from_spec(spec)  # dynamo imports it by name
        spec.loader.exec_module(chunked)
    if args.device == "cuda":
        torch.set_float32_matmul_precision("high")
    torch.manual_seed(0)
    x = torch.randn(args.rows, args.width, device=args.device, requires_grad=True)
    w = (0.02 * torch.randn(args.vocab, args.width, device=args.device)).requires_grad_()
    targets = torch.randint(0, min(args.vocab, GPT2_VOCAB), (args.rows,), device=args.device)
    mask = torch.zeros(args.vocab, device=args.device)
    mask[GPT2_VOCAB:] = float("-inf")
    loss_functions = {  # as GPT.forward computes each: the full loss from the masked bf16 logits
        "full": lambda x, w, targets, mask: train_gpt2.cross_entropy(x @ w.T + mask.to(torch.bfloat16), targets),
        "chunked": lambda x, w, targets, mask: chunked.chunked_cross_entropy(x, w, targets, mask,
                                                                            chunk_rows=args.chunk_rows),
    }
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(f"{args.rows} rows x width {args.width} x vocab {args.vocab}, chunks of {args.chunk_rows} rows, bf16 "
          f"autocast, compile {args.compile}, on {where}, torch {torch.__version__}; the bf16 logits alone: "
          f"{args.rows * args.vocab * 2 / MIB:,.0f} MiB")
    for name, loss_of in loss_functions.items():
        result = measure(loss_of, (x, w, targets, mask), args)
        print(f"{name:<8} peak {result['peak_mib']:>9,.0f} MiB above the inputs   {result['ms']:>9.1f} ms a forward "
              f"and backward pass   loss {result['loss']:.6f}", flush=True)


if __name__ == "__main__":
    main()
