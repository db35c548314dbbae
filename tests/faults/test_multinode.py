"""Two "nodes" on this machine: two torchrun agents, --nnodes 2, c10d rendezvous on 127.0.0.1, one rank
each; a few steps, a failure, and a resume, as on two machines that share the output filesystem."""
from __future__ import annotations

import subprocess
import sys

import pytest
from _sbft import sbft_env

from sparsebalance_ft.train.metrics import read_metrics

pytestmark = pytest.mark.slow


def _two_nodes(port: int, recipe, *args, env=None) -> list[subprocess.CompletedProcess]:
    run_id = f"sbft-{port}"
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
             "-m", "sbft_cli.app", "train", str(recipe), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=sbft_env(**(env or {})),
        )
        for node in (0, 1)
    ]
    outputs = [agent.communicate(timeout=300) for agent in agents]
    return [subprocess.CompletedProcess(a.args, a.returncode, *out) for a, out in zip(agents, outputs)]


def test_two_nodes_train_fail_and_resume(write_recipe, tmp_path, free_port):
    recipe = write_recipe(training={"max_steps": 4, "checkpoint_every": 2})
    failed = _two_nodes(free_port(), recipe, env={"SBFT_FAIL_AT": "1:3"})
    assert all(agent.returncode != 0 for agent in failed)
    assert any("injected failure on rank 1 at step 3" in agent.stderr for agent in failed)

    resumed = _two_nodes(free_port(), recipe, "--resume")
    assert [agent.returncode for agent in resumed] == [0, 0], resumed[0].stderr[-2000:] + resumed[1].stderr[-2000:]
    assert any("resumed from" in agent.stderr and "checkpoint-2 at step 2" in agent.stderr for agent in resumed)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all([r["rank"] for r in row["ranks"]] == [0, 1] for row in rows)
