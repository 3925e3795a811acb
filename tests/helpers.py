"""Shared pieces of the tests: synthetic shards, a tiny model's flags, running main() in-process or the script in a
subprocess (plain or under torchrun) and following it, reading log.jsonl, tiny models and the float64 loss they are
checked against, synthetic HellaSwag examples served as a download, and file permissions enforced on root too."""
import contextlib
import ctypes
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import forkserver
import train_gpt2
from evaluation import hellaswag
from machinery.tokenizer import GPT2_VOCAB
from train_gpt2 import GPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# --recipe modern's Muon is torch.optim.Muon, new in PyTorch 2.9; requirements.txt allows older ones
needs_muon = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="--recipe modern needs PyTorch 2.9 or later")
SCRIPT = os.path.join(REPO, "train_gpt2.py")
VOCAB = 128

# 2 layers, width 64, T=32, vocab 128: 4 x 32 x 2 accumulation steps = 256 tokens a step on one process
TINY = ["--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--block-size", "32", "--vocab-size", str(VOCAB),
        "--batch-size", "4", "--seq-len", "32", "--total-batch-size", "256", "--val-tokens", "256",
        "--num-samples", "0", "--eval-every", "0", "--device", "cpu", "--hellaswag-every", "0", "--core-every", "0"]


def write_shards(directory, train_lengths=(3000, 2500), val_length=1000, vocab=VOCAB, seed=0, ext="npy"):
    """Random token shards, np.save of uint16 (or llm.c's .bin), ids < vocab; returns the directory."""
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    for i, n in enumerate(train_lengths):
        save_tokens(os.path.join(directory, f"synth_train_{i:06d}.{ext}"), rng.integers(0, vocab, n, dtype=np.uint16))
    save_tokens(os.path.join(directory, f"synth_val_000000.{ext}"), rng.integers(0, vocab, val_length, dtype=np.uint16))
    return str(directory)


def put_bad_token(directory, position):
    """Token id 200, past VOCAB, at position in every train shard of directory (write_shards'): the step that reads
    that position of the first shard in the order finds it, as a shard damaged or replaced while the run reads."""
    for name in os.listdir(directory):
        if "_train_" in name:
            tokens = np.load(os.path.join(directory, name))
            tokens[position] = 200
            np.save(os.path.join(directory, name), tokens)


def save_tokens(path, tokens):
    tokens = np.asarray(tokens, dtype=np.uint16)
    path = str(path)
    if path.endswith(".bin"):
        header = np.zeros(256, dtype=np.int32)
        header[:3] = [20240520, 1, len(tokens)]
        with open(path, "wb") as f:
            f.write(header.tobytes())
            f.write(tokens.tobytes())
    else:
        np.save(path, tokens)


def resolved(flags, env=None, trainer=train_gpt2):
    """The settings that trainer (train_gpt2, or an edited copy) resolves from flags for a new run on env (one CPU
    process unless given), printing its first lines."""
    env = env or trainer.Env(0, 0, 1, "cpu", "cpu")
    return trainer.final_config(trainer.draft_config(*trainer.parse_args([str(f) for f in flags]), env), env)


def past_flags(out):
    """A run's printed lines but the flags given (resolution.say_given's, continuations too): those that follow them."""
    return [line for line in out.splitlines() if not line.startswith(("flags given: ", "    "))]


def run_main(argv, capsys, main=None):
    """main(argv), train_gpt2.main unless given, in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = 0
    try:
        (main or train_gpt2.main)([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def expect_usage_error(argv, capsys, *fragments):
    """main(argv) must exit 2 with a single 'error: ...' line on stderr holding every fragment, no traceback."""
    return check_usage_error(*run_main(argv, capsys), *fragments)


def check_usage_error(code, out, err, *fragments):
    """What expect_usage_error checks, of a run's exit code, stdout and stderr; returns the error line."""
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in out + err
    for fragment in fragments:
        assert str(fragment) in lines[0], (fragment, lines[0])
    return lines[0]


