"""`accelerate launch` on a machine without GPUs: `--multi_gpu --num_processes 2` really starts two
ranks (over gloo); plain `--num_processes 2` starts one process, which sbft refuses in one line
(accelerate then prints its own traceback around it: its launcher's, not sbft's)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from _sbft import sbft_env

from sparsebalance_ft.train.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.skipif("__import__('torch').cuda.is_available()", reason="the CPU-machine case")]

ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]


def _launch(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*ACCELERATE, *map(str, args)], capture_output=True, text=True, timeout=600, env=sbft_env())


def test_multi_gpu_flag_starts_two_cpu_ranks(write_recipe, tmp_path):
    result = _launch("--multi_gpu", "--num_processes", 2, "-m", "sbft_cli.app", "train", write_recipe(training={"max_steps": 2}))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    assert all([r["rank"] for r in row["ranks"]] == [0, 1] for row in rows)


def test_num_processes_alone_is_refused_in_one_line(write_recipe, tmp_path):
    result = _launch("--num_processes", 2, "-m", "sbft_cli.app", "train", write_recipe())
    # accelerate's own launcher adds its defaults warning and, for any failed child, its own traceback.
    ours = [line for line in result.stderr.splitlines() if line.startswith("error: accelerate launch")]
    assert result.returncode != 0 and len(ours) == 1, result.stderr[-3000:]
    assert "accelerate launch asked for several processes but started one" in ours[0]
    assert not (tmp_path / "run").exists()  # nothing started
