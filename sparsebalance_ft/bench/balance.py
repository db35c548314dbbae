"""The balancing experiment: the same training run under several configurations, measured alternately.

The baseline every speedup is quoted against is `peer`: the best fair peer (length-grouped
Karmarkar-Karp on the FLOP proxy over the same look-ahead as `sparsebalance`) at the fixed default
budget. `baseline` (random batching, fixed budget) stays as a reference row.

Every configuration trains the same model from the same initialisation on the same documents,
steps and seed, as real ranks (one process each, gloo on a CPU). Configurations run one after
another in rounds (baseline, SAB, DST, SAB+DST, dense, baseline, ...), so slow drift of a
shared machine hits all of them alike. Times come from each run's own metrics.jsonl: the sum of
step times (start-up and model loading excluded), the step time as the slowest rank saw it.

Same documents: the look-ahead policies regroup `balance.lookahead_steps` steps' documents at a time,
so a run cut inside such a block would train a different subset of documents than the others. The
bench therefore requires `max_steps` to be a multiple of it, and checks after the runs that every
configuration trained the same number of tokens.

Bubble (1 - mean/max) and imbalance (max/mean) are of per-rank compute time summed over the run.
Budget, density and recall are token-weighted means over (step, rank) entries: a rank's entry stands for
its tokens, so a 40-token document (density and recall 1.0) does not weigh as much as an 8K one.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

from ..errors import UserError
from ..train.metrics import read_metrics

CONFIGURATIONS: dict[str, list[str]] = {
    "baseline": ["balance.batching=random", "balance.tuning=none"],
    "peer": ["balance.batching=length-grouped", "balance.tuning=none"],
    "sab": ["balance.batching=sparsebalance", "balance.tuning=none"],
    "dst": ["balance.batching=random", "balance.tuning=bidirectional"],
    "sab+dst": ["balance.batching=sparsebalance", "balance.tuning=bidirectional"],
    "sab+layer": ["balance.batching=sparsebalance", "balance.tuning=layer"],
    "sab+fill": ["balance.batching=sparsebalance", "balance.tuning=layer", "balance.target=fill"],
    "dense": ["model.attn_implementation=sdpa", "balance.batching=random", "balance.tuning=none"],
}


class BenchSetupError(UserError):
    """The recipe would make configurations train different documents (one line, exit 2)."""


def check_same_documents(max_steps: int, lookahead_steps: int) -> None:
    """Raise unless every configuration's run covers whole look-ahead blocks."""
    if max_steps % lookahead_steps:
        raise BenchSetupError(
            f"training.max_steps ({max_steps}) must be a multiple of balance.lookahead_steps ({lookahead_steps}):"
            f" the look-ahead policies regroup {lookahead_steps} steps' documents at a time, and a run cut inside"
            " such a block would train other documents than the others"
        )


def _weighted_mean(pairs) -> float | None:
    """Mean of the values weighted by their weights; (None or NaN value) pairs are skipped."""
    finite = [(v, w) for v, w in pairs if v is not None and not math.isnan(v)]
    total = sum(w for _, w in finite)
    return sum(v * w for v, w in finite) / total if total > 0 else None


def _median_or_none(values) -> float | None:
    finite = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(finite) if finite else None


def _median_of_rounds(results: list[dict]) -> dict:
    merged = {}
    for key in results[0]:
        values = [r[key] for r in results if r[key] is not None]
        merged[key] = statistics.median(values) if values else None
    merged["train_times"] = [r["train_time"] for r in results]
    return merged


def summarise_run(run_dir: Path) -> dict:
    rows = read_metrics(run_dir / "metrics.jsonl")
    ranks = [r for row in rows for r in row["ranks"]]
    tail = rows[-5:]
    max_compute = sum(max(r["compute_time"] for r in row["ranks"]) for row in rows)
    mean_compute = sum(statistics.mean(r["compute_time"] for r in row["ranks"]) for row in rows)
    return {
        "steps": len(rows),
        "train_time": sum(row["step_time"] for row in rows),
        "mean_step_time": statistics.mean(row["step_time"] for row in rows),
        # over the whole run, as the simulator reports them: a short step's bubble weighs little
        "bubble": 1.0 - mean_compute / max_compute,
        "imbalance": max_compute / mean_compute,
        "mean_budget": _weighted_mean((r["budget"], r["tokens"]) for r in ranks),
        "mean_density": _weighted_mean((r["density"], r["tokens"]) for r in ranks),
        "mean_recall": _weighted_mean((r["recall"], r["tokens"]) for r in ranks),
        "tokens": sum(row["tokens"] for row in rows),
        "final_loss": rows[-1]["loss"],
        # layer-level DST: time in the per-layer all_gathers over the run, as rank 0 measured it (waits included)
        "layer_exchange_seconds": sum(row.get("layer_exchange_seconds", 0.0) or 0.0 for row in rows),
        "density_error_median": _median_or_none(row.get("density_error_median") for row in rows),
        "density_error_p90": _median_or_none(row.get("density_error_p90") for row in rows),
        "loss_last5": statistics.mean(row["loss"] for row in tail),
    }


def run_configuration(recipe: Path, name: str, out_dir: Path, nproc: int, overrides: list[str]) -> dict:
    run_dir = out_dir / name
    argv = [sys.executable, "-m", "sbft_cli.app", "train", str(recipe), "--nproc", str(nproc), "--overwrite"]
    for item in [*overrides, *CONFIGURATIONS[name], f"training.output_dir={run_dir}"]:
        argv += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(argv, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"configuration {name} failed:\n{result.stderr[-4000:]}")
    return summarise_run(run_dir)


def bench_report(runs: dict[str, list[dict]], setup: dict) -> dict:
    """Medians over rounds, and speedups as the median of each round's paired ratio (reference time /
    configuration time in the same round): a machine whose load drifts between rounds moves both
    sides of a pair alike, but not the medians of the two columns."""
    summary = {name: _median_of_rounds(results) for name, results in runs.items()}
    for reference in ("peer", "baseline"):
        if reference in runs:
            for name, results in runs.items():
                ratios = [ref["train_time"] / r["train_time"] for ref, r in zip(runs[reference], results)]
                summary[name][f"speedup_vs_{reference}"] = statistics.median(ratios)
                summary[name][f"speedup_vs_{reference}_rounds"] = ratios
    token_totals = {row["tokens"] for row in summary.values()}
    return {**setup, "same_documents": len(token_totals) == 1, "results": summary}


def run_balance_bench(
    recipe: Path, out_dir: Path, rounds: int = 1, nproc: int = 2, overrides: list[str] | None = None,
    configurations: list[str] | None = None, on_result=None,
) -> dict:
    """Run each configuration `rounds` times, interleaved; every figure is the median over rounds."""
    names = configurations or list(CONFIGURATIONS)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for round_index in range(rounds):
        for name in names:
            result = run_configuration(recipe, name, out_dir / f"round{round_index}", nproc, overrides or [])
            runs[name].append(result)
            if on_result:
                on_result(round_index, name, result)
    report = bench_report(runs, {"recipe": str(recipe), "nproc": nproc, "rounds": rounds, "overrides": overrides or []})
    (out_dir / "balance.json").write_text(json.dumps(report, indent=2))
    return report
