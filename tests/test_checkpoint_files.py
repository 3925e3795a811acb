"""Checkpoints as files that other processes read: a damaged --fsdp directory is skipped, or refused in one line, as
a damaged file is; and a reader beside the running training (--eval-only, --sample, --export-hf) reads a whole
checkpoint, while the training never waits long for it, nor fails because of it."""
import fcntl
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import types

import pytest

import train_gpt2
from helpers import REPO, TINY, expect_usage_error, run_main, start_script, wait_for_step, write_shards
from machinery import checkpoints, files, locks, resume

sys.path.insert(0, os.path.join(REPO, "tests", "scripts"))
import read_lock_as_on_nfs  # noqa: E402

SHARDED = ["--max-steps", "8", "--checkpoint-every", "4", "--fsdp"]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The log dir of an --fsdp run in one process, with checkpoints at steps 4 and 8: (its flags, its log dir)."""
    root = tmp_path_factory.mktemp("sharded")
    args, log_dir = TINY + ["--data", write_shards(root / "data")], root / "log"
    train_gpt2.main([str(a) for a in args + SHARDED + ["--log-dir", log_dir]])  # it exits on an error alone
    assert checkpoints.checkpoint_paths(log_dir) == [str(log_dir / name) for name in ("ckpt_000004.dcp",
                                                                                          "ckpt_000008.dcp")]
    return args, log_dir


def copy_of(sharded, tmp_path):
    args, log_dir = sharded
    shutil.copytree(log_dir, tmp_path / "log")
    return args, tmp_path / "log"


def cut_in_half(path):
    os.truncate(path, os.path.getsize(path) // 2)


DAMAGES = {  # what is done to the latest checkpoint's directory, and what the line says of it
    "a slice file gone": (lambda d: os.remove(d / "__0_0.distcp"), "__0_0.distcp, which its index .metadata names, is "
                                                                   "missing"),
    "the index gone": (lambda d: os.remove(d / ".metadata"), "its index .metadata is missing"),
    "a slice file cut in half": (lambda d: cut_in_half(d / "__0_0.distcp"), "__0_0.distcp is cut short: "),
    "the index cut in half": (lambda d: cut_in_half(d / ".metadata"), "its index .metadata cannot be read"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_sharded_checkpoint_is_skipped_or_refused_in_one_line(sharded, tmp_path, capsys, damage):
    """Only run.pt was read to choose a checkpoint: --eval-only (and every reader) ended in torch's FileNotFoundError,
    "metadata is None" or "failed finding central directory" tracebacks. Now the index and the files it names are
    checked: --eval-only goes back to the previous checkpoint with a warning, as for a .pt cut in half, and --sample
    refuses the damaged one by name in one line."""
    args, log_dir = copy_of(sharded, tmp_path)
    damaged = log_dir / "ckpt_000008.dcp"
    do, reason = DAMAGES[damage]
    do(damaged)
    expect_usage_error(["--sample", damaged, "--device", "cpu"], capsys, f"--sample {damaged}: cannot load it", reason)
    code, out, err = run_main(args + ["--eval-only", "--log-dir", log_dir], capsys)
    assert code == 0, err
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"skipping unreadable checkpoint {damaged} (" in warnings[0], out
    assert reason in warnings[0]
    assert f"evaluating {log_dir / 'ckpt_000004.dcp'} (step 4)" in out


def test_training_and_export_go_back_past_a_damaged_sharded_checkpoint(sharded, tmp_path, capsys):
    """The issue's case: a slice file of the latest checkpoint deleted. The training resumed from it and died in
    torch's FileNotFoundError; now it resumes from the one before, as --export-hf exports that one."""
    args, log_dir = copy_of(sharded, tmp_path)
    os.remove(log_dir / "ckpt_000008.dcp" / "__0_0.distcp")
    code, out, err = run_main(["--export-hf", tmp_path / "hf", "--log-dir", log_dir], capsys)
    assert code == 0, err
    assert f"exported {log_dir / 'ckpt_000004.dcp'} to {tmp_path / 'hf'}" in out and "warning: skipping" in out
    code, out, err = run_main(args + SHARDED + ["--max-steps", "10", "--log-dir", log_dir], capsys)
    assert code == 0, err
    assert "warning: skipping unreadable checkpoint" in out and "resuming from the checkpoint of step 4" in out
    assert os.path.exists(log_dir / "ckpt_000010.dcp")


