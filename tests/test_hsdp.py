"""--fsdp on several nodes (HSDP): each tensor split within a node, each node a replica, on the CPU with gloo. 4
processes as 2 "nodes" of 2: two torchrun launchers (--nnodes=2), and one launcher with --fsdp-shards 2. One run of
each, chained: the two-node run trains as DDP does and writes each slice once; the single launcher resumes its
checkpoint bitwise and is stopped by SIGTERM; that checkpoint resumes as FSDP on 4 processes, on 2 nodes of one
process (sharded over both), and as DDP on 1. The modern recipe (ShardedMuon on the 2-D mesh) against DDP, with a rank
killed outright. Launchers of different sizes (2, 1 and 1; 1 and 2), or whose directories hold different files, stopped
at once in one line. The mesh: its size, what each rank holds on 2 x 1 and 1 x 2, its refusals; and the memory
benchmark's HSDP column against a hand count."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

import train_gpt2
from helpers import (
    REPO,
    SCRIPT,
    TINY,
    expect_usage_error,
    last_json,
    load_ckpt,
    needs_muon,
    read_log,
    run_main,
    run_script,
    script_env,
    start_command,
    train_records,
    val_records,
    write_shards,
)
from machinery import checkpoints, errors, fsdp, resolution, sharded_checkpoints

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import memory  # noqa: E402

SIGNAL_AT_STEP = os.path.join(REPO, "tests", "scripts", "signal_at_step.py")
MESH_SLICES = os.path.join(REPO, "tests", "scripts", "mesh_slices.py")
# 8 steps of 1024 tokens: on 4 processes, 2 accumulation steps of 4 x 32 each (8 on 1 process); a checkpoint every 4
STEPS = ["--max-steps", "8", "--checkpoint-every", "4", "--total-batch-size", "1024", "--warmup-steps", "2"]
HSDP_LINE = "HSDP: 2 replicas x 2 shards"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("shards"), train_lengths=(9000, 8000), val_length=2000)


def nodes(sizes, args, cwd, out_path, timeout=240):
    """train_gpt2.py under one torchrun launcher per "node" on this machine, sizes[i] processes on node i
    (--nnodes=len(sizes), meeting at 127.0.0.1), in cwd (or cwd[i], a node's own directory): their exit codes, and
    node 0's output (rank 0's lines) in out_path, node i's in out_path.node{i}."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launchers = []
    for node, size in enumerate(sizes):
        command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(sizes)}", f"--nproc_per_node={size}",
                   f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}", SCRIPT, *args]
        with open(out_path if node == 0 else f"{out_path}.node{node}", "w") as out:
            where = cwd[node] if isinstance(cwd, list) else cwd
            launchers.append(start_command([str(word) for word in command], where, script_env(), stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True))
    try:
        return [launcher.wait(timeout) for launcher in launchers]
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)


def node_outputs(out_path, count):
    """What each node's launcher printed (nodes' out_path), node 0's first."""
    return [open(out_path if node == 0 else f"{out_path}.node{node}").read() for node in range(count)]


def copy_checkpoint(source_dir, step, log_dir):
    os.makedirs(log_dir)
    name = f"ckpt_{step:06d}.dcp"
    shutil.copytree(source_dir / name, log_dir / name)
    return log_dir / name


@pytest.fixture(scope="module")
def runs(shards, tmp_path_factory):
    """GPT-2's recipe for 8 steps on 4 processes: DDP; HSDP 2 x 2 on two torchrun launchers; and its step-4
    checkpoint resumed by one launcher of 4 processes with --fsdp-shards 2, whose rank 3 gets a SIGTERM as step 5
    begins. (root, args, {name: (log dir, output)})."""
    root = tmp_path_factory.mktemp("hsdp")
    args = TINY + ["--data", shards, "--max-lr", "1e-2", *STEPS]
    done = {}
    result = run_script(args + ["--log-dir", root / "ddp"], cwd=root, nproc=4)
    assert result.returncode == 0, result.stderr[-3000:]
    done["ddp"] = root / "ddp", result.stdout
    codes = nodes([2, 2], args + ["--fsdp", "--log-dir", root / "nodes"], root, root / "nodes.out")
    assert codes == [0, 0], "".join(out[-3000:] for out in node_outputs(root / "nodes.out", 2))
    done["nodes"] = root / "nodes", (root / "nodes.out").read_text()
    copy_checkpoint(root / "nodes", 4, root / "one_launcher")
    hsdp = ["--fsdp", "--fsdp-shards", "2", "--log-dir", root / "one_launcher"]
    result = run_script(["3", "5", "SIGTERM", *args, *hsdp], cwd=root, nproc=4, script=SIGNAL_AT_STEP)
    assert result.returncode == 0, result.stderr[-3000:]
    done["one_launcher"] = root / "one_launcher", result.stdout
    return root, args, done