def script_env(**extra):
    # one thread: on a loaded 2-core machine, 2 OpenMP threads spin-wait and make a tiny step 50x slower;
    # no GPU: these runs are not about CUDA, and on a GPU machine they must run as on a CPU one (tests/test_cuda.py is)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.update(extra)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def script_command(args, nproc=1, script=SCRIPT, torchrun=False):
    """The command that runs the script in nproc processes: with nproc > 1, under torchrun if torchrun, else forked
    as torchrun would start them by tests/scripts/ranks.py, which imports torch once for all (the tests of torchrun
    itself ask for it)."""
    args = [str(script)] + [str(a) for a in args]
    if nproc == 1:
        return [sys.executable] + args
    if torchrun:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] + args
    return [sys.executable, os.path.join(REPO, "tests", "scripts", "ranks.py"), str(nproc)] + args


def run_command(command, cwd, env, timeout, **how):
    """subprocess.run(command, capture_output=True, text=True, ...): forked by the fork server where it can be (a
    python command, or a console script: forkserver.py; a real process where it is switched off), any other command
    run as it is; how: the resource limits, ignored signals, new session or tmpfs the fork server gives the command
    (forkserver.Process's)."""
    if forkserver.forkable(command):
        return forkserver.run(command, cwd, env, timeout, **how)
    assert not how, f"only the fork server's commands take {how}"
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def start_command(command, cwd, env, **popen):
    """subprocess.Popen(command, cwd=cwd, env=env, **popen): forked by the fork server where it can be (popen: its
    stdout, stderr, text, and run_command's how)."""
    if forkserver.forkable(command):
        return forkserver.Process(command, cwd, env, **popen)
    return subprocess.Popen(command, cwd=cwd, env=env, **popen)


def run_script(args, cwd, nproc=1, timeout=240, script=SCRIPT, torchrun=False, **env):
    """The script (train_gpt2.py unless given) in a process of its own, in nproc processes (script_command): the
    CompletedProcess."""
    return run_command(script_command(args, nproc, script, torchrun), cwd, script_env(**env), timeout)


def run_script_on_tmpfs(args, cwd, mount, options, timeout=240, nproc=1, before=""):
    """The script (in nproc ranks, forked as torchrun would start them) with a tmpfs of its own mounted at mount
    (private_tmpfs), so that its writes meet a real read-only or full file system. Skips where there is none."""
    tmpfs = private_tmpfs(mount, options, before)
    return run_command(script_command(args, nproc), cwd, script_env(), timeout, tmpfs=tmpfs)  # its ranks forked too


