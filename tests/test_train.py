"""Training: the learning-rate schedule, an end-to-end run and its log.jsonl, 2 processes under torchrun (on one
node, and as two nodes) against 1 process with 2 accumulation steps, and the default run on tiny Shakespeare."""
import ctypes
import functools
import json
import math
import os
import resource
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

import train_gpt2
from helpers import (
    REPO,
    TINY,
    VOCAB,
    checkpoint_path,
    last_json,
    load_ckpt,
    needs_muon,
    past_flags,
    read_log,
    resolved,
    run_main,
    run_script,
    script_env,
    serve_hellaswag,
    start_command,
    synthetic_examples,
    train_records,
    val_records,
)
from machinery import resolution
from machinery.tokenizer import GPT2_VOCAB
from train_gpt2 import TrainConfig, get_lr
from variations import losses, modern

SCRIPTS = os.path.join(REPO, "tests", "scripts")


def cpu_env(world_size=1):
    """The process's place in the run, as set_up_distributed() gives it: rank 0 of world_size, on the CPU."""
    return train_gpt2.Env(rank=0, local_rank=0, world_size=world_size, device="cpu", device_type="cpu")


def test_lr_schedule():
    cfg = TrainConfig(max_lr=6e-4, min_lr_ratio=0.1, warmup_steps=10, max_steps=101)
    assert get_lr(0, 6e-4, cfg) == pytest.approx(6e-5)  # warmup: 1/10 of the peak at the first step
    assert get_lr(4, 6e-4, cfg) == pytest.approx(3e-4)
    assert get_lr(9, 6e-4, cfg) == pytest.approx(6e-4)  # warmup ends at the peak
    assert get_lr(10, 6e-4, cfg) == pytest.approx(6e-4)  # the cosine starts at the peak
    assert get_lr(55, 6e-4, cfg) == pytest.approx(6e-5 + 0.5 * (6e-4 - 6e-5))  # half-way down the 90 decay steps
    assert get_lr(32.5, 6e-4, cfg) == pytest.approx(6e-5 + 0.5 * (1 + math.cos(math.pi / 4)) * 5.4e-4)
    assert get_lr(100, 6e-4, cfg) == pytest.approx(6e-5, rel=1e-12)  # the last step is min_lr_ratio * max_lr exactly
    lrs = [get_lr(s, 6e-4, cfg) for s in range(101)]
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10])) and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    # the peak is the argument, not cfg.max_lr: each parameter group's own max_lr is scaled alike
    assert get_lr(55, 2e-3, cfg) == pytest.approx(2e-4 + 0.5 * (2e-3 - 2e-4))
    no_warmup = TrainConfig(max_lr=1e-3, min_lr_ratio=0.0, warmup_steps=0, max_steps=5)
    assert [get_lr(s, 1e-3, no_warmup) for s in range(5)] == pytest.approx(
        [1e-3, 0.5 * (1 + math.cos(math.pi / 4)) * 1e-3, 5e-4, 0.5 * (1 + math.cos(3 * math.pi / 4)) * 1e-3, 0.0],
        abs=1e-15)


def test_a_run_shorter_than_the_warmup_gets_a_warmup_that_fits(shards, tmp_path, capsys):
    """--max-steps 10 with the default 715 warmup steps left the learning rate rising to the end, never at its peak,
    never decaying. Unless --warmup-steps was given, the warmup is cut to a tenth of the run, and a line says so."""
    code, out, err = run_main(TINY + ["--data", shards, "--log-dir", tmp_path / "log", "--max-steps", "10"], capsys)
    assert code == 0, err
    assert "--max-steps 10 is no longer than the 715 warmup steps: warming up for 1 step instead" in out
    lrs = [r["lr"] for r in train_records(read_log(tmp_path / "log")).values()]
    # at the peak after 1 step, then down the cosine
    assert lrs[0] == pytest.approx(6e-4) and lrs[-1] == pytest.approx(6e-5)
    draft = resolution.Draft(TrainConfig(max_steps=50, warmup_steps=50), set())  # as long as the warmup: "shorter than"
    lines = resolution.fit_warmup(draft, resumed=None)
    assert draft.done().warmup_steps == 5
    assert "--max-steps 50 is no longer than the 50 warmup steps: warming up for 5 steps" in "\n".join(lines)
    draft = resolution.Draft(TrainConfig(max_steps=10, warmup_steps=20), {"warmup_steps"})
    lines = resolution.fit_warmup(draft, resumed=None)
    assert draft.done().warmup_steps == 20  # the user's choice stands, with a warning
    assert "warning: --warmup-steps 20 is not shorter than --max-steps 10" in "\n".join(lines)
    draft = resolution.Draft(TrainConfig(max_steps=5, warmup_steps=715), set())  # a tenth of 5 steps is none
    lines = resolution.fit_warmup(draft, resumed=None)
    assert draft.done().warmup_steps == 0
    assert "--max-steps 5 is no longer than the 715 warmup steps: no warmup instead" in "\n".join(lines)


