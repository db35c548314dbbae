"""`sbft report`: figures and a summary of a run's metrics.jsonl."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .metrics import ReportError, default_timeline_steps, load_metrics, summarize

__all__ = ["FIGURES", "ReportError", "ReportResult", "load_metrics", "make_report", "summarize"]


FIGURES = {  # what each PNG shows, in one line (printed by `sbft report`)
    "timeline.png": "per rank, compute time then the wait for the slowest rank, at a few steps",
    "budgets.png": "each rank's attention budget, kept density and sampled recall over the steps",
    "bubble_loss.png": "bubble share, step time, and training and validation loss over the steps",
}


@dataclass
class ReportResult:
    summary: dict[str, Any]
    files: list[Path]
    timeline_steps: list[int]
    profiled: bool = False  # the run's cost model came from `sbft profile` (else: analytic)


def make_report(run_dir: str | Path, out_dir: str | Path | None = None, steps: list[int] | None = None) -> ReportResult:
    """Read RUN_DIR/metrics.jsonl and write timeline.png, budgets.png and bubble_loss.png.

    out_dir defaults to RUN_DIR/report; steps (for the timeline) default to the first, median,
    last and largest-bubble steps. Raises `ReportError` (a UserError) for a missing or empty
    file or when none of the requested steps was recorded.
    """
    records = load_metrics(run_dir)
    recorded = {r["step"] for r in records}
    if steps:
        missing = [s for s in steps if s not in recorded]
        chosen = [s for s in steps if s in recorded]
        if not chosen:
            raise ReportError(
                f"--steps {','.join(map(str, missing))}: not recorded (steps {min(recorded)}..{max(recorded)} are)"
            )
    else:
        chosen = default_timeline_steps(records)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    from .plots import plot_bubble_loss, plot_budgets, plot_timeline

    files = [
        plot_timeline(records, chosen, out / "timeline.png"),
        plot_budgets(records, out / "budgets.png"),
        plot_bubble_loss(records, out / "bubble_loss.png"),
    ]
    return ReportResult(summarize(records), files, chosen, _ran_with_profile(Path(run_dir)))


def _ran_with_profile(run_dir: Path) -> bool:
    """Whether the run's recipe (as `sbft train` saved it) named a latency profile."""
    import yaml

    recipe = run_dir / "recipe.yaml"
    if not recipe.is_file():
        return False
    data = yaml.safe_load(recipe.read_text()) or {}
    return bool((data.get("balance") or {}).get("profile"))
