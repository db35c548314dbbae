"""The training loop in one process: loss falls, metrics are written, resume replays the same losses."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from sparsebalance_ft.recipe import load_recipe
from sparsebalance_ft.train.checkpoint import checkpoint_dirs, latest_checkpoint
from sparsebalance_ft.train.loop import train
from sparsebalance_ft.train.metrics import read_metrics


def test_training_lowers_the_loss_and_logs_every_step(write_recipe):
    recipe = load_recipe(
        write_recipe(
            training={"max_steps": 12, "docs_per_rank": 1, "learning_rate": 1e-2},
            data={"max_documents": 1},
            lora={"modules_to_save": ["lm_head"]},
        )
    )
    summary = train(recipe)
    rows = read_metrics(f"{recipe.training.output_dir}/metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, 13))
    assert all(math.isfinite(row["loss"]) and row["tokens"] > 0 for row in rows)
    assert rows[-1]["loss"] < rows[0]["loss"] * 0.9  # one document, seen 12 times: it must be learnt
    assert rows[0]["ranks"][0]["compute_time"] > 0
    assert summary["steps"] == 12
    assert (Path(recipe.training.output_dir) / "adapter" / "adapter_config.json").is_file()


def test_a_recipe_naming_only_model_and_data_runs_the_method(tiny_model_dir, jsonl_corpus, tmp_path, capsys):
    """No method key set: the run is sparse, SparseBalance-batched and layer-tuned, and says so at start."""
    import yaml
    from rich.console import Console

    out = tmp_path / "run"
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({  # besides model and data, only sizes that keep the test short
        "model": {"path": str(tiny_model_dir)},
        "data": {"path": str(jsonl_corpus), "max_seq_len": 1024, "cache_dir": str(tmp_path / "cache")},
        "training": {"output_dir": str(out), "max_steps": 2, "docs_per_rank": 2, "report_to": "none"},
    }))
    recipe = load_recipe(path)
    train(recipe, console=Console(file=None, stderr=False, force_terminal=False))
    printed = capsys.readouterr().out
    assert "setup: sparse attention (budget 0.5, tuned within 0.1..0.9), batching sparsebalance, tuning layer (target fill)" in printed
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 2
    for rank in rows[-1]["ranks"]:
        assert 0.1 <= rank["budget"] <= 0.9
        assert 0.0 < rank["density"] < 1.0  # up to 16 blocks of 64 tokens: the selection dropped some


SPARSE_BALANCED = {
    "model": {"attn_implementation": "sparsebalance"},
    "sparsity": {"k_max": 4, "k_min": 2, "block_size": 16, "recall_samples": 1},
    "balance": {"batching": "sparsebalance", "tuning": "bidirectional"},
}


@pytest.mark.parametrize("sections", [{}, SPARSE_BALANCED], ids=["dense-random", "sparse-balanced"])
def test_resume_replays_the_uninterrupted_run(write_recipe, tmp_path, monkeypatch, sections):
    def recipe(out: str):
        training = {"checkpoint_every": 3, "output_dir": str(tmp_path / out)}
        return load_recipe(write_recipe(**{**sections, "training": training}))

    train(recipe("a"))
    expected = read_metrics(tmp_path / "a" / "metrics.jsonl")

    monkeypatch.setenv("SBFT_FAIL_AT", "0:4")
    with pytest.raises(RuntimeError, match="injected failure on rank 0 at step 4"):
        train(recipe("b"))
    assert latest_checkpoint(tmp_path / "b").name == "checkpoint-3"
    monkeypatch.delenv("SBFT_FAIL_AT")
    train(recipe("b"), resume=True)
    resumed = read_metrics(tmp_path / "b" / "metrics.jsonl")

    assert [row["step"] for row in resumed] == [row["step"] for row in expected] == list(range(1, 7))
    torch.testing.assert_close(
        torch.tensor([row["loss"] for row in resumed]), torch.tensor([row["loss"] for row in expected]), rtol=1e-6, atol=1e-7
    )
    for mine, theirs in zip(resumed, expected):  # same documents, same budgets, same densities
        assert mine["tokens"] == theirs["tokens"]
        assert [r["budget"] for r in mine["ranks"]] == [r["budget"] for r in theirs["ranks"]]
        assert [r["density"] for r in mine["ranks"]] == pytest.approx([r["density"] for r in theirs["ranks"]])


def test_checkpoints_are_pruned_and_half_written_ones_ignored(write_recipe, tmp_path):
    recipe = load_recipe(write_recipe(training={"checkpoint_every": 2, "keep_checkpoints": 2}))
    train(recipe)
    out = tmp_path / "run"
    assert [p.name for p in checkpoint_dirs(out)] == ["checkpoint-4", "checkpoint-6"]
    (out / "checkpoint-8.tmp").mkdir()  # what a crash mid-write leaves behind
    (out / "checkpoint-9").mkdir()  # a folder without its completion marker
    assert latest_checkpoint(out).name == "checkpoint-6"
