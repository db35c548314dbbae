"""Benchmark: the host-side overhead the balancer adds to a step, timed (not asserted: on a shared machine
a wall-clock bound in a test flakes). Three calls on every rank's critical path or per epoch:

- `tune` at 64 ranks on a 17-point budget grid (every step);
- the analytic cost model's `doc_times` over 100,000 documents (a whole look-ahead window);
- Karmarkar-Karp of 100,000 weights into 1,024 parts (an epoch's partition at scale).

    python -m sparsebalance_ft.bench.overhead --out bench_results/overhead.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np


def _median_seconds(call: Callable[[], object], repeats: int) -> float:
    call()  # warm-up: first-call costs are not per-step costs
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(ranks: int = 64, documents: int = 100_000, parts: int = 1024, repeats: int = 20) -> dict:
    from ..balancer.tuner import budget_grid, tune
    from ..batching import karmarkar_karp
    from ..cost.model import AnalyticCostModel

    rng = np.random.default_rng(0)
    grid = budget_grid(0.1, 0.9, 0.5, 17)
    times = rng.lognormal(0.0, 0.8, (ranks, 1)) + np.cumsum(rng.uniform(0.0, 0.1, (ranks, grid.size)), axis=1)
    model = AnalyticCostModel.llama_8b()
    lengths, densities = rng.integers(16, 131072, documents), rng.uniform(0.1, 0.6, documents)
    weights = rng.lognormal(8, 1.2, documents)
    return {
        "machine": platform.processor() or platform.machine(),
        "repeats": repeats,
        "tune_seconds": _median_seconds(lambda: tune(times, grid, 0.5, 0.1, 0.9, "bidirectional"), repeats),
        "tune_ranks": ranks,
        "doc_times_seconds": _median_seconds(lambda: model.doc_times(lengths, densities), max(1, repeats // 4)),
        "karmarkar_karp_seconds": _median_seconds(lambda: karmarkar_karp(weights, parts), 1),
        "documents": documents,
        "parts": parts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    result = run(repeats=args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
