"""--fsdp (FSDP2) on the CPU, with 2 processes under torchrun (gloo): the same losses as DDP for both recipes, sharded
checkpoints that resume bitwise, and in one process, that --eval-only, --sample and --export-hf read, ShardedMuon
against torch's Muon on whole matrices, samples printed once, and the refusals."""
import os
import shutil

import pytest
import safetensors.torch
import torch

import train_gpt2
from helpers import (
    REPO,
    TINY,
    expect_usage_error,
    last_json,
    load_ckpt,
    needs_muon,
    read_log,
    run_main,
    run_script,
    train_records,
    val_records,
    write_shards,
)
from machinery import checkpoints, errors, log_directory, presets, sharded_checkpoints
from variations import modern

# 20 steps of 512 tokens: 2 accumulation steps of 4 x 32 in each of 2 processes, so that FSDP's reduce is skipped on
# the first micro-step of each; a checkpoint every 10 steps; 12 validation sequences, in batches of 4: 2 for rank 0
# and 1 for rank 1, which must still run a second, empty one (FSDP's forward needs every rank)
STEPS = ["--max-steps", "20", "--checkpoint-every", "10", "--eval-every", "10", "--total-batch-size", "512",
         "--warmup-steps", "2", "--val-tokens", "400"]
RECIPES = ["gpt2", pytest.param("modern", marks=needs_muon)]


def recipe_flags(recipe):
    return ["--max-lr", "1e-2"] if recipe == "gpt2" else ["--recipe", "modern"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("shards"), train_lengths=(9000, 8000), val_length=2000)


@pytest.fixture(scope="module", params=RECIPES)
def runs(request, shards, tmp_path_factory):
    """The same 2-process run of request.param's recipe with DDP and with --fsdp: (recipe, {name: log dir}, args)."""
    recipe, root = request.param, tmp_path_factory.mktemp(f"runs_{request.param}")
    args = TINY + ["--data", shards, *STEPS, *recipe_flags(recipe)]
    dirs = {}
    for name, extra in (("ddp", []), ("fsdp", ["--fsdp"])):
        dirs[name] = root / name
        result = run_script(args + extra + ["--log-dir", dirs[name]], cwd=root, nproc=2)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "4 x 32 x 2 accumulation steps x 2 process(es)" in result.stdout
    return recipe, dirs, args


def test_fsdp_trains_as_ddp_does(runs):
    """Every training and validation loss of --fsdp within 1e-5 of DDP's, for either recipe (the modern one's Muon
    gathering each whole matrix); the checkpoints are directories of both ranks' slices."""
    recipe, dirs, _ = runs
    ddp, fsdp = read_log(dirs["ddp"]), read_log(dirs["fsdp"])
    ddp_train, fsdp_train = train_records(ddp), train_records(fsdp)
    assert sorted(fsdp_train) == list(range(20))
    for step, record in ddp_train.items():
        assert fsdp_train[step]["train_loss"] == pytest.approx(record["train_loss"], abs=1e-5), step
    # the weights moved far past that tolerance (random tokens: the loss cannot fall below ln 128, only move)
    assert abs(val_records(ddp)[10]["val_loss"] - val_records(ddp)[0]["val_loss"]) > 1e-3
    for step, record in val_records(ddp).items():
        assert val_records(fsdp)[step]["val_loss"] == pytest.approx(record["val_loss"], abs=1e-5), step
    assert checkpoints.checkpoint_paths(dirs["fsdp"]) == [str(dirs["fsdp"] / "ckpt_000010.dcp"),
                                                       str(dirs["fsdp"] / "ckpt_000020.dcp")]
    files = os.listdir(dirs["fsdp"] / "ckpt_000020.dcp")
    assert {"run.pt", ".metadata"} <= set(files) and len([f for f in files if f.endswith(".distcp")]) == 2
    # GPT-2's head is its embedding, stored once as torch.save stores it; the modern recipe's is a weight of its own
    dcp, _ = sharded_checkpoints.checkpoint_modules()
    index = dcp.FileSystemReader(dirs["fsdp"] / "ckpt_000020.dcp").read_metadata().state_dict_metadata
    assert "model.transformer.wte.weight" in index and ("model.lm_head.weight" in index) == (recipe == "modern")


