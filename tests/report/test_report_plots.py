import json
import math

import pytest
import typer
from typer.testing import CliRunner

from sbft_cli.report import register
from sparsebalance_ft.errors import UserError
from sparsebalance_ft.report import ReportError, load_metrics, make_report, summarize
from sparsebalance_ft.report.metrics import loss_series


def synthetic_run(run_dir, steps=6, ranks=2, dense=False, partial_tail=False, eval_every=None):
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, steps + 1):
        entries = []
        for rank in range(ranks):
            compute = 1.0 + 0.5 * rank + 0.1 * step
            entries.append(
                {
                    "rank": rank,
                    "compute_time": compute,
                    "wait_time": 0.5 * (ranks - 1 - rank) + 0.01,
                    "predicted_time": compute * 1.05,
                    "budget": None if dense else [0.4 + 0.1 * rank, 0.5] if rank == 1 else 0.5 - 0.02 * step,
                    "density": None if dense else 0.3 + 0.01 * rank,
                    "recall": None if dense else 0.95,
                    "tokens": 4096,
                    "docs": 3,
                }
            )
        slowest = max(e["compute_time"] for e in entries)
        mean = sum(e["compute_time"] for e in entries) / ranks
        lines.append(
            json.dumps(
                {
                    "step": step,
                    "epoch": 0,
                    "loss": 5.0 - 0.1 * step if step != 2 else None,
                    "lr": 1e-4,
                    "tokens": 4096 * ranks,
                    "step_time": slowest + 0.05,
                    "tokens_per_s": 4096 * ranks / (slowest + 0.05),
                    "imbalance": slowest / mean,
                    "bubble": 1 - mean / slowest,
                    "ranks": entries,
                    **({"eval_loss": 6.0 - 0.2 * step, "eval_tokens": 900} if eval_every and step % eval_every == 0 else {}),
                }
            )
        )
    text = "\n".join(lines) + "\n"
    if partial_tail:
        text += '{"step": 7, "ranks": [{"ra'
    (run_dir / "metrics.jsonl").write_text(text)
    return run_dir


def test_report_writes_pngs_and_summary(tmp_path):
    run = synthetic_run(tmp_path / "run", partial_tail=True)
    result = make_report(run)
    assert [p.name for p in result.files] == ["timeline.png", "budgets.png", "bubble_loss.png"]
    for path in result.files:
        assert path.parent == run / "report" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 5000
    s = result.summary
    assert s["steps"] == 6 and s["ranks"] == 2 and s["last_step"] == 6
    assert s["final_loss"] == pytest.approx(4.4) and s["first_loss"] == pytest.approx(4.9)
    assert s["prediction_error"] == pytest.approx(0.05)
    assert 0 < s["mean_bubble"] < 1 and s["mean_density"] == pytest.approx(0.305)
    assert result.timeline_steps[0] == 1 and result.timeline_steps[-1] == 6


def test_dense_run_and_chosen_steps(tmp_path):
    run = synthetic_run(tmp_path / "dense", dense=True, ranks=3)
    result = make_report(run, out_dir=tmp_path / "figs", steps=[2, 99])
    assert result.timeline_steps == [2] and all(p.exists() for p in result.files)
    assert result.summary["mean_density"] is None and result.summary["mean_budget"] is None
    with pytest.raises(ReportError):
        make_report(run, steps=[99])


def test_missing_empty_or_broken_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="metrics file not found"):
        load_metrics(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("\n")
    with pytest.raises(UserError, match="no steps recorded"):
        load_metrics(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(UserError, match=":2: not valid JSON"):
        load_metrics(tmp_path / "bad")


def test_resumed_run_keeps_last_record_per_step(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 2, "loss": 1}\n{"step": 1, "loss": 3}\n{"step": 2, "loss": 2}\n')
    records = load_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2] and records[1]["loss"] == 2
    assert math.isnan(summarize(records)["mean_bubble"] or math.nan)


def _app():
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        pass

    register(app)
    return app


def test_cli(tmp_path):
    run = synthetic_run(tmp_path / "run")
    result = CliRunner().invoke(_app(), ["report", str(run), "--steps", "1,3"])
    assert result.exit_code == 0, result.output
    assert "bubble share" in result.output and "timeline.png" in result.output
    assert (run / "report" / "budgets.png").exists()
    missing = CliRunner().invoke(_app(), ["report", str(tmp_path / "nope")])
    assert missing.exit_code == 2
    bad = CliRunner().invoke(_app(), ["report", str(run), "--steps", "x"])
    assert bad.exit_code == 2


def test_eval_loss_is_summarised_and_drawn_beside_the_training_loss(tmp_path):
    run = synthetic_run(tmp_path / "run", eval_every=3)
    records = load_metrics(run)
    series = loss_series(records)
    assert series["eval"] == ([3, 6], [pytest.approx(5.4), pytest.approx(4.8)])
    assert series["train"][0] == [1, 3, 4, 5, 6]  # step 2 logged no loss
    result = make_report(run)
    s = result.summary
    assert s["eval_points"] == 2 and s["first_eval_loss"] == pytest.approx(5.4) and s["final_eval_loss"] == pytest.approx(4.8)
    assert summarize(load_metrics(synthetic_run(tmp_path / "plain")))["final_eval_loss"] is None
    output = CliRunner().invoke(_app(), ["report", str(run)]).output
    assert "eval loss first -> final" in output and "5.4 -> 4.8" in output


def test_rescaled_prediction_error_uses_only_earlier_steps():
    """An analytic model off by a constant factor is exact once rescaled; a step is judged on earlier ones only."""
    from sparsebalance_ft.report.metrics import rescaled_prediction_errors

    def record(step, predicted, measured):
        return {"step": step, "ranks": [{"rank": 0, "predicted_time": predicted, "compute_time": measured}]}

    # step 1 (warm-up, 10x slow) is left out; steps 2-3 give ratio 3; step 4 measured 4.5 against 1 x 3
    records = [record(1, 1.0, 30.0), record(2, 1.0, 3.0), record(3, 2.0, 6.0), record(4, 1.0, 4.5)]
    assert rescaled_prediction_errors(records) == pytest.approx([0.0, 1.0 - 3.0 / 4.5])
    raw = (1 - 1 / 30 + 1 - 1 / 3 + 1 - 2 / 6 + 1 - 1 / 4.5) / 4  # as predicted, no rescaling
    assert summarize(records)["prediction_error"] == pytest.approx(raw)
    assert summarize(records)["prediction_error_rescaled"] == pytest.approx((0.0 + 1.0 - 3.0 / 4.5) / 2)
