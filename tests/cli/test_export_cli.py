"""`sbft export --verify-tokens` as a user runs it: the merged model is checked against the trained one and the
figures are printed and written beside the export."""
from __future__ import annotations

import json

from sparsebalance_ft.recipe import load_recipe
from sparsebalance_ft.train.loop import train

from test_train_cli import run_sbft  # tests/cli is on sys.path (pytest rootdir-relative import)


def test_export_prints_and_writes_its_check(write_recipe, tmp_path):
    # a sparse recipe with tuning, checked with dense attention
    recipe_path = write_recipe(model={"attn_implementation": "sparsebalance"}, training={"max_steps": 2},
                               balance={"tuning": "bidirectional"})
    train(load_recipe(recipe_path))
    result = run_sbft("export", recipe_path, "--out", tmp_path / "merged", "--verify-tokens", 96)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "export check at 96 tokens" in result.stdout and "within the floor" in result.stdout, result.stdout
    check = json.loads((tmp_path / "merged" / "export_check.json").read_text())
    assert check["tokens"] == 96 and check["within_floor"] and check["export_vs_trained"] <= 1e-4