def resume_from_step_10(dirs, name, args, nproc, tmp_path, extra=()):
    """The run resumed from its step-10 checkpoint, copied into a log dir of its own: that dir's log."""
    log_dir = tmp_path / name
    os.makedirs(log_dir)
    shutil.copytree(dirs["fsdp"] / "ckpt_000010.dcp", log_dir / "ckpt_000010.dcp")
    result = run_script(args + ["--fsdp", "--log-dir", log_dir, *extra], cwd=tmp_path, nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from the checkpoint of step 10" in result.stdout
    return read_log(log_dir)


def test_resumed_fsdp_run_is_bitwise_the_same(runs, tmp_path):
    """Stopped at step 10 and resumed on 2 processes: the same weights, optimizer state (AdamW's, or Muon's and
    Adam's), data position and RNGs, so the very same losses as the run that never stopped."""
    recipe, dirs, args = runs
    resumed = resume_from_step_10(dirs, "resumed", args, 2, tmp_path)
    whole = read_log(dirs["fsdp"])
    assert sorted(train_records(resumed)) == list(range(10, 20))
    for step, record in train_records(resumed).items():
        assert record["train_loss"] == train_records(whole)[step]["train_loss"], step
        assert record["grad_norm"] == train_records(whole)[step]["grad_norm"], step
    assert val_records(resumed)[20]["val_loss"] == val_records(whole)[20]["val_loss"]


def test_two_process_checkpoint_resumes_in_one_process(runs, tmp_path):
    """FSDP's checkpoint of 2 ranks read by 1 (--fsdp in a single process, no torchrun): each tensor is split anew,
    and the losses go on as the 2-process run's. With 4 micro-steps instead of 2 the gradients are summed in
    another order: GPT-2's losses stay within 1e-5 throughout; Muon orthogonalizes in bf16, where such last-bit
    differences can round apart, so the modern recipe's first resumed step is compared, then its trend."""
    recipe, dirs, args = runs
    one = train_records(resume_from_step_10(dirs, "one", args, 1, tmp_path))
    two = train_records(read_log(dirs["fsdp"]))
    for step in range(10, 20) if recipe == "gpt2" else [10]:
        assert one[step]["train_loss"] == pytest.approx(two[step]["train_loss"], abs=1e-5), step
    assert one[19]["train_loss"] == pytest.approx(two[19]["train_loss"], abs=1e-3)


def test_sharded_checkpoint_is_read_by_eval_only_sample_and_export(runs, tmp_path, capsys):
    """One process with no --fsdp reads the 2 ranks' slices whole: --eval-only gives the run's own final validation
    loss, --sample starts, and --export-hf writes the weights DDP trained to (GPT-2's recipe as GPT2LMHeadModel, the
    modern one as NanoChatForCausalLM), which the recipe's from_pretrained reads back."""
    recipe, dirs, args = runs
    final = val_records(read_log(dirs["fsdp"]))[20]["val_loss"]
    log_dir = tmp_path / "eval"
    shutil.copytree(dirs["fsdp"], log_dir)
    code, out, err = run_main(args + ["--eval-only", "--log-dir", log_dir], capsys)
    assert code == 0, err
    assert f"evaluating {log_dir / 'ckpt_000020.dcp'} (step 20)" in out
    assert read_log(log_dir)[-1]["val_loss"] == pytest.approx(final, abs=1e-6)
    code, out, err = run_main(["--sample", log_dir / "ckpt_000020.dcp", "--device", "cpu"], capsys)
    assert code == 0, err
    assert f"checkpoint of step 20 (val loss {final:.4f})" in out
    code, out, err = run_main(["--export-hf", tmp_path / "hf", "--log-dir", dirs["fsdp"]], capsys)
    assert code == 0, err
    exported = presets.settings_of_export(str(tmp_path / "hf"), train_gpt2.RECIPES)
    assert exported.pop("recipe") == recipe
    config = train_gpt2.GPTConfig(recipe=recipe, **exported)
    exported = train_gpt2.RECIPES[recipe].from_pretrained(str(tmp_path / "hf"), config).state_dict()
    ddp = load_ckpt(dirs["ddp"] / "ckpt_000020.pt")["model"]
    for name, weights in ddp.items():
        assert torch.allclose(exported[name], weights, rtol=0, atol=1e-5), name


def test_a_ddp_checkpoint_is_not_trained_on_with_fsdp(runs, tmp_path, capsys):
    """DDP's optimizer state is by position, which --fsdp's slices by name cannot take: refused in one line. (FSDP's
    checkpoints train on without --fsdp: tests/test_hsdp.py.)"""
    recipe, dirs, args = runs
    log_dir = tmp_path / "ddp"
    shutil.copytree(dirs["ddp"], log_dir)
    expect_usage_error(args + ["--fsdp", "--log-dir", log_dir, "--max-steps", "30"], capsys,
                       "was written without --fsdp", "--no-resume")


@pytest.mark.parametrize("runs", ["gpt2"], indirect=True)  # the vote is the same code for either recipe
def test_weights_not_finite_in_one_ranks_slice_alone_are_never_saved(runs, tmp_path, capsys):
    """Under --fsdp each rank holds a slice of the weights, so only all the ranks together know whether every weight
    is finite. A NaN in rank 1's rows alone (of an export that --init-from reads) makes every step non-finite; at the
    end no rank saves, and both end with the same "not finite" line."""
    _, dirs, args = runs
    export, log_dir = tmp_path / "hf", tmp_path / "log"
    code, _, err = run_main(["--export-hf", export, "--log-dir", dirs["fsdp"]], capsys)
    assert code == 0, err
    weights = safetensors.torch.load_file(export / "model.safetensors")
    # row 200 of the first MLP's 256 (Hugging Face stores it transposed): rank 1 holds rows 128 to 255, and a block's
    # weights are split again after each forward pass (the root's, such as the position table, stay whole until the
    # backward pass: then every rank would see the NaN)
    weights["transformer.h.0.mlp.c_fc.weight"][0, 200] = float("nan")
    safetensors.torch.save_file(weights, export / "model.safetensors", metadata={"format": "pt"})
    result = run_script(args + ["--fsdp", "--init-from", export, "--max-steps", "2", "--log-dir", log_dir],
                        cwd=tmp_path, nproc=2)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert [line for line in result.stderr.splitlines() if line] == [
        "error: the run is not saved at step 2: its weights are not finite (the steps since 0 were non-finite, their "
        "updates skipped). Lower the learning rate (--max-lr) and start again"] * 2
    assert checkpoints.checkpoint_paths(log_dir) == []


@pytest.mark.parametrize("flags, fragments", [
    (["--dtype", "fp16", "--loss", "full"], ["--fsdp cannot run with --dtype fp16", "bf16"]),
    (["--compile", "--compile-mode", "reduce-overhead"], ["--compile-mode reduce-overhead cannot run with --fsdp"]),
])
def test_settings_fsdp_cannot_honour_are_refused(shards, tmp_path, capsys, flags, fragments):
    expect_usage_error(TINY + ["--data", shards, "--fsdp", "--log-dir", tmp_path, *flags], capsys, *fragments)


@needs_muon
def test_a_torch_without_muons_own_steps_refuses_sharding_it(shards, tmp_path, capsys, monkeypatch):
    """ShardedMuon takes the steps of Muon's update from torch's private module: a torch that moved them refuses
    --fsdp --recipe modern in one line, and everything else still runs."""
    monkeypatch.setattr(modern, "orthogonalize", None)
    expect_usage_error(TINY + ["--data", shards, "--fsdp", "--recipe", "modern", "--log-dir", tmp_path], capsys,
                       "--fsdp --recipe modern shards Muon", "drop --fsdp")


def test_sharded_muon_is_muon_on_whole_matrices(tmp_path):
    """ShardedMuon on matrices split over 2 ranks, unevenly too, takes exactly torch.optim.Muon's steps on the whole
    matrices: the orthogonalization sees each whole matrix, and each rank applies its own rows of it."""
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon is new in PyTorch 2.9")
    result = run_script([], cwd=tmp_path, nproc=2, timeout=120,
                        script=os.path.join(REPO, "tests", "scripts", "sharded_muon.py"))
    found = last_json(result)
    assert found["local_rows"] == [4, 3, 8, 2, 1]  # rank 0's rows of 7, 6, 16, 3 and 1
    assert found["min_moved"] > 0.01 and found["max_diff"] == 0.0


def test_samples_under_fsdp_are_ddps_printed_once(shards, tmp_path):
    """Sampling runs on every rank under FSDP (each lends its slices of the weights), and rank 0 alone prints the
    same samples as DDP's."""
    args = TINY + ["--data", shards, "--vocab-size", "50304", "--max-steps", "2", "--num-samples", "2",
                   "--max-new-tokens", "6", "--checkpoint-every", "0"]
    printed = {}
    for name, extra in (("ddp", []), ("fsdp", ["--fsdp"])):
        result = run_script(args + extra + ["--log-dir", tmp_path / name], cwd=tmp_path, nproc=2)
        assert result.returncode == 0, result.stderr[-3000:]
        printed[name] = result.stdout[result.stdout.index("--- sample 1/2 (step 2)"):].split("--- end of samples")[0]
        assert result.stdout.count("--- sample 1/2") == 1  # at the end, by rank 0 alone
    assert printed["fsdp"] == printed["ddp"]


def test_sharded_checkpoint_directories_are_pruned_and_recognised(tmp_path):
    """ckpt_<step>.dcp directories count as checkpoints: by step, pruned whole, and a save cut short is removed."""
    for name in ("ckpt_000005.dcp", "ckpt_000010.dcp", "ckpt_000015.dcp", "ckpt_000020.dcp.tmp"):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "__0_0.distcp").write_bytes(b"x")
    assert checkpoints.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt_000015.dcp")
    checkpoints.prune_checkpoints(tmp_path, keep=2)
    log_directory.move_aside_old_files(tmp_path, str(tmp_path / "ckpt_000015.dcp"), 15)
    assert sorted(os.listdir(tmp_path)) == ["ckpt_000010.dcp", "ckpt_000015.dcp"]