def assert_losses_close(records, reference, steps, tolerance=1e-5):
    for step in steps:
        assert records[step]["train_loss"] == pytest.approx(reference[step]["train_loss"], abs=tolerance), step


def test_hsdp_on_two_nodes_trains_as_ddp_does_and_writes_each_slice_once(runs):
    """Two torchrun launchers of 2 processes: each node's processes split every tensor, the nodes replicate it, and
    the 8 steps' losses are DDP's within float32's reduction order (the same tokens: the batch does not depend on the
    layout). The checkpoints hold one copy of the weights and optimizer state, written by the first replica's ranks
    (0 and 1): the second replica's hold the same slices."""
    _, _, done = runs
    (nodes, out), (ddp, _) = done["nodes"], done["ddp"]
    mesh_line = f"{HSDP_LINE} (each tensor split over 2 processes: a node's 2 processes, torchrun's LOCAL_WORLD_SIZE=2;"
    assert out.index(mesh_line) < out.index("training from scratch")  # the run's first lines (torchrun's may precede)
    hsdp_records, ddp_records = train_records(read_log(nodes)), train_records(read_log(ddp))
    assert sorted(hsdp_records) == list(range(8))
    assert_losses_close(hsdp_records, ddp_records, range(8))
    assert abs(ddp_records[7]["train_loss"] - ddp_records[0]["train_loss"]) > 1e-3  # the weights moved past that
    assert val_records(read_log(nodes))[8]["val_loss"] == pytest.approx(val_records(read_log(ddp))[8]["val_loss"],
                                                                       abs=1e-5)
    dcp, _ = sharded_checkpoints.checkpoint_modules()
    checkpoint = nodes / "ckpt_000008.dcp"
    written = {item.relative_path for item in dcp.FileSystemReader(checkpoint).read_metadata().storage_data.values()}
    assert written == {"__0_0.distcp", "__1_0.distcp"}
    sizes = {name: os.path.getsize(checkpoint / name) for name in os.listdir(checkpoint) if name.endswith(".distcp")}
    assert sizes["__2_0.distcp"] == sizes["__3_0.distcp"] == 0, sizes
    whole = load_ckpt(ddp / "ckpt_000008.pt")
    one_copy = checkpoints.tensor_bytes({"model": whole["model"], "optimizers": whole["optimizers"]})
    assert one_copy < sum(sizes.values()) < 1.5 * one_copy  # two copies would be twice one


def test_hsdp_resumes_bitwise_on_the_same_layout_then_stops_on_sigterm(runs):
    """The two-node run's step-4 checkpoint resumed by one launcher of 4 processes with --fsdp-shards 2, the same
    mesh: steps 4 and 5 bitwise the two-node run's own. A SIGTERM to rank 3 alone as step 5 begins stops every rank
    after that step, with a checkpoint of step 6."""
    _, _, done = runs
    (one_launcher, out), (nodes, _) = done["one_launcher"], done["nodes"]
    assert out.splitlines()[0].startswith(f"{HSDP_LINE} (each tensor split over 2 processes: --fsdp-shards 2;")
    assert "resuming from the checkpoint of step 4" in out
    resumed, whole = train_records(read_log(one_launcher)), train_records(read_log(nodes))
    assert sorted(resumed) == [4, 5]
    for step in (4, 5):
        assert (resumed[step]["train_loss"], resumed[step]["grad_norm"]) == \
            (whole[step]["train_loss"], whole[step]["grad_norm"]), step
    assert "stopped by signal at step 6" in out
    assert sorted(os.listdir(one_launcher / "ckpt_000006.dcp")) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                    "__2_0.distcp", "__3_0.distcp", "run.pt"]


