"""What the README shows: the files its commands make in a clone stay out of git's way (.gitignore covers them)."""
import os
import re
import shutil
import subprocess

import pytest

from helpers import REPO

WRITES = re.compile(r"(?:--export-hf|--output|--log-dir|--json|--trace|mkdir -p) +([^\s`'\"]+)")


def readme_commands():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        return "\n".join(re.findall(r"```bash\n(.*?)```", f.read(), re.S))


@pytest.mark.skipif(not (shutil.which("git") and os.path.isdir(os.path.join(REPO, ".git"))), reason="not a git clone")
def test_what_the_readmes_commands_write_is_ignored_by_git():
    paths = sorted({path for path in WRITES.findall(readme_commands()) if not os.path.isabs(path)})
    assert {"hf/run1", "log", "shakespeare", "ladder.json"} <= set(paths), paths  # the regex still finds them
    for path in paths:
        result = subprocess.run(["git", "check-ignore", "-q", "--no-index", path + "/x"], cwd=REPO)
        if result.returncode != 0:  # a file rather than a directory
            result = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO)
        assert result.returncode == 0, f"{path}, which a README command writes, is not in .gitignore"