def test_a_sharded_checkpoint_saved_again_at_its_step_replaces_the_old(tmp_path, capsys):
    """A run stopped by a signal before its final evaluation saves that step again once evaluated: the new directory
    takes the old one's place (a file would simply be replaced)."""
    def saving(content):
        def save(directory):
            assert directory == str(tmp_path / "ckpt_000010.dcp.tmp")
            (tmp_path / "ckpt_000010.dcp.tmp" / "run.pt").write_bytes(content)
        return save

    for content in (b"first", b"second"):
        checkpoints.write_sharded_checkpoint(str(tmp_path), 10, saving(content), size=5, keep=2, rank=0)
    assert os.listdir(tmp_path) == ["ckpt_000010.dcp"]
    assert (tmp_path / "ckpt_000010.dcp" / "run.pt").read_bytes() == b"second"
    assert "saved" in capsys.readouterr().out


def test_a_rank_that_cannot_see_the_checkpoint_directory_stops_the_run(tmp_path):
    """A rank on a node whose --log-dir is not the directory rank 0 made there (a node-local disk) is stopped with a
    line saying so, before any rank writes its part."""
    saved = []
    with pytest.raises(errors.UsageError, match="does not see the checkpoint directory .*ckpt_000010.dcp.tmp that "
                                                  "rank 0 made; put --log-dir on a file system that every node shares"):
        checkpoints.write_sharded_checkpoint(str(tmp_path), 10, saved.append, size=5, keep=2, rank=1)
    assert saved == [] and os.listdir(tmp_path) == []
