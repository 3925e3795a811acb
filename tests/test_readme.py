"""What the README shows: the files its commands make in a clone stay out of git's way (.gitignore covers them)."""
import os
import re
import shlex
import shutil
import subprocess

import pytest

import plot
import train_gpt2
from helpers import REPO

WRITES = re.compile(r"(?:--export-hf|--output|--log-dir|--json|--trace|mkdir -p) +([^\s`'\"]+)")


def readme_commands():
    """The README's commands: its bash blocks, and the ones it shows inline (`python ...`)."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    return "\n".join(re.findall(r"```bash\n(.*?)```", readme, re.S) + re.findall(r"`(python [^`]+)`", readme))


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


def shell_words(command):
    """The words bash passes to a README command (its quoting, continuations and comment as bash reads them)."""
    program, _, args = command.partition(" train_gpt2.py ")
    assert program == "python", command
    result = subprocess.run(["bash", "-c", f"printf '%s\\0' {args}"], capture_output=True, text=True, check=True)
    return result.stdout.split("\0")[:-1]


@pytest.mark.skipif(not shutil.which("bash"), reason="no bash to read the command as a user's shell does")
def test_the_local_text_command_runs_the_quick_starts_settings_in_a_log_dir_of_its_own(tmp_path, monkeypatch):
    """The README trains on fineweb.py's shards of tiny Shakespeare with 'the Shakespeare preset's settings': they
    were only some of them (not its samples' prompt, their number and length, nor its validation tokens), and in
    log/, where the quick start's run was, it was refused ("the checkpoint's data position is in other training
    shards"). Every setting must be what `python train_gpt2.py` without shards resolves, but --data and --log-dir."""
    [command] = re.findall(r"^python train_gpt2\.py --data shakespeare .*?[^\\]$", readme_commands(), re.M | re.S)
    monkeypatch.chdir(tmp_path)  # no edu_fineweb10B here: the quick start's preset
    env = train_gpt2.Env(rank=0, local_rank=0, world_size=1, device="cpu", device_type="cpu")
    quick_start = vars(train_gpt2.resolve_config(*train_gpt2.parse_args([]), env))
    local_text = vars(train_gpt2.resolve_config(*train_gpt2.parse_args(shell_words(command)), env))
    assert {k for k in quick_start if local_text[k] != quick_start[k]} == {"data", "log_dir"}
    assert local_text["data"] == "shakespeare"
