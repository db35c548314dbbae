"""`sbft train` as a user runs it: one line and exit 2 on bad input; two real ranks on gloo; a dying rank stops all."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from sparsebalance_ft.train.metrics import read_metrics

SBFT = [sys.executable, "-m", "sbft_cli.app"]


def run_sbft(*args, timeout=300, env=None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([*SBFT, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=environment)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_malformed_recipe_exits_2_with_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  path: x\n  colour: blue\ndata:\n  path: y\n")
    line = one_error_line(run_sbft("train", path))
    assert "model.colour: unknown key" in line


def test_missing_data_file_exits_2_naming_it(write_recipe, tmp_path):
    line = one_error_line(run_sbft("train", write_recipe(), "--set", f"data.path={tmp_path / 'gone.jsonl'}"))
    assert "data.path: path not found" in line and "gone.jsonl" in line


def test_broken_json_line_exits_2_naming_file_and_line(write_recipe, tmp_path):
    data = tmp_path / "broken.jsonl"
    data.write_text(json.dumps({"text": "fine " * 50}) + "\n" + '{"text": "cut off\n')
    line = one_error_line(run_sbft("train", write_recipe(data={"path": str(data)})))
    assert f"{data}:2" in line


@pytest.mark.slow
def test_two_real_ranks_train_on_gloo(write_recipe, tmp_path):
    result = run_sbft("train", write_recipe(training={"max_steps": 4}), "--nproc", 2)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    for row in rows:
        assert [r["rank"] for r in row["ranks"]] == [0, 1]
        assert all(r["compute_time"] > 0 and r["wait_time"] is not None for r in row["ranks"])
        assert all(r["docs"] == 2 for r in row["ranks"])
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()


@pytest.mark.slow
def test_a_dying_rank_stops_every_rank_with_its_error(write_recipe):
    started = time.monotonic()
    result = run_sbft("train", write_recipe(training={"max_steps": 50}), "--nproc", 2, env={"SBFT_FAIL_AT": "1:2"})
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert "injected failure on rank 1 at step 2" in result.stderr
    assert "rank 1 failed" in result.stderr
    assert elapsed < 120, f"took {elapsed:.0f}s to stop"