def test_adamw_decays_only_the_weight_matrices():
    model = train_gpt2.GPT(train_gpt2.GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    (optimizer,) = train_gpt2.make_optimizers(model, TrainConfig(weight_decay=0.1, max_lr=6e-4), "cpu")
    decay, no_decay = optimizer.param_groups
    names = {id(p): name for name, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(group["betas"] == (0.9, 0.95) and group["lr"] == 6e-4 for group in optimizer.param_groups)
    assert all(group["max_lr"] == 6e-4 for group in optimizer.param_groups)  # the peak the schedule scales
    assert sorted(names[id(p)] for p in decay["params"]) == sorted(  # matmuls and embeddings (wte is lm_head's)
        n for n, p in model.named_parameters() if n.endswith("weight") and ".ln_" not in n and "ln_f" not in n)
    assert all(p.dim() == 1 for p in no_decay["params"]) and len(no_decay["params"]) == 2 * 2 * 4 + 2
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))  # each once, tied wte too


def test_train_step_clips_the_gradient_norm():
    """With SGD at lr 1 the update is the gradient itself: after clipping at c its norm is c, not the raw norm."""
    torch.manual_seed(0)
    model = train_gpt2.GPT(train_gpt2.GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32))
    before = [p.detach().clone() for p in model.parameters()]
    optimizers = [torch.optim.SGD(model.parameters(), lr=1.0)]
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    x = torch.randint(0, 64, (2, 16))
    loss, norm, stepped = train_gpt2.train_step(model, optimizers, scaler, [(x, x)],
                                                train_gpt2.autocast_context("cpu", "fp32"), 0.01)
    update = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())]).norm().item()
    assert stepped and norm > 0.1  # the raw norm, as logged
    assert update == pytest.approx(0.01, rel=1e-4)


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None) if sys.platform.startswith("linux") else None, "mallopt"),
                    reason="glibc's mallopt")
@pytest.mark.skipif(any(name in os.environ.get("LD_PRELOAD", "") for name in ("jemalloc", "tcmalloc", "mimalloc")),
                    reason="LD_PRELOAD puts another allocator in place of glibc's, which mallopt does not reach")
def test_freed_tensors_stay_in_the_heap(tmp_path):
    """keep_freed_memory (CPU runs): a big tensor allocated again after it was freed faults none of its pages back in.
    Before, each of the Shakespeare model's 200 MB logits did, which cost 40% of its step on a 2-core CPU."""
    default, kept = last_json(run_script([], cwd=tmp_path, timeout=120,
                                         script=os.path.join(SCRIPTS, "page_faults_of_freed_tensors.py")))
    assert default > 5 * 100e6 / resource.getpagesize() * 0.9  # every page of every tensor faulted in anew
    assert kept < default / 100


def test_compile_model_passes_the_mode(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: calls.append(kwargs) or "compiled")
    model = torch.nn.Linear(2, 2)
    assert train_gpt2.compile_model(model, TrainConfig(compile=False, compile_mode="max-autotune")) is model
    assert train_gpt2.compile_model(model, TrainConfig(compile=True, compile_mode="max-autotune")) == "compiled"
    assert calls == [{"dynamic": False, "mode": "max-autotune"}]


