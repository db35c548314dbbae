"""Sharded runs (`training.sharding: fsdp`) on two real ranks: kill -9 of a rank then `--resume` continues
exactly; a sharded checkpoint on one rank, and launcher sharding configs that sbft would ignore, are
refused in one line."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from _sbft import one_error_line, rank_pids, run_sbft, start_sbft, wait_for_steps

from sparsebalance_ft.train.metrics import read_metrics

SHARDED_LAYER_TUNED = {
    "model": {"attn_implementation": "sparsebalance"},
    "sparsity": {"k_max": 4, "k_min": 2, "block_size": 16, "recall_samples": 1},
    "balance": {"batching": "length-grouped", "tuning": "layer", "lookahead_steps": 2},
    "data": {"max_documents": 12, "max_seq_len": 256},
}


def sharding_recipe(write_recipe, out: Path, **training) -> Path:
    return write_recipe(**SHARDED_LAYER_TUNED, training={
        "docs_per_rank": 3, "micro_batch_tokens": 256, "output_dir": str(out), "sharding": "fsdp", **training})


def _losses(out: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(out / "metrics.jsonl")]


@pytest.mark.slow
def test_kill_minus_nine_of_a_rank_then_resume_equals_the_uninterrupted_run(write_recipe, tmp_path):
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    path = sharding_recipe(write_recipe, reference, max_steps=6, checkpoint_every=2)
    assert run_sbft("train", path, "--nproc", 2, timeout=600).returncode == 0

    path = sharding_recipe(write_recipe, killed, max_steps=6, checkpoint_every=2)
    proc = start_sbft("train", path, "--nproc", 2)
    wait_for_steps(killed / "metrics.jsonl", 3, proc)
    os.kill(rank_pids(proc.pid)[1], signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert (killed / "checkpoint-2" / "sharded" / ".metadata").is_file()
    assert len(list((killed / "checkpoint-2" / "sharded").glob("*.distcp"))) == 2  # each rank wrote its shards

    resumed = run_sbft("train", path, "--nproc", 2, "--resume", timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    assert [row["step"] for row in read_metrics(killed / "metrics.jsonl")] == list(range(1, 7))
    assert _losses(killed) == pytest.approx(_losses(reference), rel=1e-6)

    one_rank = run_sbft("train", path, "--resume", "--set", "training.max_steps=8")
    assert "was saved by a sharded run and this run is unsharded" in one_error_line(one_rank)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_launcher_sharding_configs_are_refused_in_one_line(write_recipe, nproc):
    recipe = write_recipe(training={"sharding": "fsdp"})
    fsdp = run_sbft("train", recipe, "--nproc", nproc, env={"ACCELERATE_USE_FSDP": "true"})
    assert one_error_line(fsdp).endswith(
        "accelerate launch with an FSDP config: sbft shards with training.sharding: fsdp itself (it is already set);"
        " launch without --use_fsdp / the FSDP config")
    zero3 = run_sbft("train", recipe, "--nproc", nproc, env={"ACCELERATE_USE_DEEPSPEED": "true"})
    assert "set training.sharding: fsdp to shard the model" in one_error_line(zero3)