@pytest.mark.parametrize("layout, processes, flags", [
    ("fsdp_4", 4, ["--fsdp", "--fsdp-shards", "0"]),  # every rank one shard group, as FSDP on one node
    ("nodes_of_one", "1,1", ["--fsdp"]),  # 2 nodes of one process (tests/scripts/ranks.py's): FSDP over both
    ("ddp_1", 1, []),
])
def test_the_sigterm_checkpoint_resumes_on_another_layout(runs, tmp_path, capsys, layout, processes, flags):
    """HSDP 2 x 2's checkpoint of step 6 (the SIGTERM's) trains on as FSDP on 4 processes, on 2 nodes of one process
    each, and as DDP on one (no --fsdp): the weights and the optimizer state split anew by name, the data position
    kept. Steps 6 and 7 are DDP's on 4 processes within float32's reduction order, and the final checkpoint's data
    position is DDP's. Nodes of one process (one GPU each) shard over both, as the run's first line says, each rank
    writing its half (a shard group of one would have held whole copies, written by rank 0 alone); there a later
    checkpoint cut short is skipped."""
    _, args, done = runs
    log_dir = tmp_path / layout
    copy_checkpoint(done["one_launcher"][0], 6, log_dir)
    damaged = log_dir / "ckpt_000007.dcp"
    if layout == "nodes_of_one":
        shutil.copytree(log_dir / "ckpt_000006.dcp", damaged)
        os.truncate(damaged / "__1_0.distcp", 1000)
    argv = args + flags + ["--log-dir", log_dir]
    if processes == 1:
        code, out, err = run_main(argv, capsys)
        assert code == 0, err
    else:
        result = run_script(argv, cwd=tmp_path, nproc=processes)
        assert result.returncode == 0, result.stderr[-3000:]
        out = result.stdout
    if layout == "nodes_of_one":
        assert "FSDP: each tensor split over all 2 processes (a node of one process, torchrun's LOCAL_WORLD_SIZE=1, " \
               "shards nothing alone; --fsdp-shards 1 would keep whole copies on each, as DDP does)" in out
        slices = [os.path.getsize(log_dir / "ckpt_000008.dcp" / f"__{rank}_0.distcp") for rank in (0, 1)]
        assert min(slices) > 0.4 * sum(slices), slices
    assert "resuming from the checkpoint of step 6" in out and "HSDP" not in out
    assert (f"warning: skipping unreadable checkpoint {damaged} (__1_0.distcp is cut short" in out) == \
        (layout == "nodes_of_one")
    ddp_dir = done["ddp"][0]
    resumed, ddp = train_records(read_log(log_dir)), train_records(read_log(ddp_dir))
    assert sorted(resumed) == [6, 7]
    assert_losses_close(resumed, ddp, [6, 7])
    assert val_records(read_log(log_dir))[8]["val_loss"] == pytest.approx(
        val_records(read_log(ddp_dir))[8]["val_loss"], abs=1e-5)
    final = log_dir / ("ckpt_000008.pt" if processes == 1 else "ckpt_000008.dcp/run.pt")
    assert load_ckpt(final)["stream"] == load_ckpt(ddp_dir / "ckpt_000008.pt")["stream"]


