"""Shared pieces of the train_gpt2.py tests: synthetic shards, a tiny model's flags, running main() in-process
or the script in a subprocess (plain or under torchrun), and reading log.jsonl."""
import json
import os
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest

import train_gpt2

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "train_gpt2.py")
VOCAB = 128

# 2 layers, width 64, T=32, vocab 128: 4 x 32 x 2 accumulation steps = 256 tokens a step on one process
TINY = ["--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--block-size", "32", "--vocab-size", str(VOCAB),
        "--batch-size", "4", "--seq-len", "32", "--total-batch-size", "256", "--val-tokens", "256",
        "--num-samples", "0", "--eval-every", "0", "--device", "cpu", "--hellaswag-every", "0"]


def write_shards(directory, train_lengths=(3000, 2500), val_length=1000, vocab=VOCAB, seed=0, ext="npy"):
    """Random token shards, np.save of uint16 (or llm.c's .bin), ids < vocab; returns the directory."""
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    for i, n in enumerate(train_lengths):
        save_tokens(os.path.join(directory, f"synth_train_{i:06d}.{ext}"), rng.integers(0, vocab, n, dtype=np.uint16))
    save_tokens(os.path.join(directory, f"synth_val_000000.{ext}"), rng.integers(0, vocab, val_length, dtype=np.uint16))
    return str(directory)


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


def run_main(argv, capsys):
    """train_gpt2.main(argv) in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = 0
    try:
        train_gpt2.main([str(a) for a in argv])
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
    env.pop("TRAIN_GPT2_NAN_STEPS", None)
    env.update(extra)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def script_command(args, nproc=1, script=SCRIPT):
    if nproc == 1:
        return [sys.executable, str(script)] + [str(a) for a in args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script)] + [str(a) for a in args]


def run_script(args, cwd, nproc=1, timeout=240, script=SCRIPT, **env):
    """The script (train_gpt2.py unless given) in a subprocess, under torchrun when nproc > 1: the CompletedProcess."""
    return subprocess.run(script_command(args, nproc, script), cwd=cwd, env=script_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def run_script_on_tmpfs(args, cwd, mount, options, timeout=240):
    """The script with a tmpfs of its own mounted at mount (options: "ro", or "size=256k" for a small disk), in a private
    mount namespace (unshare: as root, or where user namespaces are allowed), so that its writes meet a real read-only
    or full file system. The files left in the mount are listed on the last line of stdout. Skips where no such
    namespace can be made."""
    os.makedirs(mount, exist_ok=True)
    unshare = ["unshare", "--map-root-user", "--mount", "sh", "-c"]
    mount_it = f"mount -t tmpfs -o {shlex.quote(options)} tmpfs {shlex.quote(str(mount))}"
    probe = subprocess.run(unshare + [mount_it], capture_output=True, text=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip(f"no private tmpfs mount here ({probe.stderr.strip() if probe else 'no unshare command'})")
    command = " ".join(shlex.quote(part) for part in script_command(args))
    listing = f"ls -A {shlex.quote(str(mount))} | tr '\\n' ' '"
    shell = f"{mount_it} && {{ {command}; code=$?; echo; {listing}; exit $code; }}"
    return subprocess.run(unshare + [shell], cwd=cwd, env=script_env(), capture_output=True, text=True, timeout=timeout)


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


def load_ckpt(path):
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def assert_tensors_equal(a, b, exact=True, atol=1e-5):
    """Two state dicts (nested dicts of tensors) hold the same keys and equal tensors."""
    import torch

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


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run faster on one thread (and the same as in the subprocesses, which get OMP_NUM_THREADS=1)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def shards(tmp_path):
    return write_shards(tmp_path / "data")
