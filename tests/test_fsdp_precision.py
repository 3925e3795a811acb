"""--fsdp --dtype bf16 on the CPU: FSDP gathers the blocks' weights in bf16 while the residual stream stays float32,
and the CPU's layer_norm takes no bf16 gain with a float32 input (autocast on CUDA runs it in float32). Both recipes
train there as DDP does with --dtype bf16, to within bf16's rounding."""
import pytest

from helpers import TINY, needs_muon, read_log, run_main, train_records


@pytest.mark.parametrize("recipe", ["gpt2", pytest.param("modern", marks=needs_muon)])
def test_bf16_under_fsdp_trains_as_without(recipe, shards, tmp_path, capsys):
    args = TINY + ["--data", shards, "--dtype", "bf16", "--max-steps", "4", "--recipe", recipe]
    losses = {}
    for name, extra in (("ddp", []), ("fsdp", ["--fsdp"])):
        code, out, err = run_main(args + extra + ["--log-dir", tmp_path / name], capsys)
        assert code == 0, err
        losses[name] = [r["train_loss"] for r in train_records(read_log(tmp_path / name)).values()]
    assert len(losses["fsdp"]) == 4
    # the weights the blocks compute with are bf16 either way (gathered so, or cast by autocast): the same numbers but
    # for rounding in another order; bf16 keeps 8 bits, a relative 4e-3
    assert losses["fsdp"] == pytest.approx(losses["ddp"], rel=4e-3)