@needs_muon
def test_the_modern_recipe_under_hsdp_and_a_rank_killed_outright(shards, tmp_path, capsys):
    """--recipe modern on HSDP 2 x 2 (one launcher, --fsdp-shards 2): ShardedMuon gathers each matrix within a node,
    and both replicas apply the same update, so the losses are DDP's. kill -9 of rank 3 as step 3 begins leaves the
    other ranks one line, the same on each, naming the checkpoint of step 2; that checkpoint trains on as DDP in one
    process (its Muon momentum read whole): its first step as DDP's on 4, then its trend (Muon orthogonalizes in
    bf16, where 8 micro-steps' sums round apart from 2's)."""
    args = TINY + ["--data", shards, "--recipe", "modern", *STEPS[:2], "--checkpoint-every", "2", *STEPS[4:]]
    result = run_script(args + ["--log-dir", tmp_path / "ddp"], cwd=tmp_path, nproc=4)
    assert result.returncode == 0, result.stderr[-3000:]
    ddp = train_records(read_log(tmp_path / "ddp"))
    log_dir = tmp_path / "hsdp"
    result = run_script(["3", "3", "SIGKILL", *args, "--fsdp", "--fsdp-shards", "2", "--log-dir", log_dir],
                        cwd=tmp_path, nproc=4, script=SIGNAL_AT_STEP)
    assert result.returncode != 0 and "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    assert result.stdout.splitlines()[0].startswith(HSDP_LINE)
    checkpoint = log_dir / "ckpt_000002.dcp"
    lines = set(result.stderr.strip().splitlines())
    assert lines == {f"error: another rank died (killed, perhaps by the kernel's out-of-memory killer, or failed: its "
                     f"own output says why); the latest checkpoint, {checkpoint}, is kept: run the same command again "
                     f"to resume from it"}, result.stderr
    hsdp = train_records(read_log(log_dir))
    assert sorted(hsdp) == [0, 1, 2]
    assert_losses_close(hsdp, ddp, [0, 1, 2])

    code, out, err = run_main(args + ["--log-dir", log_dir], capsys)  # without --fsdp, in one process
    assert code == 0, err
    assert f"resuming from the checkpoint of step 2 ({checkpoint})" in out
    resumed = train_records(read_log(log_dir))
    assert_losses_close(resumed, ddp, [2])
    assert_losses_close(resumed, ddp, [7], tolerance=1e-3)


@pytest.mark.parametrize("sizes, fragments", [
    ([2, 1, 1], ["--fsdp-shards 2 on ranks 0-1 (", "LOCAL_WORLD_SIZE=2", "0 on ranks 2-3 (", "LOCAL_WORLD_SIZE=1"]),
    ([1, 2], ["--fsdp-shards 0 on rank 0 (", "LOCAL_WORLD_SIZE=1", "2 on ranks 1-2 (", "LOCAL_WORLD_SIZE=2"]),
])
def test_nodes_of_different_sizes_stop_every_rank_at_once_in_one_line(shards, tmp_path, sizes, fragments):
    """--fsdp shards within a node by default, so torchrun launchers of 2, 1 and 1 processes (or 1 then 2) each
    decided a mesh of their own, and waited for the others in different collectives, for the process group's hour
    (or died of a gloo traceback). Every rank now compares its settings with the others' before any collective reads
    them: each ends within seconds with the same line, naming each node's processes and what to pass."""
    started = time.monotonic()
    batch = ["--batch-size", "2", "--total-batch-size", "768"]  # 2 x 32 tokens on 3 or 4 processes
    codes = nodes(sizes, TINY + ["--data", shards, *batch, "--fsdp", "--log-dir", tmp_path / "log"], tmp_path,
                  tmp_path / "out")
    elapsed = time.monotonic() - started
    outputs = node_outputs(tmp_path / "out", len(sizes))
    assert all(code != 0 for code in codes) and elapsed < 120, (codes, elapsed, outputs)
    ours = [out.split("torch/distributed/elastic")[0] for out in outputs]  # torchrun's own report follows
    lines = [line for out in ours for line in out.splitlines() if line.startswith("error: ")]
    assert len(lines) >= len(sizes) and len(set(lines)) == 1, outputs
    assert "Traceback" not in "".join(ours) and "HSDP" not in "".join(ours), outputs
    for fragment in fragments + ["pass --fsdp-shards with one value on every node", "--nproc_per_node"]:
        assert fragment in lines[0], (fragment, lines[0])


