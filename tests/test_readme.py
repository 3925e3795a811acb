"""The README's commands, run as written as far as a CPU with no network can: every command of its bash blocks is
either run here, in a directory of its own as a fresh clone would be (the training runs cut short and shrunk by flags
appended to them, which override any preset; a checkpoint the README names by its step, the one the shortened run
wrote), with the network pointed at a local HTTP server, or skipped with its reason (a GPU, a cluster, the real
downloads). And the files its commands make in a clone stay out of git's way (.gitignore covers them), and every
link between the README and the pages of docs/ leads somewhere."""
import base64
import glob
import hashlib
import http.server
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import urllib.parse
from typing import NamedTuple

import pytest
import torch

import plot
import test_pretrained
import train_gpt2
from helpers import (
    HARNESS_TASK,
    REPO,
    needs_muon,
    resolved,
    run_command,
    run_main,
    serving,
    synthetic_examples,
    write_harness_task,
    write_jsonl,
)
from test_core import bundle_tasks, tiny_model, write_bundle

README = os.path.join(REPO, "README.md")
WRITES = re.compile(r"(?:--export-hf|--output|--log-dir|--json|--trace|mkdir -p) +([^\s`'\"]+)")
# appended to a README training command: a model small enough for seconds, a few steps of a quarter of the
# Shakespeare preset's batch, a short validation
SHRINK = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--max-steps", "3", "--total-batch-size", "256",
          "--val-tokens", "1024", "--num-samples", "1", "--max-new-tokens", "4"]
# --init-from DIR's runs: 2 steps of 256 tokens, evaluated on 1024 (its preset's 1,024-token steps cost seconds here)
EVAL_SHORT = ["--val-tokens", "1024"]
SHORT = ["--max-steps", "2", "--seq-len", "32", "--total-batch-size", "256", *EVAL_SHORT, "--num-samples", "1",
         "--max-new-tokens", "4"]
BIN = os.path.dirname(sys.executable)  # the environment's console scripts: lm_eval, hf

gpt2_server = test_pretrained.gpt2_server  # a tiny stand-in for OpenAI's weights, served as the Hub serves them

# Every command of the README's bash blocks: how this file runs it, or why it cannot. A README command that matches
# none fails test_every_readme_command_is_run_here_or_skipped_with_its_reason.
HOW = [
    (r"^pip install", "skip: installs from the network (the tests' environment is installed so)"),
    (r"^python -m pytest", "skip: the test command itself, which runs this (test_ci_runs_the_readmes_test_lines)"),
    (r"^torchrun ", "skip: needs several GPUs (tests/test_fsdp.py and others run 2 processes on the CPU)"),
    (r"^srun ", "skip: needs a SLURM cluster"),
    (r"^#!/bin/bash\n#SBATCH", "skip: a SLURM batch script (tests/test_resume.py signals torchrun's workers so)"),
    (r"^python fineweb\.py( +#|$| --max-tokens)", "skip: downloads FineWeb-Edu (tests/test_fineweb.py runs it "
                                                  "against a fake hub)"),
    (r"^python train_gpt2\.py +# one GPU", "skip: needs FineWeb's shards and a GPU"),
    (r"^python benchmarks/speed_ladder\.py --(json|batch-size)", "skip: GPT-2 124M's steps need a GPU"),
    (r"^python benchmarks/speed_ladder\.py --tiny", "skip: tests/test_speed_ladder.py runs it (8 runs: too slow to "
                                                    "run twice)"),
    (r"^WANDB_MODE=offline|^wandb sync", "skip: a cluster's /scratch, and W&B's sync (tests/test_wandb.py runs W&B "
                                         "offline)"),
    (r"--output mydata", "skip: names your own files (books/, notes.jsonl, table.parquet)"),
    (r"--data shakespeare ", "test_the_local_text_command_runs_the_quick_starts_settings_in_a_log_dir_of_its_own"),
    (r"^python (train_gpt2|plot)\.py|^python -c|^python benchmarks/memory\.py|^python fineweb\.py --input|^lm_eval|"
     r"^hf ", "run"),
]