@pytest.mark.parametrize("inside", ["run.pt", "__0_0.distcp"])
def test_a_file_inside_a_sharded_checkpoint_is_refused_naming_the_directory(sharded, tmp_path, capsys, inside):
    """run.pt is a .pt: --resume of it read it, and then failed in torch with "Not a directory"."""
    args, log_dir = copy_of(sharded, tmp_path)
    directory = log_dir / "ckpt_000004.dcp"
    for command in (args + SHARDED + ["--log-dir", log_dir, "--resume", directory / inside],
                    ["--sample", directory / inside, "--device", "cpu"]):
        expect_usage_error(command, capsys, f"{directory / inside} is a file inside the sharded checkpoint "
                                            f"{directory}: pass the directory {directory}")


# -----------------------------------------------------------------------------
# Readers beside the training


@pytest.mark.parametrize("name", ["ckpt_000004.pt", "ckpt_000004.dcp"])
def test_the_training_prunes_a_checkpoint_only_once_no_reader_holds_it(tmp_path, name):
    """A reader holds the checkpoint it chose until its tensors are loaded: the training's pruning passes it by, and
    deletes it at its next prune, once the reader has let go."""
    for step in (4, 8):
        path = tmp_path / name.replace("4", str(step))
        path.mkdir() if name.endswith(".dcp") else path.write_bytes(b"x")
    held = locks.ReadLock(str(tmp_path / name))
    checkpoints.prune_checkpoints(tmp_path, keep=1)  # at once: the training never waits for a reader
    assert len(checkpoints.checkpoint_paths(tmp_path)) == 2
    held.release()
    checkpoints.prune_checkpoints(tmp_path, keep=1)
    assert [os.path.basename(p) for p in checkpoints.checkpoint_paths(tmp_path)] == [name.replace("4", "8")]


def waiting_for_lock(path):
    """Whether a process waits for a lock on path (Linux's /proc/locks lists the waiters with ->)."""
    inode = os.stat(path).st_ino
    with open("/proc/locks") as f:
        return any("->" in line and line.split()[6].endswith(f":{inode}") for line in f)


def test_a_reader_that_chose_a_checkpoint_being_pruned_picks_again(sharded, tmp_path, capsys):
    """A reader that chose the latest checkpoint as the training was deleting it waits for the deletion, sees that the
    path names nothing any more, and chooses again: the one before, without calling it unreadable."""
    if not os.path.exists("/proc/locks"):
        pytest.skip("needs Linux's /proc/locks to see the reader wait")
    _, log_dir = copy_of(sharded, tmp_path)
    latest = str(log_dir / "ckpt_000008.dcp")
    cfg = types.SimpleNamespace(resume="auto", eval_only=True, init_from="scratch", log_dir=str(log_dir))
    chosen = []
    with locks.without_readers(latest, wait=False) as unheld:  # the training, deleting it
        assert unheld
        reader = threading.Thread(target=lambda: chosen.append(resume.find_resume_checkpoint(cfg, 0, 1)))
        reader.start()
        deadline = time.time() + 30
        while not waiting_for_lock(latest):
            assert time.time() < deadline and reader.is_alive()
            time.sleep(0.01)
        files.remove(latest)
    reader.join()
    (ckpt, path), = chosen
    assert path == str(log_dir / "ckpt_000004.dcp") and ckpt["step"] == 4
    assert "warning" not in capsys.readouterr().out


