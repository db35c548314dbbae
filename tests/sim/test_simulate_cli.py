"""`sbft simulate` as a user runs it (through Typer's test runner)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from sbft_cli.simulate import register


def make_app() -> typer.Typer:
    app = typer.Typer(pretty_exceptions_enable=False, add_completion=False)

    @app.callback()
    def root() -> None:
        pass

    register(app)
    return app


def run(*args):
    return CliRunner().invoke(make_app(), ["simulate", *map(str, args)], env={"COLUMNS": "200"})


def test_simulate_writes_json_and_plots(tmp_path):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([int(x) for x in (100 + (i * 7919) % 20000 for i in range(300))]))
    out = tmp_path / "out"
    result = run("--lengths", lengths, "--ranks", "2,4", "--max-len", "32768", "--out", out, "--markdown")
    assert result.exit_code == 0, result.output
    assert "sparsebalance" in result.output and "| policy |" in result.output
    data = json.loads((out / "simulation.json").read_text())
    assert [r["config"]["world_size"] for r in data["runs"]] == [2, 4]
    rows = data["runs"][0]["rows"]
    assert len(rows) == 7 * 3  # every policy under none, bidirectional and layer
    assert {(r["policy"], r["lookahead"]) for r in rows} >= {("length-grouped", 32), ("verl", 32), ("random", 1)}
    assert all(r["peer"] in ("length-grouped", "verl") and r["vs_peer"] > 0 for r in rows)
    assert (out / "rank_load.png").stat().st_size > 1000
    assert (out / "speedup_vs_ranks.png").stat().st_size > 1000


def test_simulate_synthetic_and_text_dir(tmp_path):
    for i in range(30):
        (tmp_path / f"f{i}.txt").write_text("word " * (50 * (i + 1) ** 2))
    result = run("--from-text-dir", tmp_path, "--ranks", "4", "--tuning", "none", "--policies", "random,sparsebalance")
    assert result.exit_code == 0, result.output
    result = run("--synthetic", "200", "--median", "4000", "--ranks", "8", "--steps", "3", "--knowledge", "remembered")
    assert result.exit_code == 0, result.output
    result = run("--long-tail", "300", "--ranks", "8", "--knowledge", "predicted", "--predicted-r2", "0.5",
                 "--policies", "length-grouped,verl,sparsebalance", "--lookahead-steps", "4")
    assert result.exit_code == 0, result.output


def test_help_lists_the_fair_peers():
    result = run("--help")
    assert result.exit_code == 0
    assert "length-grouped" in result.output and "verl" in result.output and "--lookahead-steps" in result.output


def calibration_fixture(rng, n: int, low: int, high: int) -> list[dict]:
    """Documents whose density follows 0.3 (L / 8K)^-0.2, scaled by their compression ratio, from 2K
    tokens up; below 2K the law bends (as the anchors make it on a real model): flatter and denser."""
    docs = []
    for _ in range(n):
        tokens = int(rng.integers(low, high))
        compression = float(rng.uniform(0.2, 0.6))
        law = 0.3 * (tokens / 8192) ** -0.2 if tokens >= 2048 else 0.9 * (tokens / 2048) ** -0.05
        density = float(np.clip(law * np.exp(1.5 * (compression - 0.4)), 0.02, 0.99))
        docs.append({"kind": "code" if compression < 0.4 else "prose", "source": f"file{len(docs)}", "tokens": tokens,
                     "density": density, "compression_ratio": compression, "token_diversity": float(rng.uniform(0.1, 0.5))})
    return docs


def test_density_calibration_from_the_real_model_contract(tmp_path):
    """The reader of the real-model benchmark's density contract, on a small fixture: the law is fitted on
    the documents of 2K tokens and more, censored ones (every block kept) left out."""
    rng = np.random.default_rng(0)
    docs = calibration_fixture(rng, 30, 2048, 8192) + calibration_fixture(rng, 30, 256, 2048)
    docs += [{"kind": "prose", "source": "short", "tokens": 100, "density": 1.0, "compression_ratio": 0.5,
              "token_diversity": 0.5}] * 5  # kept every block: censored, left out of the fit
    real = tmp_path / "real.json"
    real.write_text(json.dumps({"densities": {"budget": 0.5, "block_size": 64, "model": "fixture",
                                              "documents": docs, "summary": {}}}))
    out = tmp_path / "out"
    result = run("--synthetic", "300", "--ranks", "4", "--steps", "3", "--density-from", real, "--out", out)
    assert result.exit_code == 0, result.output
    model = json.loads((out / "simulation.json").read_text())["density_model"]
    assert model["length_exponent"] == pytest.approx(0.2, abs=0.02)  # through the short ones: far flatter
    assert model["predicted_r2"] > 0.8  # the fixture's density is a function of its compression ratio
    assert model["calibration"]["documents"] == 30 and model["calibration"]["min_tokens"] >= 2048
    # a figure given beside the calibration overrides that figure only (a what-if on the measured model)
    result = run("--synthetic", "300", "--ranks", "4", "--steps", "3", "--density-from", real,
                 "--density-sigma", "0.7", "--out", out)
    assert result.exit_code == 0, result.output
    what_if = json.loads((out / "simulation.json").read_text())["density_model"]
    assert what_if["sigma"] == 0.7 and "--density-sigma" in result.output
    assert {k: what_if[k] for k in ("mean", "length_exponent", "predicted_r2")} == \
        {k: model[k] for k in ("mean", "length_exponent", "predicted_r2")}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"densities": {"documents": "no"}}))
    assert "densities.documents" in one_line_error(run("--synthetic", "10", "--density-from", bad))


def test_density_calibration_without_long_documents_fits_every_uncensored_one():
    """A `--quick` real-model run stops at 2K tokens: the fit then takes what there is, and says from where."""
    from sparsebalance_ft.sim.calibration import MIN_DOCUMENTS, calibrate

    rng = np.random.default_rng(1)
    docs = calibration_fixture(rng, 20, 256, 2048) + calibration_fixture(rng, MIN_DOCUMENTS - 1, 2048, 8192)
    fit = calibrate({"budget": 0.5, "documents": docs})
    assert fit.documents == len(docs) and fit.min_tokens < 2048
    assert calibrate({"budget": 0.5, "documents": docs + calibration_fixture(rng, 1, 2048, 8192)}).documents == MIN_DOCUMENTS


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def test_simulate_user_errors(tmp_path):
    assert "exactly one" in one_line_error(run("--ranks", "4"))
    assert "not found" in one_line_error(run("--lengths", tmp_path / "nope.json"))
    assert "--policies" in one_line_error(run("--synthetic", "10", "--policies", "random,greedy"))
    assert "--ranks" in one_line_error(run("--synthetic", "10", "--ranks", "4,x"))
    lengths = tmp_path / "l.json"
    lengths.write_text("[10, 99999]")
    assert "document 1" in one_line_error(run("--lengths", lengths, "--max-len", "4096", "--too-long", "error"))
    assert "token cap" in one_line_error(run("--lengths", lengths, "--max-len", "200000", "--token-cap", "4096"))


def test_simulate_from_a_recipe_dataset(tmp_path, tiny_model_dir, text_corpus_dir):
    import yaml

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_model_dir)},
        "data": {"path": str(text_corpus_dir), "max_seq_len": 2048, "cache_dir": str(tmp_path / "cache")},
    }))
    result = run("--recipe", recipe, "--max-len", "2048", "--ranks", "2", "--tuning", "none", "--out", tmp_path / "o")
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "o" / "simulation.json").read_text())
    assert data["lengths_summary"]["count"] == 24
    assert data["lengths_summary"]["max"] <= 2048


def test_peers_option_and_markdown_tables(tmp_path):
    out = tmp_path / "out"
    result = run("--synthetic", "120", "--median", "8000", "--ranks", "4", "--docs-per-rank", "1,2", "--tuning", "none,layer",
                 "--policies", "tokens,verl,sparsebalance", "--peers", "tokens,verl", "--lookahead-steps", "1",
                 "--markdown", "--out", out)
    assert result.exit_code == 0, result.output
    rows = json.loads((out / "simulation.json").read_text())["runs"][0]["rows"]
    assert {r["peer"] for r in rows} <= {"tokens", "verl"} and all(r["vs_peer_untuned"] > 0 for r in rows)
    tables = (out / "tables.md").read_text()
    assert "vs peer untuned" in tables and "4 ranks, 2 documents per rank" in tables
    assert "| vs tokens | vs verl | sparsebalance + layer vs best peer untuned |" in tables
    assert "--peers 'kk-length'" in one_line_error(run("--synthetic", "10", "--policies", "verl,sparsebalance",
                                                       "--peers", "kk-length"))