def test_gradients_are_all_reduced_once_per_step_not_per_micro_step(tmp_path):
    """DDP's no_sync on every micro-step but the last: 4 accumulation steps cost the all-reduces of 1."""
    result = run_script([], cwd=tmp_path, nproc=2, timeout=120,
                        script=os.path.join(SCRIPTS, "count_allreduces_per_step.py"))
    every_rank = last_json(result)  # [{accumulation steps: all-reduces}] by rank
    assert len(every_rank) == 2
    for counts in every_rank:
        assert sorted(counts) == ["1", "4"]
        assert counts["1"] >= 1 and counts["4"] == counts["1"]


def test_end_to_end_run_writes_log(shards, tmp_path, capsys):
    log_dir = tmp_path / "log"
    code, out, err = run_main(TINY + ["--data", shards, "--log-dir", log_dir, "--max-steps", "4", "--eval-every", "2",
                                      "--warmup-steps", "2", "--max-lr", "1e-2"], capsys)
    assert code == 0 and err == "", err
    records = read_log(log_dir)
    train, val = train_records(records), val_records(records)
    assert sorted(train) == [0, 1, 2, 3] and sorted(val) == [0, 2, 4]
    cfg = TrainConfig(max_lr=1e-2, warmup_steps=2, max_steps=4)
    for step, r in train.items():
        assert {"step", "train_loss", "lr", "grad_norm", "dt_ms", "tok_per_sec"} <= set(r)
        assert r["tokens"] == (step + 1) * 256 and r["lr"] == pytest.approx(get_lr(step, 1e-2, cfg))
        assert r["grad_norm"] > 0 and r["dt_ms"] > 0 and r["tok_per_sec"] == pytest.approx(256 / (r["dt_ms"] / 1000))
        assert "skipped" not in r
    for r in val.values():
        assert set(r) >= {"step", "val_loss"} and math.isfinite(r["val_loss"])
    assert abs(val[0]["val_loss"] - math.log(VOCAB)) < 0.05
    assert f"step     3/4 | loss {train[3]['train_loss']:.6f}" in out
    # the end, saved before its evaluations and again with them: said so, not "saved" twice
    lines, end = out.splitlines(), checkpoint_path(log_dir, 4)
    evaluated = lines.index(next(line for line in lines if line.startswith("step     4 | val loss")))
    saves = [(i, line.split(" (")[0]) for i, line in enumerate(lines) if line.startswith(f"saved {end}")]
    assert [(i < evaluated, said) for i, said in saves] == [
        (True, f"saved {end}"), (False, f"saved {end} again, with its step's evaluations")], lines
    # the logged first loss is the mean over the whole global batch (2 micro-batches) of the initial model
    torch.manual_seed(1337)
    model = train_gpt2.GPT(train_gpt2.GPTConfig(32, VOCAB, 2, 4, 64))
    stream, val_tokens = train_gpt2.load_data(TrainConfig(data=shards, vocab_size=VOCAB, seq_len=32,
                                                          total_batch_size=256, val_tokens=256))
    with torch.no_grad():
        losses = [model(x, y)[1].item() for x, y in stream.next_step(4, 32, 2, 0, 1, VOCAB)]
        assert train[0]["train_loss"] == pytest.approx(np.mean(losses), abs=1e-6)
        # and the validation loss at step 0 is the mean over the fixed 256 tokens (8 sequences of 32)
        v = torch.from_numpy(val_tokens.astype(np.int64))
        assert val[0]["val_loss"] == pytest.approx(model(v[:-1].view(8, 32), v[1:].view(8, 32))[1].item(), abs=1e-6)
    # trained with a real learning rate, the loss went down over the run
    assert val[4]["val_loss"] < val[0]["val_loss"]


