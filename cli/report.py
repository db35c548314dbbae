"""`sbft report RUN_DIR`: PNG figures and a short summary of a training run's metrics.jsonl."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import console, user_errors


def _parse_steps(text: str | None) -> list[int] | None:
    from sparsebalance_ft.report import ReportError

    if not text:
        return None
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise ReportError(f"--steps {text!r}: expected comma-separated step numbers, e.g. 1,10,20") from None


def _fmt(value, kind: str = "") -> str:
    if value is None:
        return "-"
    if kind == "%":
        return f"{100 * value:.1f}%"
    if kind == "s":
        return f"{value:.3f} s"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _prediction_error(summary: dict, profiled: bool) -> str:
    """With a profile, the error as predicted; else the analytic model's, rescaled online (labelled)."""
    if profiled or summary["prediction_error_rescaled"] is None:
        label = " (profile)" if profiled else " (analytic cost model, uncalibrated: run `sbft profile`)"
        return _fmt(summary["prediction_error"], "%") + (label if summary["prediction_error"] is not None else "")
    return (f"{_fmt(summary['prediction_error_rescaled'], '%')} (analytic cost model rescaled by each rank's"
            f" measured times of earlier steps; {_fmt(summary['prediction_error'], '%')} at its assumed FLOP rate)")


def register(app: typer.Typer) -> None:
    @app.command("report")
    @user_errors
    def report_command(
        run_dir: Path = typer.Argument(..., help="Training run directory holding metrics.jsonl."),
        out: Optional[Path] = typer.Option(None, help="Where to write the PNGs (default RUN_DIR/report)."),
        steps: Optional[str] = typer.Option(None, help="Steps for the per-rank timeline, e.g. 1,10,20."),
    ) -> None:
        """Draw a per-rank timeline, budgets/densities over time, bubble and loss over time (PNG)."""
        from rich.table import Table

        from sparsebalance_ft.report import FIGURES, make_report

        result = make_report(run_dir, out, _parse_steps(steps))
        s = result.summary
        table = Table(title=f"{run_dir}: steps {s['first_step']}..{s['last_step']} on {s['ranks']} ranks", show_header=False)
        rows = [
            ("steps", _fmt(s["steps"])),
            ("total step time", _fmt(s["total_time"], "s")),
            ("mean step time", _fmt(s["mean_step_time"], "s")),
            ("tokens / s", _fmt(s["mean_tokens_per_s"])),
            ("bubble share", _fmt(s["mean_bubble"], "%")),
            ("imbalance (max/mean)", _fmt(s["mean_imbalance"])),
            ("mean budget", _fmt(s["mean_budget"])),
            ("mean density", _fmt(s["mean_density"])),
            ("mean recall", _fmt(s["mean_recall"])),
            ("prediction error", _prediction_error(s, result.profiled)),
            ("loss first -> final", f"{_fmt(s['first_loss'])} -> {_fmt(s['final_loss'])}"),
            ("eval loss first -> final", f"{_fmt(s['first_eval_loss'])} -> {_fmt(s['final_eval_loss'])}"),
        ]
        for name, value in rows:
            table.add_row(name, value)
        console.print(table)
        console.print(f"timeline steps: {', '.join(map(str, result.timeline_steps))}")
        for path in result.files:
            console.print(f"wrote {path}: {FIGURES.get(path.name, '')}")