def test_on_nfs_the_training_prunes_without_readers_and_passes_a_held_checkpoint_by(tmp_path, monkeypatch):
    """On NFS, flock is a lock of the whole file that, exclusive, needs the file opened to write: the prune after a
    save failed there with EBADF, ending a cluster's run at its third checkpoint. It now locks a descriptor opened to
    write: a checkpoint another process reads stays, the others go, and a sharded checkpoint's directory goes too."""
    monkeypatch.setattr(fcntl, "flock", read_lock_as_on_nfs.nfs_flock)
    for name in ("ckpt_000002.pt", "ckpt_000004.pt", "ckpt_000006.dcp", "ckpt_000008.pt"):
        (tmp_path / name).mkdir() if name.endswith(".dcp") else (tmp_path / name).write_bytes(b"x")
    reader = subprocess.Popen([sys.executable, read_lock_as_on_nfs.__file__, REPO, str(tmp_path / "ckpt_000004.pt")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline() == "held\n"
        checkpoints.prune_checkpoints(tmp_path, keep=1)  # at once, as on a local disk
        assert sorted(os.listdir(tmp_path)) == ["ckpt_000004.pt", "ckpt_000008.pt"]
    finally:
        reader.communicate("")  # lets go
    assert reader.returncode == 0
    checkpoints.prune_checkpoints(tmp_path, keep=1)
    assert os.listdir(tmp_path) == ["ckpt_000008.pt"]


def test_saving_a_step_again_waits_for_the_reader_of_its_old_checkpoint(tmp_path, capsys):
    """The same step saved again (evaluated since) replaces its directory only once no reader holds the old one: a
    reader reads either whole, never one deleted under it."""
    def saving(content):
        def save(directory):
            with open(os.path.join(directory, "run.pt"), "wb") as f:
                f.write(content)
        return save

    checkpoints.write_sharded_checkpoint(str(tmp_path), 10, saving(b"old"), size=3, keep=2, rank=0)
    held = locks.ReadLock(str(tmp_path / "ckpt_000010.dcp"))
    t0 = time.perf_counter()  # before the timer starts: its 0.5 s are all within what is measured
    threading.Timer(0.5, held.release).start()
    checkpoints.write_sharded_checkpoint(str(tmp_path), 10, saving(b"new"), size=3, keep=2, rank=0)
    assert time.perf_counter() - t0 >= 0.5
    assert "waiting for a process that is loading" in capsys.readouterr().out
    assert os.listdir(tmp_path) == ["ckpt_000010.dcp"]
    assert (tmp_path / "ckpt_000010.dcp" / "run.pt").read_bytes() == b"new"


def test_readers_beside_a_training_that_prunes_every_step_read_whole_checkpoints(shards, tmp_path, capsys):
    """--eval-only again and again for 2 s beside an --fsdp training that saves every step and keeps one checkpoint:
    most died in "metadata is None", the directory they had chosen deleted under them. Every one now reads a whole
    checkpoint, and the training goes on untouched. (--export-hf and --sample hold a checkpoint the same way, through
    checkpoints.load and model_from_checkpoint; --export-hf takes seconds, for its tokenizer files.)"""
    log_dir = tmp_path / "run"
    args = TINY + ["--data", shards, "--log-dir", log_dir]
    training = start_script(args + ["--max-steps", "100000", "--checkpoint-every", "1", "--keep-checkpoints", "1",
                                    "--fsdp"], tmp_path, tmp_path / "training.out")
    try:
        wait_for_step(training, log_dir, 2)
        reads, deadline = 0, time.time() + 2
        while reads < 5 or time.time() < deadline:
            code, out, err = run_main(args + ["--eval-only"], capsys)
            assert code == 0, err[-3000:]
            assert re.search(rf"^evaluating {re.escape(str(log_dir))}/ckpt_0*(\d+)\.dcp \(step \1\)$", out, re.M), out
            assert "warning" not in out  # none was skipped as unreadable, as one deleted as it was chosen was
            reads += 1
        assert training.poll() is None
    finally:
        training.terminate()  # it saves, and ends cleanly
        training.wait()
    out = (tmp_path / "training.out").read_text()
    assert training.returncode == 0 and "error" not in out and "Traceback" not in out, out[-3000:]