def test_nodes_that_hold_different_files_stop_every_rank_at_once_in_one_line(shards, tmp_path):
    """The presets depend on what a node's disk holds: without --data, a node whose directory has edu_fineweb10B/
    trains on it with the file's settings, and one without it tiny Shakespeare with SHAKESPEARE's. Two launchers of
    one process each (DDP) in such directories: each rank ends at once with the same line, naming settings they
    decided apart, what made each rank's, and what to do."""
    node_dirs = [tmp_path / "node0", tmp_path / "node1"]
    shutil.copytree(shards, node_dirs[0] / "edu_fineweb10B")
    node_dirs[1].mkdir()
    started = time.monotonic()
    codes = nodes([1, 1], TINY + ["--log-dir", tmp_path / "log"], node_dirs, tmp_path / "out")
    elapsed = time.monotonic() - started
    outputs = node_outputs(tmp_path / "out", 2)
    assert codes[0] != 0 and codes[1] != 0 and elapsed < 120, (codes, elapsed, outputs)
    lines = [line for out in outputs for line in out.split("torch/distributed/elastic")[0].splitlines()
             if line.startswith("error: ")]
    assert len(lines) == 2 and len(set(lines)) == 1 and "Traceback" not in outputs[0].split("torch/distributed")[0]
    for fragment in ["--data edu_fineweb10B on rank 0 (the file's default), ", " on rank 1 (preset SHAKESPEARE (",
                     "--max-steps 19073 on rank 0", "or start every node alike (the same --nproc_per_node, GPUs and "
                     "--data)"]:
        assert fragment in lines[0], (fragment, lines[0])


def test_the_mesh_splits_each_tensor_over_its_shard_group_and_copies_it_over_the_replicas(tmp_path):
    """On 2 processes, --fsdp-shards 1 is HSDP 2 x 1: a mesh of "replicate" 2 by "shard" 1, and each rank holds every
    row of each weight; --fsdp-shards 2 is FSDP's one group of 2, each rank half the rows. A mesh built (shards,
    replicas) would split each tensor over the replicas instead: on 4 nodes of 8, over half a node, copied 8 times."""
    found = last_json(run_script(["1", "2"], cwd=tmp_path, nproc=2, timeout=120, script=MESH_SLICES))
    assert found == {"1": [{"mesh": {"replicate": 2, "shard": 1}, "rows": [0, 256]}] * 2,  # the MLP's 4 x 64 rows
                     "2": [{"mesh": {"shard": 2}, "rows": [0, 128]}, {"mesh": {"shard": 2}, "rows": [128, 256]}]}


def mesh(monkeypatch, world_size, flags=(), local_world_size=None):
    """fsdp.mesh_shape of --fsdp and flags as resolution.final_settings resolves them on world_size processes,
    local_world_size of them a node (None: unset), and the mesh's line among the run's first lines (None if there is
    none)."""
    if local_world_size is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world_size))
    env = train_gpt2.Env(0, 0, world_size, "cpu", "cpu")
    draft = train_gpt2.draft_config(*train_gpt2.parse_args([
        *TINY, "--data", "unread", "--batch-size", "1", "--total-batch-size", "4096", "--fsdp", *map(str, flags)]), env)
    cfg, lines = resolution.final_settings(draft, env, train_gpt2.RECIPES, (fsdp.check_settings,))
    return fsdp.mesh_shape(cfg, env), next((line for line in lines if line.startswith(("HSDP", "FSDP"))), None)