def readme_text():
    with open(README, encoding="utf-8") as f:
        return f.read()


def section(title):
    """The README's section whose heading starts with title, up to the next one."""
    text = readme_text()
    return re.search(rf"\n## {re.escape(title)}.*?\n(.*?)(?=\n## |\Z)", text, re.S).group(1)


def block_commands(text):
    """The commands of text's bash blocks as a user pastes them: a line with its continuations, a script whole."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        if block.startswith("#!"):
            commands.append(block.strip())
            continue
        commands += [line.strip() for line in re.split(r"(?<!\\)\n", block)
                     if line.strip() and not line.lstrip().startswith("#")]
    return commands


def how(command):
    return next((how for pattern, how in HOW if re.search(pattern, command)), None)


def words(command):
    """The words bash passes to a command (its quoting, continuations and comment as bash reads them)."""
    result = subprocess.run(["bash", "-c", f"printf '%s\\0' {command}"], capture_output=True, text=True, check=True)
    return result.stdout.split("\0")[:-1]


def commands_of(title, start):
    """The commands of a README section's blocks that start so, as words."""
    found = [words(command) for command in block_commands(section(title)) if command.startswith(start)]
    assert found, (title, start)
    return found


def readme_commands():
    """The README's commands: its bash blocks, and the ones it shows inline (`python ...`)."""
    readme = readme_text()
    return "\n".join(re.findall(r"```bash\n(.*?)```", readme, re.S) + re.findall(r"`(python [^`]+)`", readme))


def test_every_readme_command_is_run_here_or_skipped_with_its_reason():
    commands = block_commands(readme_text())
    assert len(commands) > 30, commands
    unknown = [command for command in commands if how(command) is None]
    assert not unknown, f"a README command this file neither runs nor skips with a reason: {unknown}"


# a stand-in for a command .ci/run runs: it records its name and arguments, tab-separated, and exits with $name_EXIT
STUB = """#!/bin/sh
{{ printf '%s' {name}; printf '\\t%s' "$@"; printf '\\n'; }} >> "$CI_COMMANDS"
exit "${{{name}_EXIT:-0}}"
"""