def private_tmpfs(mount, options, before=""):
    """run_command's tmpfs: one mounted at mount (options: "ro", or "size=256k" for a small disk) in a private mount
    namespace (made as `unshare --map-root-user --mount` makes it: as root, or where user namespaces are allowed);
    before: a shell command run in the mount first. The files left in the mount are listed on the last line of
    stdout. Skips where unshare(1) cannot make such a namespace."""
    os.makedirs(mount, exist_ok=True)
    unshare = ["unshare", "--map-root-user", "--mount", "sh", "-c"]
    mount_it = f"mount -t tmpfs -o {shlex.quote(options)} tmpfs {shlex.quote(str(mount))}"
    probe = subprocess.run(unshare + [mount_it], capture_output=True, text=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip(f"no private tmpfs mount here ({probe.stderr.strip() if probe else 'no unshare command'})")
    listing = f"echo; ls -A {shlex.quote(str(mount))} | tr '\\n' ' '"
    return dict(mount=str(mount), options=options, before=before or None, after=listing)


def run_source(source, tmp_path, args=(), nproc=1, **env):
    """Python source, written to tmp_path/script.py and run as the trainer would be, with the repo's path and args as
    its arguments: the CompletedProcess."""
    script = tmp_path / "script.py"
    script.write_text(source)
    return run_script([REPO, *args], cwd=tmp_path, nproc=nproc, timeout=120, script=script, **env)


def last_json(result):
    """The script's last line of output, read as JSON (one line from rank 0: the ranks' lines could interleave)."""
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def read_log(log_dir):
    with open(os.path.join(log_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_records(records):
    """{step: record} of the train lines; a step logged again after a resume keeps its last record."""
    return {r["step"]: r for r in records if "train_loss" in r}


def val_records(records):
    return {r["step"]: r for r in records if "val_loss" in r}


def checkpoint_path(log_dir, step):
    return os.path.join(log_dir, f"ckpt_{step:06d}.pt")


SAMPLE_HEADER = r"^--- sample (\d+)/(\d+) \(step (\d+)\) ---$"


def printed_samples(out):
    """[(number, of, step, text)] of each sample block in the output, whose text runs up to the next '--- ' line."""
    blocks = re.findall(SAMPLE_HEADER.removesuffix("$") + r"\n(.*?)\n(?=^--- )", out, re.M | re.S)
    return [(int(i), int(n), int(step), text) for i, n, step, text in blocks]


def scribble(path, size=200_000):
    """Random bytes over the middle of the file at path, its size unchanged: what a failing disk or copy leaves."""
    with open(path, "r+b") as f:
        f.seek((os.path.getsize(path) - size) // 2)
        f.write(os.urandom(size))


def load_ckpt(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_tensors_equal(a, b, exact=True, atol=1e-5):
    """Two state dicts (nested dicts of tensors) hold the same keys and equal tensors."""
    assert set(a) == set(b)
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            assert_tensors_equal(x, y, exact, atol)
        elif isinstance(x, torch.Tensor):
            if exact:
                assert torch.equal(x, y), key
            else:
                assert torch.allclose(x, y, rtol=0, atol=atol), (key, (x - y).abs().max())
        else:
            assert x == y, key


# -----------------------------------------------------------------------------
# a script running in the background: its log, its process


def start_script(args, cwd, stdout_path):
    """The script started in a process of its own (forkserver.Process), its stdout and stderr going to
    stdout_path: a Popen's pid, poll, wait, send_signal and kill."""
    with open(stdout_path, "w") as out:
        return forkserver.Process(script_command(args), cwd, script_env(), stdout=out)


def logged_train_steps(log_dir):
    """The train steps in log.jsonl so far, reading only whole lines (the file may be mid-write)."""
    try:
        with open(os.path.join(log_dir, "log.jsonl")) as f:
            text = f.read()
    except FileNotFoundError:
        return []
    lines = text.split("\n")[:-1]
    return [r["step"] for r in map(json.loads, lines) if "train_loss" in r]


def wait_for_step(proc, log_dir, step, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        steps = logged_train_steps(log_dir)
        if steps and max(steps) >= step:
            return max(steps)
        assert proc.poll() is None, f"the run ended (code {proc.returncode}) before step {step}"
        time.sleep(0.005)
    proc.kill()
    pytest.fail(f"no step {step} within {timeout} s")


def wait_for_output(proc, path, text, timeout=120):
    """Waits until the output file at path (start_script's) holds text, while the process runs."""
    deadline = time.time() + timeout
    while text not in open(path).read():
        assert proc.poll() is None, f"the run ended (code {proc.returncode}) before printing {text!r}"
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"no {text!r} within {timeout} s")
        time.sleep(0.005)


def ranks_of(launcher_pid, log_dir, forked_for_it=False):
    """{rank: pid} of a launcher's two ranks: its children (tests/scripts/ranks.py forks them), or if forked_for_it,
    what the fork server forked for it in its directory (torchrun's workers: each under a supervisor of the server, as
    the launcher is). Rank 0 is the one holding log_dir's lock open."""
    lock, ranks = os.path.realpath(os.path.join(log_dir, ".lock")), {}
    if forked_for_it:
        server, directory = parent_of(parent_of(launcher_pid)), os.readlink(f"/proc/{launcher_pid}/cwd")

    def launched(pid):
        if not forked_for_it:
            return parent_of(pid) == launcher_pid
        if pid == launcher_pid or parent_of(parent_of(pid)) != server:
            return False
        return os.readlink(f"/proc/{pid}/cwd") == directory  # not another command of this server's

    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            if not launched(pid):
                continue
            fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:  # gone meanwhile
            continue
        ranks[0 if lock in fds else 1] = pid
    return ranks


def parent_of(pid):
    stat = process_stat(pid)
    return stat and stat[1]


def process_stat(pid):
    """(state, parent pid, cpu seconds) from Linux's /proc, or None once the process is gone or a zombie (dead,
    waiting to be reaped)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] == "Z":
        return None
    return fields[0], int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -----------------------------------------------------------------------------
# tiny models, and the float64 cross-entropy over GPT-2's real ids that their losses are checked against


def tiny_gpt(vocab_size=50304, block_size=32, n_layer=2, n_head=4, n_embd=64, attn="sdpa", loss="full", seed=0,
             recipe="gpt2"):
    """A small GPT of train_gpt2.py, the same weights for the same arguments; by default GPT-2's vocabulary padded
    to 50304 rows, as the trainer has it."""
    torch.manual_seed(seed)
    return train_gpt2.model_of(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head,
                                         n_embd=n_embd, attn=attn, loss=loss, recipe=recipe))


def random_ids(B, T, high=GPT2_VOCAB, seed=1):
    return torch.randint(0, high, (B, T), generator=torch.Generator().manual_seed(seed))


def with_loud_padding(model):
    """Padding rows of the tied lm_head/wte that would take nearly all the probability if they were in the softmax."""
    with torch.no_grad():
        model.lm_head.weight[GPT2_VOCAB:] = 5.0
    return model


def final_hidden(model, idx):
    """The final hidden states (B, T, C) of the model on idx: the output of its last norm, ln_f."""
    hidden = []
    handle = model.transformer.ln_f.register_forward_hook(lambda module, args, out: hidden.append(out))
    model(idx)
    handle.remove()
    return hidden[0]


def reference(model, idx, targets):
    """The float64 mean cross-entropy over the first 50257 columns of the final hidden states times lm_head."""
    logits = final_hidden(model, idx).double() @ model.lm_head.weight.double().T  # (B, T, V)
    return F.cross_entropy(logits[..., :GPT2_VOCAB].flatten(0, 1), targets.flatten(), ignore_index=-1)


def chunked_case(N=37, C=16, V=300, n_pad=20, seed=0):
    """Inputs of chunked_cross_entropy: hidden states x (N, C), weight (V, C), targets with -1 rows, and a mask that
    puts the last n_pad ids out of the softmax."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, generator=g)
    w = torch.randn(V, C, generator=g) * 0.5
    targets = torch.randint(0, V - n_pad, (N,), generator=g)
    targets[3:9] = -1  # -1 rows, and a whole chunk of them when chunk_rows is 5
    mask = torch.zeros(V)
    mask[V - n_pad:] = float("-inf")
    return x, w, targets, mask


def float64_loss_and_grads(x, w, targets, mask, cap=None):
    """F.cross_entropy's loss of cap * tanh(x @ w.T / cap) + mask (without the cap or the mask where they are None)
    and its gradients for x and w, all in float64."""
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    logits = x64 @ w64.T
    logits = cap * torch.tanh(logits / cap) if cap else logits
    logits = logits if mask is None else logits + mask.double()
    loss = F.cross_entropy(logits, targets, ignore_index=-1)
    loss.backward()
    return loss.detach(), x64.grad, w64.grad


# -----------------------------------------------------------------------------
# HellaSwag: synthetic examples in the real file's format, served as its download

# (context, 4 endings): real HellaSwag-like text, endings of different lengths so that acc and acc_norm differ
SYNTHETIC = [
    ("A man is sitting on a roof.", "He",
     ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
      "is holding a rubik's cube.", "starts pulling up roofing on a roof."]),
    ("A lady walks to a barbell. She", "bends down and grabs the pole.",
     ["swings and lands in her arms.", "pulls the barbell forward.", "pulls a rope attached to the barbell.",
      "stands and lifts the weight over her head."]),
    ("Two women in a child are shown in a canoe while a man pulls the canoe while standing in the water, "
     "with other individuals visible in the background.", "The child and a different man",
     ["are then shown paddling down a river in a boat while a woman talks.", "are driving the canoe, they go "
      "down the river flowing side to side.", "sit in a canoe while the man paddles.",
      "walking go down the rapids, while the man in his helicopter almost falls and goes out of canoehood."]),
    ("A boy is running down a track.", "The boy",
     ["runs into a car.", "gets in a mat.", "lifts his body above the height of a pole.", "stands on his hands."]),
    ("The boy lifts his body above the height of a pole.", "The boy",
     ["turns his body around on the bar.", "falls over.", "lands on his back on to a red mat.",
      "jumps up and down."]),
    ("We see a person doing laundry.", "The person",
     ["sorts the clothes by color.", "is seen.", "folds a shirt and puts it in a drawer very carefully.",
      "dances."]),
    ("A woman is outside with a bucket and a dog.", "The dog",
     ["is running around trying to avoid a bath.", "gets into the bath tub.", "sits.",
      "jumps out of the bucket and runs."]),
]


@contextlib.contextmanager
def serving(server):
    """server (a socketserver) answering in a thread of its own while the block runs; shut down and closed after.
    Its loop looks for the shutdown every 10 ms, not every 0.5 s, which each test would otherwise wait out."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def synthetic_examples(labels):
    """Examples in the real hellaswag_val.jsonl format."""
    return [{"ind": 24 + i, "ctx_a": ctx_a, "ctx_b": ctx_b, "ctx": ctx_a + " " + ctx_b, "endings": endings,
             "label": label, "activity_label": "Synthetic", "split": "val", "split_type": "indomain",
             "source_id": f"synthetic~{i}"}
            for i, ((ctx_a, ctx_b, endings), label) in enumerate(zip(SYNTHETIC, labels))]


def write_jsonl(path, examples):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(example) + "\n" for example in examples))


HARNESS_TASK = "hellaswag_as_train_gpt2"
HARNESS_TASK_YAML = """task: hellaswag_as_train_gpt2
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {path}
  cache_dir: {cache}
output_type: multiple_choice
validation_split: validation
doc_to_text: ctx
doc_to_choice: endings
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_harness_task(directory, hellaswag_file):
    """An lm-evaluation-harness task in directory (its --include_path) that gives the harness hellaswag_file's text
    as hellaswag.py does: each ending after its context and a space; its datasets cache in directory/cache."""
    (directory / f"{HARNESS_TASK}.yaml").write_text(HARNESS_TASK_YAML.format(path=hellaswag_file,
                                                                              cache=directory / "cache"))


def serve_hellaswag(served, monkeypatch, examples):
    """Serves examples as HELLASWAG_URL's hellaswag_val.jsonl; a download must hold that many (not 10042) examples."""
    www, base_url = served
    write_jsonl(www / hellaswag.HELLASWAG_FILE, examples)
    monkeypatch.setenv("HELLASWAG_URL", base_url)
    monkeypatch.setattr(hellaswag, "HELLASWAG_VAL_EXAMPLES", len(examples))


# -----------------------------------------------------------------------------
# permissions as a user meets them: root reads and writes files whatever their mode


class CapabilityHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapabilitySets(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


@contextlib.contextmanager
def file_permissions_enforced():
    """While inside, this thread (the one main runs on) meets file permissions as a user does: root's capabilities that
    override them (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH) are out of its effective set, kept in the permitted set to
    be taken back after; capsh --drop does the same for a new process. For a user, nothing changes."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "capset"):
        pytest.skip("no Linux capabilities here: root's override of file permissions cannot be dropped")
    header, sets = CapabilityHeader(0x20080522, 0), (CapabilitySets * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(header), sets) != 0:
        pytest.skip(f"capget failed: {os.strerror(ctypes.get_errno())}")
    effective = sets[0].effective
    sets[0].effective &= ~(1 << 1 | 1 << 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    assert libc.capset(ctypes.byref(header), sets) == 0, os.strerror(ctypes.get_errno())
    try:
        yield
    finally:
        sets[0].effective = effective
        assert libc.capset(ctypes.byref(header), sets) == 0, os.strerror(ctypes.get_errno())