def test_the_mesh_shards_within_a_node_unless_told_otherwise(monkeypatch):
    """(replicas, shards): a node's processes (torchrun's LOCAL_WORLD_SIZE) by default, --fsdp-shards N's groups,
    0's all of them; one node, or none under torchrun, is FSDP's one group. Nodes of one process (one GPU each) shard
    over all the processes, unless --fsdp-shards 1 asks for whole copies; the run's first line says which."""
    assert mesh(monkeypatch, 32, local_world_size=8) == ((4, 8), "HSDP: 4 replicas x 8 shards (each tensor split over "
                                                         "8 processes: a node's 8 processes, torchrun's "
                                                         "LOCAL_WORLD_SIZE=8; --fsdp-shards 0 splits it over all 32)")
    assert mesh(monkeypatch, 8, local_world_size=8) == ((1, 8), None)
    assert mesh(monkeypatch, 1) == ((1, 1), None)
    assert mesh(monkeypatch, 32, ["--fsdp-shards", 16], 8)[0] == (2, 16)
    assert mesh(monkeypatch, 32, ["--fsdp-shards", 0], 8) == ((1, 32), None)
    assert mesh(monkeypatch, 4, ["--fsdp-shards", 1]) == ((4, 1), "HSDP: 4 replicas x 1 shard (--fsdp-shards 1): each "
                                                         "process holds whole copies of the weights, gradients and "
                                                         "optimizer state, as under DDP; --fsdp-shards 0 splits them "
                                                         "over all 4")
    assert mesh(monkeypatch, 4, local_world_size=1) == ((1, 4), "FSDP: each tensor split over all 4 processes (a node "
                                                        "of one process, torchrun's LOCAL_WORLD_SIZE=1, shards nothing "
                                                        "alone; --fsdp-shards 1 would keep whole copies on each, as "
                                                        "DDP does)")
    assert mesh(monkeypatch, 4, ["--fsdp-shards", 1], 1)[0] == (4, 1)
    with pytest.raises(errors.UsageError, match=r"^--fsdp's shard groups of 3 \(--fsdp-shards 3\) do not divide the 32 "
                                                  r"process\(es\); pass --fsdp-shards with a divisor of 32"):
        mesh(monkeypatch, 32, ["--fsdp-shards", 3], 8)
    with pytest.raises(errors.UsageError, match=r"^--fsdp's shard groups of 3 \(a node's 3 processes, torchrun's "
                                                  r"LOCAL_WORLD_SIZE=3\) do not divide the 32 process"):
        mesh(monkeypatch, 32, local_world_size=3)
    with pytest.raises(errors.UsageError, match=r"^--fsdp-shards must be zero or more, not -2; pass a divisor of "):
        mesh(monkeypatch, 4, ["--fsdp-shards", -2])  # without its check: a mesh of (-2, -2)


@pytest.mark.parametrize("flags, environment, fragments", [
    (["--fsdp", "--fsdp-shards", "2"], {}, ["--fsdp's shard groups of 2 (--fsdp-shards 2) do not divide the 1 "
                                            "process(es)", "or 0 to shard over all of them"]),
    (["--fsdp", "--fsdp-shards", "-1"], {}, ["--fsdp-shards must be zero or more, not -1"]),  # else (-1, -1) on one
    (["--fsdp-shards", "1"], {}, ["--fsdp-shards 1 splits --fsdp's tensors, and --fsdp is off"]),
    (["--fsdp-shards", "0"], {}, ["--fsdp-shards 0 splits --fsdp's tensors, and --fsdp is off"]),  # 0, not falsy
    (["--fsdp"], {"LOCAL_WORLD_SIZE": "two"}, ["LOCAL_WORLD_SIZE='two' in the environment is not a positive whole",
                                               "unset it"]),
    (["--fsdp", "--fsdp-shards", "2"], {"LOCAL_WORLD_SIZE": "0"}, ["LOCAL_WORLD_SIZE='0' in the environment"]),
])
def test_a_mesh_that_cannot_be_is_refused_in_one_line(shards, tmp_path, capsys, monkeypatch, flags, environment,
                                                      fragments):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    expect_usage_error(TINY + ["--data", shards, "--log-dir", tmp_path, "--max-steps", "1", *flags], capsys, *fragments)