def ci_commands(directory, **env):
    """`bash .ci/run` in a copy of its own in directory, with python3, python, pip and ruff stubs (STUB) first on PATH,
    so that it installs and tests nothing: its exit code, and the commands it ran, as argument lists, in order."""
    (directory / ".ci").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, ".ci", "run"), directory / ".ci" / "run")
    (directory / ".venv" / "bin").mkdir(parents=True)
    (directory / ".venv" / "bin" / "activate").write_text("")  # the stub python3 makes no venv; the stubs stay first
    stubs, log = directory / "stubs", directory / "commands"
    stubs.mkdir()
    for name in ("python3", "python", "pip", "ruff"):
        (stubs / name).write_text(STUB.format(name=name))
        (stubs / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{stubs}{os.pathsep}{os.environ['PATH']}", CI_COMMANDS=str(log), **env)
    result = run_command(["bash", str(directory / ".ci" / "run")], directory, env, timeout=30)
    return result.returncode, [line.split("\t") for line in log.read_text().splitlines()] if log.exists() else []


def test_ci_runs_the_readmes_test_lines(tmp_path):
    """The README lost its test command once, while CI said it ran "the README's test command": its two lines that set
    up and run the tests are in the Quick start, and .ci/run runs each of them word for word, the tests last, so that
    their result is CI's."""
    lines = block_commands(section("Quick start"))
    tests = [line for line in lines if line.startswith(("pip install -r requirements.txt pytest", "python -m pytest"))]
    assert len(tests) == 2, lines
    code, commands = ci_commands(tmp_path / "passing")
    assert code == 0, commands
    assert shlex.split(tests[0]) in commands and ["ruff", "check", "."] in commands, commands
    assert commands[-1] == shlex.split(tests[-1]), commands
    code, commands = ci_commands(tmp_path / "failing", python_EXIT="1")
    assert code == 1 and commands[-1] == shlex.split(tests[-1]), (code, commands)


# -----------------------------------------------------------------------------
# A clone where the quick start ran


def as_here(args, clone):
    """A command's arguments with the checkpoints the README names by their step (log/ckpt_000900.pt, ckpt_019073.pt)
    replaced by the one the shortened quick start wrote."""
    return [clone.checkpoint if re.fullmatch(r"log/ckpt_\d{6}\.pt", arg) else arg for arg in args]


def run_python(args, capsys, clone, extra=()):
    """A README `python X.py ...` command, in this process: train_gpt2.py's and plot.py's main; (code, out, err)."""
    script, *rest = as_here(args[1:], clone)
    main = {"train_gpt2.py": train_gpt2.main, "plot.py": plot.main}[script]
    return run_main(rest + list(extra), capsys, main=main)


class Clone(NamedTuple):
    root: pathlib.Path  # a directory with no shards, where the quick start ran
    checkpoint: str  # the quick start's last checkpoint, relative to root


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A directory with no shards, where the quick start's `python train_gpt2.py` ran (shortened), as a user's clone
    after it: log/ holds its log.jsonl and final checkpoint."""
    root = tmp_path_factory.mktemp("clone")
    assert "python train_gpt2.py" in block_commands(section("Quick start"))
    before, threads = os.getcwd(), torch.get_num_threads()
    os.chdir(root)
    torch.set_num_threads(1)
    try:
        train_gpt2.main(SHRINK)
    finally:
        os.chdir(before)
        torch.set_num_threads(threads)
    return Clone(root, "log/ckpt_000003.pt")


def test_the_quick_start_and_what_to_do_next(clone, capsys, monkeypatch):
    """What `log/` holds after the quick start, as the README says; then its next steps: samples, the plot, the modern
    recipe in log_modern/, the export."""
    monkeypatch.chdir(clone.root)
    assert {"log.jsonl", "ckpt_000003.pt"} <= set(os.listdir("log"))
    for args in commands_of("Quick start", "python ")[1:]:  # after the quick start itself
        if args[1] == "-m":
            continue  # the test command: this suite
        if "--recipe" in args and not hasattr(torch.optim, "Muon"):
            continue  # needs PyTorch 2.9
        if args[1] == "plot.py" and plot.plt is None:
            continue  # matplotlib: optional
        if "--export-hf" in args and os.path.exists(args[args.index("--export-hf") + 1]):
            continue  # the fixture `exported` made it, for a test that ran before this one
        extra = SHRINK if args[1] == "train_gpt2.py" and "--sample" not in args and "--export-hf" not in args else ()
        code, out, err = run_python(args, capsys, clone, extra)
        assert code == 0, (args, err)
        if "--sample" in args:
            assert "--- sample 3/3 (step 3) ---" in out and "ROMEO:" in out
    assert json.load(open("hf/run1/config.json"))["architectures"] == ["GPT2LMHeadModel"]
    assert plot.plt is None or os.path.isfile("log/curves.png")


# -----------------------------------------------------------------------------
# Reproducing GPT-2: the memory estimate


def test_the_memory_estimate_gives_the_readmes_numbers(tmp_path):
    """`benchmarks/memory.py` needs no GPU: the per-GPU GiB of GPT-2 XL on 8 GPUs the README quotes are its own."""
    [args] = commands_of("Reproducing GPT-2", "python benchmarks/memory.py")
    result = run_command([sys.executable] + args[1:], REPO, dict(os.environ), timeout=300)
    assert result.returncode == 0, result.stderr
    total = [line for line in result.stdout.splitlines() if line.startswith("total")]
    assert total and "42.88" in total[0] and "20.24" in total[0], result.stdout
    text = " ".join(section("Reproducing GPT-2").split())
    assert "42.9 GiB with DDP" in text and "20.2 GiB with FSDP" in text


# -----------------------------------------------------------------------------
# The modern recipe


@needs_muon
def test_the_modern_recipes_commands(clone, capsys, monkeypatch):
    monkeypatch.chdir(clone.root)
    for args in commands_of("The modern recipe", "python train_gpt2.py"):
        code, out, err = run_python(args, capsys, clone, SHRINK)
        assert code == 0, (args, err)
    assert any(name.startswith("ckpt_") for name in os.listdir("log_modern"))


# -----------------------------------------------------------------------------
# Exporting, and evaluating


@pytest.fixture(scope="module")
def exported(clone):
    """The `python train_gpt2.py --export-hf` lines that read the clone's runs, run there where the quick start's test
    has not made them: the Quick start's hf/run1, and the Export section's hf/modern and hf/step900 (OpenAI's, which
    downloads, is test_the_export_commands')."""
    before = os.getcwd()
    os.chdir(clone.root)
    try:
        for args in (commands_of("Quick start", "python train_gpt2.py --export-hf")
                     + commands_of("Exporting to Hugging Face", "python train_gpt2.py --export-hf")):
            made = args[args.index("--export-hf") + 1]
            if "--init-from" in args or os.path.exists(made) or ("modern" in made and not os.path.isdir("log_modern")):
                continue
            train_gpt2.main(as_here(args[2:], clone))
    finally:
        os.chdir(before)
    return clone


class FakeHub(http.server.ThreadingHTTPServer):
    """The Hub's API as `hf upload` and `hf download` use it: a repo created, a model card's metadata checked, its
    files' upload modes asked, one commit of base64 files (kept in .committed); a dataset's revision, its file tree
    and each file (.dataset)."""
    SHA = "c" * 40

    def __init__(self, dataset_name, dataset):
        super().__init__(("127.0.0.1", 0), FakeHubHandler)
        self.dataset_name, self.dataset, self.committed = dataset_name, dataset, {}
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class FakeHubHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, status, body=b"", content_type="application/json", head=False, headers=()):
        body = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def do_POST(self):
        hub, path = self.server, urllib.parse.urlsplit(self.path).path
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if path == "/api/repos/create":
            request = json.loads(body)
            repo = f"{request['organization']}/{request['name']}"
            return self.reply(200, {"url": f"{hub.url}/{repo}", "name": repo, "id": repo})
        if path == "/api/validate-yaml":  # the model card's metadata
            return self.reply(200, {})
        if "/preupload/" in path:
            files = json.loads(body)["files"]
            return self.reply(200, {"files": [dict(path=f["path"], uploadMode="regular", shouldIgnore=False)
                                              for f in files]})
        if "/commit/" in path:
            for line in body.decode().splitlines():
                record = json.loads(line)
                if record["key"] == "file":
                    hub.committed[record["value"]["path"]] = base64.b64decode(record["value"]["content"])
            repo = path.removeprefix("/api/models/").partition("/commit/")[0]
            return self.reply(200, {"commitUrl": f"{hub.url}/{repo}/commit/{hub.SHA}", "commitOid": hub.SHA})
        self.reply(404, {"error": "not here"})

    def do_GET(self, head=False):
        hub, path = self.server, urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        api, files = f"/api/datasets/{hub.dataset_name}/", f"/datasets/{hub.dataset_name}/resolve/{hub.SHA}/"
        if path.startswith(api + "revision/"):
            return self.reply(200, {"id": hub.dataset_name, "sha": hub.SHA,
                                    "siblings": [{"rfilename": name} for name in hub.dataset]}, head=head)
        if path.startswith(api + "tree/"):
            return self.reply(200, [dict(type="file", path=name, size=len(data), oid=hashlib.sha1(data).hexdigest())
                                    for name, data in hub.dataset.items()], head=head)
        if path.startswith(files) and path[len(files):] in hub.dataset:
            data = hub.dataset[path[len(files):]]
            return self.reply(200, data, "application/octet-stream", head, [
                ("X-Repo-Commit", hub.SHA), ("ETag", f'"{hashlib.sha1(data).hexdigest()}"')])
        self.reply(404, {"error": "not here"}, head=head)

    def do_HEAD(self):
        self.do_GET(head=True)


@pytest.fixture
def fake_hub():
    """A FakeHub in a thread, serving no dataset until its test gives it one."""
    with serving(FakeHub("none/none", {})) as hub:
        yield hub


def console_script(name):
    path = os.path.join(BIN, name)
    if not os.path.exists(path):
        pytest.skip(f"{name} is not installed here")
    return path


def test_the_export_commands(exported, gpt2_server, fake_hub, capsys, monkeypatch):
    """The Export section's commands: OpenAI's weights exported (from the local stand-in), the transformers one-liners
    on what the others wrote, `hf upload` against a local hub, which receives hf/run1's files as they are, and the
    way back: --init-from DIR fine-tuning (2 of its 100 steps) and evaluating."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(exported.root)
    monkeypatch.setenv("GPT2_CACHE_DIR", str(exported.root / "cache"))
    [args] = [args for args in commands_of("Exporting to Hugging Face", "python train_gpt2.py --export-hf")
              if "--init-from" in args]
    code, _, err = run_python(args, capsys, exported)
    assert code == 0, err
    written = {"hf/run1": "GPT2LMHeadModel", "hf/step900": "GPT2LMHeadModel", "hf/gpt2": "GPT2LMHeadModel"}
    if os.path.isdir("hf/modern"):
        written["hf/modern"] = "NanoChatForCausalLM"
    for path, architecture in written.items():
        assert json.load(open(os.path.join(path, "config.json")))["architectures"] == [architecture]
    for args in commands_of("Exporting to Hugging Face", "python -c"):
        if re.search(r'model="([^"]+)"', args[2]).group(1) in written:
            torch.manual_seed(0)  # the sampling
            exec(args[2], {})
            printed = capsys.readouterr().out
            assert "'generated_text': " in printed and "Hello, I" in printed, printed
    [upload] = commands_of("Exporting to Hugging Face", "hf upload")
    result = run_command([console_script("hf")] + upload[1:], None,
                         dict(os.environ, HF_ENDPOINT=fake_hub.url, HF_TOKEN="hf_test"), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert fake_hub.committed == {name: open(os.path.join("hf/run1", name), "rb").read()
                                  for name in os.listdir("hf/run1")}
    for args in commands_of("Exporting to Hugging Face", "python train_gpt2.py --"):
        if "--export-hf" in args or ("hf/modern" in args and "hf/modern" not in written):
            continue
        code, printed, err = run_python(args, capsys, exported, EVAL_SHORT if "--eval-only" in args else SHORT)
        assert code == 0, (args, err)
        assert "the weights in hf/" in printed and "val loss" in printed


def test_the_evaluating_commands(exported, gpt2_server, capsys, monkeypatch, tmp_path):
    """--eval-only of OpenAI's GPT-2 (the local stand-in) and of the quick start's checkpoint, with CORE (a small
    bundle of the real one's format for the download), GPT-2's validation loss in the run's log directory, and the
    plots, which draw it."""
    monkeypatch.chdir(exported.root)
    monkeypatch.setenv("GPT2_CACHE_DIR", str(exported.root / "cache"))
    bundle = str(write_bundle(tmp_path / "eval_bundle", bundle_tasks(tiny_model())))
    for args in commands_of("Evaluating", "python train_gpt2.py"):
        core = ["--core-data", bundle] if "--core-every" in args else []
        code, out, err = run_python(args, capsys, exported, ["--val-tokens", "1024", *core])
        assert code == 0, (args, err)
        assert "val loss" in out and (not core or re.search(r"\| core -?[\d.]+ \(6 tasks, ", out)), out
    assert any(json.loads(line).get("init_from") == "gpt2" for line in open("log/log.jsonl"))  # GPT-2's, in the run's
    if plot.plt is None:
        pytest.skip("plot.py needs matplotlib, which is not installed")
    for args in commands_of("Evaluating", "python plot.py"):
        if "log_modern" in args and not os.path.isdir("log_modern"):
            continue
        code, out, err = run_python(args, capsys, exported)
        assert code == 0, (args, err)
        assert "GPT-2 val_loss" in out, out  # the dashed line of GPT-2's validation loss


def test_lm_eval_as_the_readme_installs_and_runs_it(exported, tmp_path):
    """`pip install lm-eval` left out the harness's hf model's own dependencies (`lm_eval --model hf` stopped with
    "No module named 'accelerate'"): its `lm_eval[hf]` brings them. The first `lm_eval` line runs as written, on a
    local HellaSwag-format task for the network's `--tasks hellaswag`; the second is the same command on the modern
    recipe's export, which tests/test_export.py scores with the harness's hf model in this process (each command
    first reads the harness's 14,000 task files, 12 s here)."""
    [install] = commands_of("Evaluating", "pip install")
    assert install == ["pip", "install", "lm_eval[hf]"]
    lm_eval = console_script("lm_eval")
    examples = tmp_path / "hellaswag_val.jsonl"
    write_jsonl(examples, synthetic_examples([0, 1, 2, 3]))
    write_harness_task(tmp_path, examples)
    first, second = commands_of("Evaluating", "lm_eval")
    assert [arg.replace("hf/modern", "hf/run1") for arg in second] == first
    assert first[first.index("--tasks") + 1] == "hellaswag"
    first[first.index("--tasks") + 1] = HARNESS_TASK
    result = run_command([lm_eval] + first[1:] + ["--include_path", str(tmp_path)], exported.root,
                         dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1"), timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert re.search(rf"\|{HARNESS_TASK}\s*\|.*\|acc\s*\|", result.stdout), result.stdout


# -----------------------------------------------------------------------------
# Preparing data


def write_parquet(path, texts):
    import pyarrow as pa
    import pyarrow.parquet as pq
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.table({"text": texts}), path)


PARQUET = {"sample/10BT/000_00000.parquet": ["To be, or not to be", "that is the question"],
           "sample/10BT/001_00000.parquet": ["Whether 'tis nobler in the mind to suffer"],
           "sample/100BT/000_00000.parquet": ["not this sample"]}


def parquet_bytes(tmp_path):
    files = {}
    for name, texts in PARQUET.items():
        write_parquet(str(tmp_path / "made" / name), texts)
        files[name] = (tmp_path / "made" / name).read_bytes()
    return files


def test_parquet_files_fetched_with_hf_download_make_shards(fake_hub, tmp_path):
    """`hf download` (huggingface-cli's successor: transformers 5 installs no huggingface-cli) fetches the sample's
    parquet files from a local hub, and the README's `fineweb.py --input` line shards them."""
    fake_hub.dataset_name, fake_hub.dataset = "HuggingFaceFW/fineweb-edu", parquet_bytes(tmp_path)
    download, shard = [command for command in commands_of("Preparing data", "")
                       if command[0] == "hf" or "sample/10BT/" in command]
    work = tmp_path / "work"
    work.mkdir()
    result = run_command([console_script("hf")] + download[1:], work, dict(os.environ, HF_ENDPOINT=fake_hub.url),
                         timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(os.listdir(work / "sample" / "10BT")) == ["000_00000.parquet", "001_00000.parquet"]
    result = run_command([sys.executable, os.path.join(REPO, "fineweb.py")] + shard[2:], work, dict(os.environ),
                         timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "edufineweb_val_000000.npy" in os.listdir(work / "edu_fineweb10B")


def test_the_local_text_commands_shard_tiny_shakespeare(tmp_path):
    [args] = commands_of("Preparing data", "python fineweb.py --input input.txt")
    shutil.copy(os.path.join(REPO, "input.txt"), tmp_path)
    result = run_command([sys.executable, os.path.join(REPO, "fineweb.py")] + args[2:], tmp_path, dict(os.environ),
                         timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    shards = sorted(name for name in os.listdir(tmp_path / "shakespeare") if name.endswith(".npy"))
    assert shards == [f"shakespeare_train_{i:06d}.npy" for i in range(1, 11)] + ["shakespeare_val_000000.npy"]
    assert "1 val + 10 train shards" in section("Preparing data")  # as its comment says


@pytest.mark.skipif(not shutil.which("bash"), reason="no bash to read the command as a user's shell does")
def test_the_local_text_command_runs_the_quick_starts_settings_in_a_log_dir_of_its_own(tmp_path, monkeypatch):
    """The README trains on fineweb.py's shards of tiny Shakespeare with the quick start's settings: once they were
    only some of them (not its samples' prompt, their number and length, nor its validation tokens), and in log/,
    where the quick start's run was, it was refused ("the checkpoint's data position is in other training shards").
    Every setting must be what `python train_gpt2.py` without shards resolves, but --data, --log-dir and --preset."""
    [command] = commands_of("Preparing data", "python train_gpt2.py --data shakespeare")
    monkeypatch.chdir(tmp_path)  # no edu_fineweb10B here: the quick start's preset
    env = train_gpt2.Env(rank=0, local_rank=0, world_size=1, device="cpu", device_type="cpu")
    quick_start = vars(resolved([], env))
    local_text = vars(resolved(command[2:], env))
    assert {k for k in quick_start if local_text[k] != quick_start[k]} == {"data", "log_dir", "preset"}
    assert local_text["data"] == "shakespeare"


# -----------------------------------------------------------------------------
# What the commands write


def plot_outputs(commands):
    """What each `python plot.py ...` writes where it names no --out: plot.py's own default for its log dirs."""
    outputs = set()
    for line in re.findall(r"python plot\.py(.*)", commands):
        words = shlex.split(line.split("#")[0])
        if "--out" in words or any(re.fullmatch(r"[A-Z_]+", word) for word in words):  # a placeholder: DIR
            continue
        log_dirs = [word for i, word in enumerate(words) if not word.startswith("-")
                    and (i == 0 or words[i - 1] not in ("--recipe", "--x"))]
        outputs.add(plot.default_out(log_dirs or ["log"]))
    return outputs


@pytest.mark.skipif(not (shutil.which("git") and os.path.exists(os.path.join(REPO, ".git"))), reason="not a git clone")
def test_what_the_readmes_commands_write_is_ignored_by_git():
    commands = readme_commands()
    paths = sorted(path for path in {*WRITES.findall(commands), *plot_outputs(commands)} if not os.path.isabs(path))
    assert {"hf/run1", "log", "shakespeare", "ladder.json", "log/curves.png", "compare.png"} <= set(paths), paths
    for path in paths:
        result = subprocess.run(["git", "check-ignore", "-q", "--no-index", path + "/x"], cwd=REPO)
        if result.returncode != 0:  # a file rather than a directory
            result = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO)
        assert result.returncode == 0, f"{path}, which a README command writes, is not in .gitignore"


# -----------------------------------------------------------------------------
# Links between the docs


def outside_code(text):
    """Markdown text without its fenced code blocks, whose lines are commands and output, not headings or links."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def heading_anchors(text):
    """The anchors GitHub gives a markdown file's headings: lowercased, punctuation dropped, spaces as hyphens, and
    -1, -2, ... after a repeated one."""
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *$", outside_code(text), re.M):
        anchor = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")
        seen[anchor] = seen.get(anchor, 0) + 1
    return anchors


def test_every_link_between_the_docs_resolves():
    """A link from the README or a page of docs/ names a file of the repository that exists, and its #anchor a
    heading of that file."""
    pages = [README, *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]
    assert len(pages) > 2, pages
    broken = []
    for page in pages:
        text = open(page, encoding="utf-8").read()
        for target in re.findall(r"\]\(([^)\s]+)\)", outside_code(text)):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(path):
                broken.append(f"{os.path.relpath(page, REPO)}: {target} (no such file)")
            elif anchor and anchor not in heading_anchors(open(path, encoding="utf-8").read()):
                broken.append(f"{os.path.relpath(page, REPO)}: {target} (no such heading)")
    assert not broken, broken