def test_samples_with_a_small_vocab(shards, tmp_path, capsys):
    """The default --num-samples 4 at each evaluation, with --vocab-size 128: the GPT-2 prompt's ids do not fit the
    embedding, which must not crash the run."""
    i = TINY.index("--num-samples")
    args = TINY[:i] + TINY[i + 2:]  # the default number of samples
    code, out, err = run_main(args + ["--data", shards, "--log-dir", tmp_path / "log", "--max-steps", "1",
                                      "--eval-every", "1"], capsys)
    assert code == 0, err
    assert "Traceback" not in err and "no samples: the prompt needs token ids" in out
    assert sorted(val_records(read_log(tmp_path / "log"))) == [0, 1]  # evaluated at the start and the end


@pytest.mark.parametrize("recipe", [["--max-lr", "1e-2"], pytest.param(["--recipe", "modern"], marks=needs_muon)])
def test_chunked_loss_trains_as_the_full_loss(shards, tmp_path, capsys, monkeypatch, recipe):
    """--loss chunked through the whole trainer, eager and compiled (aot_eager: dynamo and AOTAutograd as for
    inductor, no code generated), with a padded vocabulary: the same training and validation losses as --loss full,
    for either recipe. The two losses agree, so the runs count their chunked losses in training (grad mode) to show
    which one they ran."""
    args = TINY + ["--vocab-size", "50304", "--data", shards, "--max-steps", "3", "--eval-every", "3",
                   "--warmup-steps", "1", *recipe,
                   "--val-tokens", "192"]  # 6 sequences: a last batch with -1 rows
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    # a tensor, not a list: dynamo replays a list's append after the graph, but guards on its length, and recompiled
    # the model at every step; a tensor's add_ is part of the graph
    chunked_in_grad_mode = torch.zeros((), dtype=torch.int64)
    real_chunked_cross_entropy = losses.chunked_cross_entropy

    def counted_chunked_cross_entropy(*args, **kwargs):
        if torch.is_grad_enabled():
            chunked_in_grad_mode.add_(1)
        return real_chunked_cross_entropy(*args, **kwargs)

    for model_module in (train_gpt2, modern):  # each recipe's model calls its own import of it
        monkeypatch.setattr(model_module, "chunked_cross_entropy", counted_chunked_cross_entropy)
    logs, chunked_training_losses = {}, {}
    runs = [("full", []), ("chunked", ["--loss", "chunked"]), ("compiled", ["--loss", "chunked", "--compile"])]
    for name, flags in runs:
        chunked_in_grad_mode.zero_()
        code, _, err = run_main(args + flags + ["--log-dir", tmp_path / name], capsys)
        assert code == 0, err
        logs[name] = read_log(tmp_path / name)
        chunked_training_losses[name] = chunked_in_grad_mode.item()
    # each of 3 steps' 2 micro-steps, and the pass of the micro-batch's try before them (microbatch.py: one on a CPU)
    assert chunked_training_losses == {"full": 0, "chunked": 7, "compiled": 7}
    for name in ("chunked", "compiled"):
        assert len(logs[name]) == len(logs["full"]), name
        for mine, full in zip(logs[name], logs["full"]):
            assert mine.keys() == full.keys()
            for key in ("train_loss", "val_loss", "grad_norm"):
                if key in full:
                    assert mine[key] == pytest.approx(full[key], rel=1e-5), (name, mine["step"], key)


