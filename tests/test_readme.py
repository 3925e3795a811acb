"""What the README shows: the files its commands make in a clone stay out of git's way (.gitignore covers them)."""
import os
import re
import shlex
import shutil
import subprocess

import pytest

import plot
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
