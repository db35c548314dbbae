"""Resuming after faults: damaged checkpoints, a finished run, overwrite, and per-rank balancer state."""
from __future__ import annotations

import json

import pytest
import torch
from _sbft import error_lines, run_sbft

from sparsebalance_ft.train.checkpoint import checkpoint_dirs
from sparsebalance_ft.train.metrics import read_metrics


def _steps(run) -> list[int]:
    return [row["step"] for row in read_metrics(run / "metrics.jsonl")]


def test_resume_after_faults_loses_nothing(write_recipe, tmp_path):
    run = tmp_path / "run"
    recipe = write_recipe(training={"max_steps": 4, "checkpoint_every": 2, "keep_checkpoints": 3})
    assert run_sbft("train", recipe).returncode == 0
    finished = (run / "metrics.jsonl").read_text()

    again = run_sbft("train", recipe, "--resume")  # a finished run: said so, nothing rewritten
    assert again.returncode == 0, again.stderr[-2000:]
    assert "already finished: 4 of 4 steps" in again.stdout and "nan" not in again.stdout
    assert (run / "metrics.jsonl").read_text() == finished

    rng = run / "checkpoint-4" / "random_states_0.pkl"
    rng.write_bytes(rng.read_bytes()[:100])  # a truncated RNG state must not resume silently
    resumed = run_sbft("train", recipe, "--resume", "--set", "training.max_steps=6")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    warnings = [line for line in error_lines(resumed.stderr) if line.startswith("warning:")]
    assert warnings[0] == f"warning: skipping a damaged checkpoint: {rng} is truncated (100 of {json.loads((run / 'checkpoint-4' / 'COMPLETE').read_text())['files']['random_states_0.pkl']} bytes)"
    assert "resumed from" in resumed.stderr and "checkpoint-2 at step 2" in resumed.stderr
    assert _steps(run) == [1, 2, 3, 4, 5, 6]

    fresh = run_sbft("train", recipe, "--overwrite", "--set", "training.max_steps=2")
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert _steps(run) == [1, 2] and [p.name for p in checkpoint_dirs(run)] == ["checkpoint-2"]


SPARSE_PER_LAYER = {
    "model": {"attn_implementation": "sparsebalance"},
    "sparsity": {"k_max": 4, "k_min": 2, "block_size": 16, "recall_samples": 1},
    "balance": {"batching": "sparsebalance", "tuning": "bidirectional", "per_layer": True},
}


@pytest.mark.slow
def test_per_rank_balancer_state_survives_resume_on_two_ranks(write_recipe, tmp_path):
    def recipe(out: str):
        return write_recipe(**SPARSE_PER_LAYER, training={"max_steps": 6, "checkpoint_every": 2, "output_dir": str(tmp_path / out)})

    assert run_sbft("train", recipe("a"), "--nproc", 2).returncode == 0
    failed = run_sbft("train", recipe("b"), "--nproc", 2, env={"SBFT_FAIL_AT": "1:3"})
    assert failed.returncode == 1 and "injected failure on rank 1 at step 3" in failed.stderr
    resumed = run_sbft("train", recipe("b"), "--nproc", 2, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    expected, got = read_metrics(tmp_path / "a" / "metrics.jsonl"), read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert [row["step"] for row in got] == [row["step"] for row in expected] == list(range(1, 7))
    for mine, theirs in zip(got, expected):
        assert [r["budget"] for r in mine["ranks"]] == pytest.approx([r["budget"] for r in theirs["ranks"]], rel=1e-9)
        assert [r["predicted_time"] for r in mine["ranks"]] == pytest.approx([r["predicted_time"] for r in theirs["ranks"]], rel=1e-9)
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-6)
    # Each rank's own layer sensitivity (running mean of 1 - recall) steers its per-layer budgets: after
    # the resume every rank must hold what it would hold had the run never stopped.
    final = {
        out: [torch.load(tmp_path / out / "checkpoint-6" / f"rank_state_{r}.pt", weights_only=False)["balancer"] for r in (0, 1)]
        for out in ("a", "b")
    }
    assert final["a"][0]["sensitivity"] != final["a"][1]["sensitivity"]  # the ranks' states do differ
    for rank in (0, 1):
        assert final["b"][rank]["sensitivity"] == pytest.approx(final["a"][rank]["sensitivity"], rel=1e-6)