def test_the_memory_benchmark_gives_hsdps_memory_beside_fsdps_and_ddps(capsys):
    """GPT-2 XL on 4 nodes of 8 GPUs: HSDP holds what FSDP on one node's 8 does (each tensor split in 8), FSDP over
    all 32 a 32nd; activations and the gathered weights are the same for both."""
    code, out, err = run_main(["--world-size", "32", "--shards", "8", "--batch-size", "4", "--accumulation-steps", "4"],
                              capsys, memory.main)
    assert code == 0 and err == "", err
    lines = out.splitlines()
    table = {line[:44].strip(): line[44:].split() for line in lines[lines.index("") + 1:] if line[:44].strip()}
    assert table["GiB per rank"] == ["DDP", "FSDP", "HSDP", "4x8"]
    n = 1_557_686_400
    # every tensor's rows are split whole, so a rank's slice is a little over 1/shards of the weights
    weights = [float(gib) * 2**30 for gib in table["weights (fp32)"]]
    assert weights[0] == pytest.approx(4 * n, rel=1e-3) and weights[1] == pytest.approx(4 * n / 32, rel=2e-2)
    assert weights[2] == pytest.approx(4 * n / 8, rel=1e-2)
    _, rows = memory.memory_rows(memory.parse_args(["--world-size", "32", "--shards", "8", "--batch-size", "4",
                                                    "--accumulation-steps", "4"]))
    assert {key: row[2] for key, row in rows.items()} == hsdp_by_hand(n_layer=48, C=1600, V=50304, B=4, T=1024,
                                                                       shards=8)
    assert rows["activations"][1] == rows["activations"][2] and rows["total"][1] < rows["total"][2] < rows["total"][0]


def hsdp_by_hand(n_layer, C, V, B, T, shards):
    """The bytes per rank of GPT-2's recipe under HSDP with more than one accumulation step, counted by hand as
    docs/fsdp.md's table lays them out, for sizes whose rows every shard count divides: each of a group's shards ranks
    holds 1/shards of the fp32 weights, gradients and AdamW's two moments; the root (the tied embedding, the position
    table and the final norm, T positions of them) gathered in fp32 and two blocks in bf16; every gradient whole in
    fp32 between micro-steps; autocast's bf16 copy of the root; 36*C bytes per token per layer and 6*C outside them;
    the bf16 logits."""
    blocks, rest = n_layer * (12 * C * C + 13 * C), V * C + T * C + 2 * C
    n = blocks + rest
    rows = {"weights": 4 * n // shards, "gradients": 4 * n // shards, "optimizer": 8 * n // shards,
            "ddp_buckets": None, "fsdp_gathered": 4 * rest + 2 * 2 * blocks // n_layer, "fsdp_accumulation": 4 * n,
            "bf16_copies": 2 * rest}
    rows["model_state"] = sum(value or 0 for value in rows.values())
    rows.update(activations=(36 * n_layer + 6) * C * B * T, logits=2 * B * T * V)
    rows["total"] = rows["model_state"] + rows["activations"] + rows["logits"]
    return rows


def test_a_node_whose_files_refuse_the_settings_stops_every_rank_in_its_line(tmp_path):
    """--init-from exp, a relative path: on node 0 an export's config.json, on node 1 a damaged one. Node 1 refuses
    it as the presets are layered, before any collective; node 0 must not wait for it in the next one (gloo's
    "Connection closed by peer", or NCCL's hang), but end with node 1's line."""
    node_dirs = [tmp_path / "node0", tmp_path / "node1"]
    for node_dir, config in zip(node_dirs, ['{"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64, '
                                            '"n_positions": 32, "vocab_size": 128}', "{"]):
        (node_dir / "exp").mkdir(parents=True)
        (node_dir / "exp" / "config.json").write_text(config)
        (node_dir / "exp" / "model.safetensors").write_bytes(b"")
    codes = nodes([1, 1], TINY + ["--init-from", "exp", "--log-dir", tmp_path / "log"], node_dirs, tmp_path / "out")
    outputs = node_outputs(tmp_path / "out", 2)
    ours = [out.split("torch/distributed/elastic")[0] for out in outputs]
    lines = [line for out in ours for line in out.splitlines() if line.startswith("error: ")]
    assert codes[0] != 0 and codes[1] != 0, outputs
    assert len(lines) == 2 and len(set(lines)) == 1 and "Traceback" not in "".join(ours), outputs
    assert "exp/config.json: not the config.json of a model of train_gpt2.py's recipes" in lines[0], lines