@pytest.mark.parametrize("recipe", ["gpt2", pytest.param("modern", marks=needs_muon)])
def test_two_processes_match_one_process_with_accumulation(shards, tmp_path, capsys, recipe):
    """torchrun --nproc_per_node=2 (gloo, 1 micro-step each) against 1 process with 2 accumulation steps: the same
    global batch of 256 tokens, so the same losses, validation losses and weights, for either recipe."""
    flags = ["--max-lr", "1e-2"] if recipe == "gpt2" else ["--recipe", "modern"]
    args = TINY + ["--data", shards, "--max-steps", "4", "--eval-every", "2", "--warmup-steps", "1", *flags]
    code, out, err = run_main(args + ["--log-dir", tmp_path / "one"], capsys)
    assert code == 0, err
    assert "4 x 32 x 2 accumulation steps x 1 process(es)" in out
    two = run_script(args + ["--log-dir", tmp_path / "two"], cwd=tmp_path, nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "4 x 32 x 1 accumulation steps x 2 process(es)" in two.stdout
    assert "Warning" not in two.stderr, two.stderr  # torch's FutureWarning of DDP's broadcast_buffers, once per rank
    one_log, two_log = read_log(tmp_path / "one"), read_log(tmp_path / "two")
    one_train, two_train = train_records(one_log), train_records(two_log)
    # rank 0 logs alone
    assert sorted(two_train) == [0, 1, 2, 3] and len([r for r in two_log if "train_loss" in r]) == 4
    # Muon orthogonalizes in bf16 (torch.optim.Muon's Newton-Schulz iteration): gradients summed in another order,
    # which differ in their last float32 bits, can round to other bf16 values there, so after its first update the
    # modern recipe's runs agree to bf16's precision; its weights are compared below instead
    exact_steps = range(4) if recipe == "gpt2" else range(1)
    for step in exact_steps:
        assert two_train[step]["train_loss"] == pytest.approx(one_train[step]["train_loss"], abs=1e-5), step
        assert two_train[step]["grad_norm"] == pytest.approx(one_train[step]["grad_norm"], rel=1e-4), step
    if recipe == "gpt2":
        assert val_records(one_log)[4]["val_loss"] < val_records(one_log)[0]["val_loss"] - 0.01  # the weights moved
        for step, r in val_records(one_log).items():
            assert val_records(two_log)[step]["val_loss"] == pytest.approx(r["val_loss"], abs=1e-5)
        return
    torch.manual_seed(1337)  # the run's initial weights: --seed's
    start = train_gpt2.GPT(train_gpt2.GPTConfig(32, VOCAB, 2, 4, 64, recipe="modern")).state_dict()
    one, two = (load_ckpt(checkpoint_path(tmp_path / name, 4))["model"] for name in ("one", "two"))
    for name, weights in one.items():
        moved, apart = (weights - start[name]).norm(), (two[name] - weights).norm()
        assert moved > 0.1 and apart < 0.01 * moved, (name, moved, apart)  # 100 times closer than they moved


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="lists threads through Linux's /proc")
def test_the_process_group_and_its_threads_end_with_main(shards, tmp_path):
    """Under torchrun, main() leaves no gloo thread running, even when it stops with an error mid-training: one left
    running at interpreter exit can abort the process (SIGABRT, 'terminate called without an active exception'),
    which failed a CI run. Two ways it was left: torch.distributed.nn imported after init_process_group kept the group
    alive through its default arguments, and the error's traceback kept the DDP model alive past teardown."""
    args = TINY + ["--data", shards, "--log-dir", tmp_path / "log", "--max-steps", "6", "--max-bad-steps", "2"]
    # the loss is NaN at steps 1 and 2 (tests/scripts/nan_loss.py): the second stops the run with an error
    result = run_script(["1,2", *args], cwd=tmp_path, nproc=2, timeout=120,
                        script=os.path.join(SCRIPTS, "threads_after_main.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("error: 2 steps in a row had a non-finite loss") == 2  # each rank stopped with the error
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"rank"')]
    assert sorted(r["rank"] for r in reports) == ["0", "1"]
    for report in reports:
        assert report["code"] == 2
        assert not [name for name in report["threads"] if "gloo" in name], report


def test_two_nodes_match_one_process(shards, tmp_path, capsys, static_server, monkeypatch):
    """Two torchrun launchers of one process each, meeting through a c10d rendezvous as two nodes do: RANK 0 and 1,
    but LOCAL_RANK 0 on both, so each node fetches HellaSwag into its own node-local cache."""
    examples = synthetic_examples([0, 1, 2, 3, 1])
    serve_hellaswag(static_server, monkeypatch, examples)
    base_url = static_server[1]
    args = TINY + ["--vocab-size", str(GPT2_VOCAB)]  # HellaSwag needs all GPT-2 tokens
    args += ["--data", shards, "--max-steps", "2", "--warmup-steps", "1", "--hellaswag-every", "2"]
    monkeypatch.setenv("GPT2_CACHE_DIR", str(tmp_path / "cache_one"))
    code, out, err = run_main(args + ["--log-dir", tmp_path / "one"], capsys)
    assert code == 0, err

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # a download of HellaSwag must hold these few examples, not the real file's 10042
    script = os.path.join(SCRIPTS, "train_with_small_hellaswag.py")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two-nodes",
                "--local_addr=127.0.0.1", script, str(len(examples))]
    nodes = [start_command(launcher + [str(a) for a in args] + ["--log-dir", tmp_path / "two"], tmp_path,
                           script_env(HELLASWAG_URL=base_url, GPT2_CACHE_DIR=str(tmp_path / f"cache_node{i}")),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (_, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stderr[-3000:]
    stdout = "".join(o for o, _ in outputs)
    assert stdout.count("4 x 32 x 1 accumulation steps x 2 process(es)") == 1  # rank 0 alone prints
    assert stdout.count("downloading") == 2
    assert all((tmp_path / f"cache_node{i}" / "hellaswag_val.jsonl").exists() for i in range(2))
    one_log, two_log = read_log(tmp_path / "one"), read_log(tmp_path / "two")
    for step, r in train_records(one_log).items():
        assert train_records(two_log)[step]["train_loss"] == pytest.approx(r["train_loss"], abs=1e-5), step
    hellaswag_lines = [r for r in two_log if "hellaswag_acc_norm" in r]
    assert len(hellaswag_lines) == 2  # steps 0 and 2, logged once
    for mine, theirs in zip(hellaswag_lines, [r for r in one_log if "hellaswag_acc_norm" in r]):
        assert mine["hellaswag_acc_norm"] == theirs["hellaswag_acc_norm"]
        assert mine["hellaswag_acc"] == theirs["hellaswag_acc"]


def test_default_run_falls_back_to_shakespeare(tmp_path, capsys, monkeypatch):
    """`python train_gpt2.py` where there are no shards: one line naming `python fineweb.py`, then the Shakespeare
    preset on input.txt. Only the flags given here change the preset (to make the run short)."""
    monkeypatch.chdir(tmp_path)  # no edu_fineweb10B/ here
    code, out, err = run_main(["--max-steps", "1", "--eval-every", "0", "--val-tokens", "128", "--num-samples", "0",
                               "--batch-size", "1", "--total-batch-size", "128", "--device", "cpu"], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert sum("python fineweb.py" in line for line in lines) == 1
    assert "no FineWeb shards in edu_fineweb10B" in lines[0] and "Shakespeare" in lines[0]
    assert "model: 8 layers, 4 heads, width 128" in out  # the preset's model, not GPT-2 124M
    assert f"data: {REPO}/input.txt" in out and "1 x 128 x 1 accumulation steps" in out  # its seq_len 128, our batch
    records = read_log(tmp_path / "log")
    assert abs(train_records(records)[0]["train_loss"] - math.log(GPT2_VOCAB)) < 0.3
    assert "no warmup instead" in out  # one step leaves no room for the preset's 50 warmup steps
    assert train_records(records)[0]["lr"] == pytest.approx(2e-3)  # the preset's max_lr


def test_a_script_runs_through_a_symlink_in_another_directory(tmp_path):
    """`ln -s .../train_gpt2.py ~/bin/train.py; python ~/bin/train.py` looked for tiny Shakespeare beside the link
    (~/bin/input.txt), and a linked benchmark for train_gpt2.py and machinery/ beside it: a script finds the
    repository from the file a link points to, as Python finds its imports. (test_structure.py checks that every
    script does.)"""
    links = tmp_path / "bin"
    links.mkdir()
    (links / "train.py").symlink_to(os.path.join(REPO, "train_gpt2.py"))
    (links / "ladder.py").symlink_to(os.path.join(REPO, "benchmarks", "speed_ladder.py"))
    tiny = ["--n-layer", "1", "--n-head", "1", "--n-embd", "8", "--block-size", "8", "--batch-size", "1",
            "--total-batch-size", "8", "--val-tokens", "8", "--num-samples", "0", "--device", "cpu"]
    trained = run_script(tiny + ["--max-steps", "1"], cwd=tmp_path, script=links / "train.py")
    assert trained.returncode == 0, trained.stderr
    assert f"data: {REPO}/input.txt, 304,222 training tokens" in trained.stdout, trained.stdout
    helped = run_script(["--help"], cwd=tmp_path, script=links / "ladder.py")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: "), helped.stderr[-2000:]


def test_shakespeare_preset_gives_way_to_model_and_init_from(tmp_path, monkeypatch):
    """With no shards, --model gpt2-medium still means GPT-2 medium, and fine-tuning OpenAI's GPT-2 (--init-from)
    gets a gentle learning rate instead of the from-scratch one."""
    monkeypatch.chdir(tmp_path)
    env = cpu_env()
    cfg = resolved(["--model", "gpt2-medium"], env)
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.max_lr, cfg.warmup_steps) == (24, 16, 1024, 2e-3, 50)
    cfg = resolved(["--init-from", "gpt2"], env)
    assert (cfg.n_layer, cfg.n_embd, cfg.vocab_size, cfg.block_size) == (12, 768, 50304, 1024)
    assert (cfg.max_lr, cfg.max_steps, cfg.warmup_steps, cfg.data) == (3e-5, 100, 10, os.path.join(REPO, "input.txt"))
    cfg = resolved(["--init-from", "gpt2", "--max-lr", "1e-4"], env)
    assert cfg.max_lr == 1e-4


@pytest.mark.parametrize("flags, doing", [([], "training a small model"),
                                          (["--init-from", "gpt2"], "fine-tuning OpenAI's gpt2"),
                                          (["--eval-only"], "evaluating"),
                                          (["--eval-only", "--init-from", "gpt2"], "evaluating")])
def test_the_shakespeare_line_says_what_is_run(tmp_path, monkeypatch, capsys, flags, doing):
    """It said "training a small model on tiny Shakespeare" for fine-tuning OpenAI's GPT-2 and for --eval-only too."""
    monkeypatch.chdir(tmp_path)
    env = cpu_env()
    resolved(flags, env)
    assert f"(make them with `python fineweb.py`): {doing} on tiny Shakespeare instead" in capsys.readouterr().out


def test_the_first_line_of_a_run_says_what_it_does(shards, tmp_path, capsys):
    """After the lines of its settings (here the flags given alone, as no preset applies)."""
    log_dir = tmp_path / "log"
    args = TINY + ["--data", shards, "--log-dir", log_dir]
    code, out, err = run_main(args + ["--eval-only"], capsys)
    assert code == 0, err
    assert past_flags(out)[0] == "evaluating the initial model: random weights (no checkpoint in --log-dir)"
    code, out, err = run_main(args + ["--no-resume", "--max-steps", "2", "--warmup-steps", "1"], capsys)
    assert code == 0, err
    assert past_flags(out)[1] == "training from scratch for 2 steps"  # after the line that moved the old log aside
    code, out, err = run_main(args + ["--max-steps", "3", "--warmup-steps", "1"], capsys)
    assert code == 0, err
    assert past_flags(out)[0] == (f"resuming from the checkpoint of step 2 ({log_dir / 'ckpt_000002.pt'}), "
                             f"training to step 3")
    code, out, err = run_main(args + ["--eval-only"], capsys)
    assert code == 0, err
    assert past_flags(out)[0] == f"evaluating {log_dir / 'ckpt_000003.pt'} (step 3)"


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_shakespeare_preset_splits_its_batch_over_processes(tmp_path, monkeypatch, world_size):
    """`torchrun --nproc_per_node=N train_gpt2.py` with no shards: the preset's 1024-token step is split over the
    processes instead of failing the divisibility check."""
    monkeypatch.chdir(tmp_path)
    cfg = resolved([], cpu_env(world_size))
    assert cfg.batch_size * cfg.seq_len * world_size == cfg.total_batch_size == 1024
