"""`sbft bench step` on the tiny model: every row's fields, exact full budget, the Amdahl arithmetic."""
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sparsebalance_ft.bench.step import StepPlan, amdahl_ceiling, length_recipe, run_loss_bench, run_step_bench

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "bench-step.yaml"
FIELDS = ("length", "arm", "step_s", "tokens_per_s", "speedup_vs_dense", "loss_gap", "kept_density", "peak_mem_bytes",
          "attention_share", "amdahl_ceiling", "share_of_ceiling", "host_syncs_per_step", "breakdown")


@pytest.fixture(scope="module")
def quick_result(tiny_model_dir, text_corpus_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench_step")
    plan = StepPlan(lengths=[512], arms=["dense", "0.3", "1.0"], repeats=[1])
    overrides = [f"data.path={text_corpus_dir}", "data.text_glob=*", f"data.cache_dir={tmp / 'cache'}"]
    out = tmp / "step.json"
    return run_step_bench(RECIPE, tiny_model_dir, plan, out, overrides), out


def test_rows_carry_every_field_and_the_file_matches(quick_result):
    result, out = quick_result
    assert json.loads(out.read_text()) == result and result["complete"]
    assert out.with_suffix(".png").stat().st_size > 0
    assert {row["arm"] for row in result["rows"]} == {"dense", "0.3", "1.0"}
    for row in result["rows"]:
        missing = [f for f in FIELDS if f not in row or (row[f] is None and not (f == "breakdown" and row["arm"] == "dense"))]
        assert not missing, (row["arm"], missing)
        assert row["tokens_per_s"] == pytest.approx(512 / row["step_s"])
    sparse = next(r for r in result["rows"] if r["arm"] == "0.3")
    assert set(sparse["breakdown"]) == {"selection", "kernel_forward", "kernel_backward", "recompute", "report", "other"}
    assert 0 < sparse["report_share_of_step"] < 1
    assert sum(sparse["breakdown"].values()) == pytest.approx(sparse["step_s"])
    assert sparse["breakdown"]["selection"] > 0 and sparse["breakdown"]["kernel_backward"] > 0
    assert sparse["breakdown"]["recompute"] > 0  # the recipe checkpoints every layer
    assert 0 < sparse["kept_density"] < 1
    assert sparse["attention_host_syncs_per_step"] > 0  # the selection reads a few values per layer


def test_full_budget_loss_equals_dense_on_the_same_tokens(quick_result):
    rows = {row["arm"]: row for row in quick_result[0]["rows"]}
    assert rows["1.0"]["kept_density"] == 1.0
    assert abs(rows["1.0"]["loss"] - rows["dense"]["loss"]) <= 1e-4 * rows["dense"]["loss"]
    assert abs(rows["1.0"]["loss_gap"]) <= 1e-4
    assert rows["0.3"]["loss"] != rows["dense"]["loss"]  # a sparse budget does change what is computed


def test_loss_only_gives_the_steps_losses_and_densities_from_a_forward(quick_result, tiny_model_dir,
                                                                       text_corpus_dir, tmp_path, capsys):
    from sparsebalance_ft.bench.step_report import main

    plan = StepPlan(lengths=[512], arms=["dense", "0.3", "1.0"], repeats=[1])
    overrides = [f"data.path={text_corpus_dir}", "data.text_glob=*", f"data.cache_dir={tmp_path / 'cache'}"]
    out = tmp_path / "loss.json"
    result = run_loss_bench(RECIPE, tiny_model_dir, plan, out, overrides)
    assert json.loads(out.read_text()) == result and result["complete"]
    stepped = {row["arm"]: row for row in quick_result[0]["rows"]}
    for row in result["rows"]:  # the step's loss came with a backward and an optimizer step around it
        assert row["loss"] == pytest.approx(stepped[row["arm"]]["loss"], rel=1e-5)
        assert row["kept_density"] == pytest.approx(stepped[row["arm"]]["kept_density"], rel=1e-6)
        assert row["loss_gap"] == pytest.approx(stepped[row["arm"]]["loss_gap"], abs=1e-5)
    main([str(out)])
    assert "| 512 | 0.3 |" in capsys.readouterr().out


def test_each_length_runs_with_its_own_rope_scaling(tiny_model_dir, text_corpus_dir, tmp_path):
    """A length within the native positions runs unscaled even when a longer length in the same run needs a
    scaling: its loss is the checkpoint's own, as transformers computes it."""
    import shutil

    from transformers import AutoModelForCausalLM

    from sparsebalance_ft.bench.step import _BenchSetup

    model = tmp_path / "native-256"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    overrides = [f"data.path={text_corpus_dir}", "data.text_glob=*", f"data.cache_dir={tmp_path / 'cache'}"]
    setup = _BenchSetup(RECIPE, model, StepPlan(lengths=[256, 512], arms=["dense"], repeats=[1]), overrides)
    run, tokens = setup.length_run(256)
    setup.length_run(512)
    assert setup.result["lengths"]["256"]["rope_scaling"] is None
    assert setup.result["lengths"]["512"]["rope_scaling"]["type"] == "yarn"
    ids = torch.as_tensor(tokens, dtype=torch.long)[None]
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)(ids, labels=ids).loss
    assert run.forward_loss("dense", tokens).loss == pytest.approx(float(reference), rel=1e-5)


