"""Run by tests/test_hsdp.py in 2 processes (gloo, on the CPU): a tiny model sharded as train_gpt2.py's --fsdp shards
it (its settings resolved, then wrap_model), once for each --fsdp-shards given as an argument. Rank 0 prints, as JSON on
its last line, for each: every rank's mesh (each dimension's name and size) and the rows of the first MLP's weight it
holds, found by comparing its slice with the whole weight as it was before sharding.

    python tests/scripts/ranks.py 2 tests/scripts/mesh_slices.py 1 2"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import train_gpt2  # noqa: E402
from machinery import ranks  # noqa: E402

TINY = ["--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--block-size", "32", "--vocab-size", "128",
        "--device", "cpu", "--data", "unread", "--batch-size", "4", "--total-batch-size", "256", "--fsdp"]


def rows_held(whole, mine):
    """[first, end) of the rows of whole that mine is (the random weights' rows are all different)."""
    first = next(row for row in range(len(whole) - len(mine) + 1) if torch.equal(whole[row:row + len(mine)], mine))
    return [first, first + len(mine)]


def holdings(shards, env):
    flags, given = train_gpt2.parse_args(TINY + ["--fsdp-shards", shards])
    cfg = train_gpt2.final_config(train_gpt2.draft_config(flags, given, env), env)
    model = train_gpt2.make_model(cfg, env.device)
    whole = model.transformer.h[0].mlp.c_fc.weight.detach().clone()
    train_gpt2.wrap_model(model, cfg, env)
    weight = model.transformer.h[0].mlp.c_fc.weight
    mesh = weight.device_mesh
    return {"mesh": dict(zip(mesh.mesh_dim_names or ["shard"], mesh.shape)),
            "rows": rows_held(whole, weight.to_local().detach())}


env = train_gpt2.set_up_distributed("cpu", fsdp=True)
found = {shards: ranks.every_rank(holdings(shards, env)) for shards in sys.argv[1:]}
if env.rank == 0:
    print(json.dumps(found))
train_gpt2.tear_down_distributed()
