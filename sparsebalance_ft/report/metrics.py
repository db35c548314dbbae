"""Reading a run's metrics.jsonl (one JSON object per optimizer step) and summarising it."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..errors import UserError


class ReportError(UserError):
    """A run directory or metrics file that cannot be reported on (one line, exit 2)."""


def load_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The step records of RUN_DIR/metrics.jsonl, by step; an unparsable last line (a run cut off
    mid-write) is skipped, any other bad line is an error naming the line."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl" if run_dir.is_dir() or not run_dir.suffix else run_dir
    if not path.is_file():
        raise ReportError(f"{path}: metrics file not found (is {run_dir} a training run directory?)")
    lines = path.read_text().splitlines()
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    records = []
    for index, (number, line) in enumerate(numbered):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if index == len(numbered) - 1:
                break  # a partial last line
            raise ReportError(f"{path}:{number}: not valid JSON: {error.msg}") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ReportError(f"{path}:{number}: expected an object with an integer 'step'")
        records.append(record)
    if not records:
        raise ReportError(f"{path}: no steps recorded yet")
    latest: dict[int, dict] = {}
    for record in records:  # a resumed run may log a step again: the later line wins
        latest[record["step"]] = record
    return [latest[s] for s in sorted(latest)]


def num(value) -> float:
    """A metric as float; None, missing, non-numeric or lists (per-layer budgets: their mean)."""
    if isinstance(value, (list, tuple)):
        values = [num(v) for v in value]
        values = [v for v in values if math.isfinite(v)]
        return sum(values) / len(values) if values else math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def rank_series(records: list[dict], key: str) -> dict[int, tuple[list[int], list[float]]]:
    """rank -> (steps, values) of one per-rank field, NaN where it was not recorded."""
    series: dict[int, tuple[list[int], list[float]]] = {}
    for record in records:
        for entry in record.get("ranks") or []:
            rank = entry.get("rank")
            if not isinstance(rank, int):
                continue
            steps, values = series.setdefault(rank, ([], []))
            steps.append(record["step"])
            values.append(num(entry.get(key)))
    return dict(sorted(series.items()))


def loss_series(records: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """The loss curves to draw: `train` (every step's loss) and `eval` (the steps that ran validation)."""
    series = {}
    for name, key in (("train", "loss"), ("eval", "eval_loss")):
        points = [(r["step"], num(r.get(key))) for r in records]
        points = [(step, value) for step, value in points if math.isfinite(value)]
        series[name] = ([step for step, _ in points], [value for _, value in points])
    return series


def rescaled_prediction_errors(records: list[dict]) -> list[float]:
    """|predicted x r / measured - 1| per rank and step, where r is the median measured / predicted
    ratio of that rank's earlier steps, its first step (a warm-up) left out.

    What an analytic cost model scaled online by this machine's measured times would have predicted:
    its absolute seconds assume a FLOP rate, but balancing decisions only compare ranks, so one
    factor per rank is all it lacks. Each step is predicted from earlier steps only."""
    ratios: dict[Any, list[float]] = {}
    errors = []
    for record in records:
        for entry in record.get("ranks") or []:
            predicted, measured = num(entry.get("predicted_time")), num(entry.get("compute_time"))
            if not (math.isfinite(predicted) and predicted > 0 and math.isfinite(measured) and measured > 0):
                continue
            seen = ratios.setdefault(entry.get("rank"), [])
            earlier = sorted(seen[1:])
            if earlier:
                errors.append(abs(predicted * earlier[len(earlier) // 2] / measured - 1.0))
            seen.append(measured / predicted)
    return errors


def _mean(values) -> float | None:
    values = [v for v in values if math.isfinite(v)]
    return sum(values) / len(values) if values else None


def summarize(records: list[dict]) -> dict[str, Any]:
    """Run-level figures (None where the run did not record them)."""
    ranks = [entry for record in records for entry in (record.get("ranks") or [])]
    errors = []
    for entry in ranks:
        predicted, measured = num(entry.get("predicted_time")), num(entry.get("compute_time"))
        if math.isfinite(predicted) and math.isfinite(measured) and measured > 0:
            errors.append(abs(predicted / measured - 1.0))
    losses = loss_series(records)
    finite_losses, eval_losses = losses["train"][1], losses["eval"][1]
    step_times = [num(r.get("step_time")) for r in records]
    return {
        "steps": len(records),
        "first_step": records[0]["step"],
        "last_step": records[-1]["step"],
        "ranks": len({e.get("rank") for e in ranks}),
        "total_time": sum(v for v in step_times if math.isfinite(v)) or None,
        "mean_step_time": _mean(step_times),
        "mean_tokens_per_s": _mean(num(r.get("tokens_per_s")) for r in records),
        "mean_bubble": _mean(num(r.get("bubble")) for r in records),
        "mean_imbalance": _mean(num(r.get("imbalance")) for r in records),
        "mean_budget": _mean(num(e.get("budget")) for e in ranks),
        "mean_density": _mean(num(e.get("density")) for e in ranks),
        "mean_recall": _mean(num(e.get("recall")) for e in ranks),
        "mean_wait_time": _mean(num(e.get("wait_time")) for e in ranks),
        "prediction_error": _mean(errors),
        "prediction_error_rescaled": _mean(rescaled_prediction_errors(records)),
        "first_loss": finite_losses[0] if finite_losses else None,
        "final_loss": finite_losses[-1] if finite_losses else None,
        "eval_points": len(eval_losses),
        "first_eval_loss": eval_losses[0] if eval_losses else None,
        "final_eval_loss": eval_losses[-1] if eval_losses else None,
    }


def default_timeline_steps(records: list[dict], count: int = 4) -> list[int]:
    """First, last, median and the step with the largest bubble (distinct, in order)."""
    steps = [r["step"] for r in records]
    chosen = {steps[0], steps[-1], steps[len(steps) // 2]}
    bubbles = [(num(r.get("bubble")), r["step"]) for r in records]
    bubbles = [b for b in bubbles if math.isfinite(b[0])]
    if bubbles:
        chosen.add(max(bubbles)[1])
    return sorted(chosen)[:count]