def test_ceiling_from_measured_share_and_density(quick_result):
    rows = {row["arm"]: row for row in quick_result[0]["rows"]}
    dense = rows["dense"]
    a = (dense["spans"]["attention_forward"] + dense["spans"]["attention_recompute"]
         + dense["spans"]["attention_backward"]) / dense["step_s"]
    assert 0 < a < 1
    for row in rows.values():
        assert row["attention_share"] == pytest.approx(a)
        d = row["kept_density"]
        assert row["amdahl_ceiling"] == pytest.approx(1.0 / ((1.0 - a) + a * d))
        assert row["speedup_vs_dense"] == pytest.approx(dense["step_s"] / row["step_s"])
        assert row["share_of_ceiling"] == pytest.approx(row["speedup_vs_dense"] / row["amdahl_ceiling"])
    assert amdahl_ceiling(0.8, 0.25) == pytest.approx(2.5) and amdahl_ceiling(0.0, 0.1) == 1.0


def test_a_stopped_runs_json_still_gives_its_table_and_png(quick_result, tmp_path, capsys):
    from sparsebalance_ft.bench.step_report import main

    result, _ = quick_result
    stopped = {**result, "complete": False, "rows": [r for r in result["rows"] if r["arm"] != "1.0"]}
    path = tmp_path / "stopped.json"
    path.write_text(json.dumps(stopped))
    main([str(path)])
    table = capsys.readouterr().out
    assert "| 512 | 0.3 | 1 |" in table and "| 1.0 |" not in table
    assert path.with_suffix(".png").stat().st_size > 0


def test_lengths_past_the_native_positions_get_the_recipes_rope_scaling(tmp_path, tiny_model_dir):
    from sparsebalance_ft.recipe import recipe_from_dict

    native = json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    base = recipe_from_dict({"model": {"path": str(tiny_model_dir)}, "data": {"path": str(tmp_path)}})
    assert length_recipe(base, native).model.rope_scaling is None
    longer = length_recipe(base, 3 * native - 1)
    assert longer.data.max_seq_len == 3 * native - 1
    assert (longer.model.rope_scaling.type, longer.model.rope_scaling.factor) == ("yarn", "auto")
    linear = recipe_from_dict({**base.model_dump(mode="json"), "model": {"path": str(tiny_model_dir),
                                                                          "rope_scaling": {"type": "linear"}}})
    assert length_recipe(linear, 2 * native).model.rope_scaling.type == "linear"  # the recipe's own choice stays


@pytest.mark.parametrize("args, says", [
    (["--arms", "0.3,0.5"], "--arms"),
    (["--repeats", "2,2"], "--repeats"),
    (["--device", "tpu"], "--device"),
])
def test_bad_flags_are_one_line_and_exit_2(args, says, tiny_model_dir, tmp_path):
    from cli.app import app

    result = CliRunner().invoke(app, ["bench", "step", "--model", str(tiny_model_dir), "--lengths", "256",
                                      "--out", str(tmp_path / "s.json"), *args])
    assert result.exit_code == 2, result.output
    assert says in result.output and len(result.output.strip().splitlines()) == 1
