"""Two gloo ranks shard the examples and gather the results (rank 0 writes the same JSON one rank would)."""
from __future__ import annotations

import json

import pytest


def _rank_main(rank: int, world: int, init_file: str, recipe_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    from sparsebalance_ft.eval.api import evaluate
    from sparsebalance_ft.eval.engine import rank_and_world
    from sparsebalance_ft.recipe import load_recipe

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        assert rank_and_world() == (rank, world)
        recipe = load_recipe(recipe_path)
        result = evaluate(
            recipe, "passkey", lengths=[128], depths=[0.0, 0.5, 1.0], samples=1, out_dir=out_dir, show_progress=False
        )
        assert result["n"] == 3 and result["world_size"] == world
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_shard_and_gather(tmp_path, eval_recipe_path):
    import torch.multiprocessing as mp

    out = tmp_path / "out"
    mp.spawn(_rank_main, args=(2, str(tmp_path / "init"), str(eval_recipe_path), str(out)), nprocs=2, join=True)
    data = json.loads((out / "passkey_dense.json").read_text())
    assert data["n"] == 3 and data["world_size"] == 2
    ids = [json.loads(line)["id"] for line in (out / "passkey_dense_predictions.jsonl").read_text().splitlines()]
    assert ids == ["passkey-128-0-0", "passkey-128-0.5-0", "passkey-128-1-0"]
