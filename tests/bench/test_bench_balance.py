"""The balancing benchmark's bookkeeping: run summaries and the same-documents rule (no training here)."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from sbft_cli.app import app
from sparsebalance_ft.batching import LOOKAHEAD_STEPS
from sparsebalance_ft.bench import balance as bench
from sparsebalance_ft.bench.balance import BenchSetupError, check_same_documents, summarise_run


def _rank(compute: float, tokens: int, density=None, recall=None, budget=None) -> dict:
    return {"compute_time": compute, "tokens": tokens, "density": density, "recall": recall, "budget": budget}


def _write_metrics(run_dir, steps: list[list[dict]]) -> None:
    run_dir.mkdir(parents=True)
    lines = []
    for i, ranks in enumerate(steps, start=1):
        slowest = max(r["compute_time"] for r in ranks)
        lines.append(json.dumps({"step": i, "loss": 9.0 - i, "tokens": sum(r["tokens"] for r in ranks),
                                 "step_time": slowest + 0.5, "ranks": ranks}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_summary_weighs_steps_by_time_and_ranks_by_tokens(tmp_path):
    # step 1: long (4 s vs 2 s); step 2: short and badly balanced (0.1 s vs 0.9 s)
    _write_metrics(tmp_path / "run", [
        [_rank(4.0, 3000, density=0.2, recall=0.6, budget=0.4), _rank(2.0, 1000, density=1.0, recall=1.0, budget=0.8)],
        [_rank(0.1, 40, density=1.0, recall=1.0, budget=0.5), _rank(0.9, 960, density=0.5, recall=0.8, budget=0.5)],
    ])
    s = summarise_run(tmp_path / "run")
    assert s["steps"] == 2
    assert s["train_time"] == pytest.approx(4.5 + 1.4)
    # run-level bubble: 1 - (3.0 + 0.5) / (4.0 + 0.9), not the mean of the per-step bubbles
    assert s["bubble"] == pytest.approx(1 - 3.5 / 4.9)
    assert s["imbalance"] == pytest.approx(4.9 / 3.5)
    assert s["mean_recall"] == pytest.approx((0.6 * 3000 + 1.0 * 1000 + 1.0 * 40 + 0.8 * 960) / 5000)
    assert s["mean_density"] == pytest.approx((0.2 * 3000 + 1.0 * 1000 + 1.0 * 40 + 0.5 * 960) / 5000)
    assert s["mean_budget"] == pytest.approx((0.4 * 3000 + 0.8 * 1000 + 0.5 * 1000) / 5000)
    assert s["tokens"] == 5000
    assert s["final_loss"] == 7.0


def test_dense_runs_have_no_sparsity_figures(tmp_path):
    _write_metrics(tmp_path / "run", [[_rank(1.0, 100), _rank(1.0, 100)]])
    s = summarise_run(tmp_path / "run")
    assert s["mean_density"] is None and s["mean_recall"] is None and s["mean_budget"] is None


def test_runs_must_cover_whole_regrouping_blocks():
    check_same_documents(LOOKAHEAD_STEPS, LOOKAHEAD_STEPS)
    check_same_documents(3 * LOOKAHEAD_STEPS, LOOKAHEAD_STEPS)
    check_same_documents(24, 8)
    with pytest.raises(BenchSetupError, match="multiple of"):
        check_same_documents(LOOKAHEAD_STEPS + 8, LOOKAHEAD_STEPS)


def test_speedups_are_against_the_fair_peer_with_random_as_a_reference(tmp_path, monkeypatch):
    times = {"peer": 100.0, "baseline": 130.0, "sab+dst": 80.0}
    load = iter([1.0] * 3 + [2.5] * 3 + [1.0] * 3)  # the machine slows down during round 1

    def fake(recipe, name, out_dir, nproc, overrides):
        return {"train_time": times[name] * next(load), "tokens": 5000, "bubble": 0.1}

    monkeypatch.setattr(bench, "run_configuration", fake)
    report = bench.run_balance_bench(tmp_path / "r.yaml", tmp_path, rounds=3, configurations=list(times))
    results = report["results"]
    assert results["sab+dst"]["speedup_vs_peer"] == pytest.approx(1.25)
    assert results["baseline"]["speedup_vs_peer"] == pytest.approx(100 / 130)
    assert results["sab+dst"]["speedup_vs_baseline"] == pytest.approx(130 / 80)
    assert results["sab+dst"]["speedup_vs_peer_rounds"] == pytest.approx([1.25] * 3)  # paired within rounds
    assert results["peer"]["train_times"] == [100.0, 250.0, 100.0] and report["same_documents"]
    assert bench.CONFIGURATIONS["peer"] == ["balance.batching=length-grouped", "balance.tuning=none"]


def test_cli_refuses_a_cut_block_and_unknown_configurations(write_recipe):
    recipe = write_recipe()
    runner = CliRunner()
    cut = runner.invoke(app, ["bench", "balance", str(recipe), "--set", f"training.max_steps={LOOKAHEAD_STEPS - 8}"])
    assert cut.exit_code == 2 and "multiple of" in cut.output
    unknown = runner.invoke(app, ["bench", "balance", str(recipe), "--set", f"training.max_steps={LOOKAHEAD_STEPS}",
                                  "--configs", "baseline,turbo"])
    assert unknown.exit_code == 2 and "turbo" in unknown.output
