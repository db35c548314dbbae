"""The profiler and validation on the shared tiny model (tiny grids: these test plumbing, not accuracy)."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
import yaml

import _fake_sparse
from sparsebalance_ft.cost import ProfileExtrapolationWarning, ProfiledCostModel
from sparsebalance_ft.profiling.profiler import (
    NOOP_ATTENTION,
    ControllerDriver,
    ProfileSettings,
    attention_swapped,
    profile_model,
)
from sparsebalance_ft.profiling.validate import random_micro_batches, validate_model
from sparsebalance_ft.train.model import enable_checkpointing

TINY = ProfileSettings(lengths=[64, 128], densities=[0.25, 1.0], token_points=2, warmup=1, repeats=1,
                       threads=1, clock="cpu", calibration_batches=3)


@pytest.fixture
def sparse_lora_model(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    _fake_sparse.register()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                 attn_implementation=_fake_sparse.NAME)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))


def test_profile_and_validate_a_sparse_model(sparse_lora_model, tmp_path):
    driver = ControllerDriver(_fake_sparse.CONTROLLER)
    profile = profile_model(sparse_lora_model, driver, max_len=128, token_cap=256, settings=TINY, progress=False,
                            meta={"recipe_fingerprint": "abc"})
    assert profile.lengths.tolist() == [64, 128] and profile.densities.tolist() == [0.25, 1.0]
    assert profile.attention_scope == "document" and profile.num_layers == 4
    assert np.all(profile.attn > 0) and np.all(np.diff(profile.attn, axis=1) >= 0)
    assert np.all(np.diff(profile.linear) >= 0) and profile.tokens[-1] == 256
    assert profile.step_overhead > 0
    meta = profile.meta
    assert meta["recipe_fingerprint"] == "abc" and meta["hardware"]["torch_threads"] == 1
    assert {"torch", "transformers", "peft"} <= set(meta["versions"]) and meta["model_config_hash"]
    assert meta["settings"]["clock"] == "cpu"
    # the model is left as it was: its own attention, no gradients
    assert sparse_lora_model.config._attn_implementation == _fake_sparse.NAME
    assert all(p.grad is None for p in sparse_lora_model.parameters())

    path = tmp_path / "profile.json"
    profile.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = ProfiledCostModel.load(path)  # same machine: no warning
    with pytest.warns(ProfileExtrapolationWarning, match="beyond the profiled grid"):  # 200 > the grid's 128
        assert loaded.micro_batch_time(np.array([100, 200]), 0.5) == pytest.approx(
            profile.micro_batch_time(np.array([100, 200]), 0.5))

    report = validate_model(sparse_lora_model, driver, loaded, max_len=128, token_cap=256, micro_batches=2,
                            warmup=0, repeats=1, progress=False)
    assert report["micro_batch"]["n"] == 2 and report["held_out"]["n"] >= 1
    assert report["clock"] == "cpu"
    # each prediction is the loaded profile's own, and the summary is the error of those against the measurements
    for case in report["cases"]:
        assert case["predicted"] == pytest.approx(loaded.micro_batch_time(np.array(case["lengths"]), case["density"]))
        assert case["measured"] > 0
    cases = report["cases"]
    errors = sorted(abs(c["predicted"] - c["measured"]) / c["measured"] for c in cases)
    assert report["all"]["n"] == len(cases) and report["all"]["max_ape"] == pytest.approx(errors[-1])
    assert report["all"]["median_ape"] == pytest.approx(float(np.median(errors)))


def test_noop_attention_swap_is_restored_even_on_error(sparse_lora_model):
    from sparsebalance_ft.profiling.profiler import register_noop_attention

    register_noop_attention()
    with pytest.raises(RuntimeError):
        with attention_swapped(sparse_lora_model, NOOP_ATTENTION):
            assert sparse_lora_model.config._attn_implementation == NOOP_ATTENTION
            raise RuntimeError("boom")
    assert sparse_lora_model.config._attn_implementation == _fake_sparse.NAME


def test_random_micro_batches_respect_the_cap():
    batches = random_micro_batches(20, max_len=1024, token_cap=2048, densities=[0.1, 1.0], seed=3)
    for docs, d in batches:
        assert sum(docs) <= 2048 + 32 and max(docs) <= 1024 and 0.1 <= d <= 1.0
    assert any(len(docs) > 1 for docs, _ in batches)


@pytest.mark.slow
def test_cli_profile_then_validate(tiny_model_dir, jsonl_corpus, tmp_path):
    import typer
    from typer.testing import CliRunner

    from sbft_cli.profile import register

    app = typer.Typer()
    register(app)

    @app.command("noop")
    def _noop() -> None:  # a second command keeps `profile` a named subcommand
        pass

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_model_dir), "attn_implementation": "sdpa"},
        "data": {"path": str(jsonl_corpus), "max_seq_len": 128},
        "training": {"output_dir": str(tmp_path / "run")},
    }))
    out = tmp_path / "profile.json"
    runner = CliRunner()
    common = ["--repeats", "1", "--warmup", "0", "--threads", "1", "--no-progress"]
    result = runner.invoke(app, ["profile", str(recipe), "--out", str(out), "--lengths", "64,128",
                                 "--calibration-batches", "3", "--token-points", "2", *common])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["attention_scope"] == "micro_batch" and data["attention"]["densities"] == [1.0]
    assert data["meta"]["settings"]["clock"] == "cpu"

    result = runner.invoke(app, ["profile", "--validate", str(out), str(recipe), "--micro-batches", "2", *common])
    assert "median_ape" in result.output
    assert result.exit_code == 0, result.output
    report = json.loads(out.with_suffix(".validation.json").read_text())
    assert report["micro_batch"]["n"] == 2
    assert out.with_suffix(".validation.png").stat().st_size > 1000

    bad = runner.invoke(app, ["profile", str(recipe), "--lengths", "128,99999", "--no-progress"])
    assert bad.exit_code == 2 and "exceeds data.max_seq_len" in bad.output
    bad = runner.invoke(app, ["profile", "--validate", str(tmp_path / "nope.json"), str(recipe)])
    assert bad.exit_code == 2 and "profile file not found" in bad.output


def test_profile_with_gradient_checkpointing_and_a_dense_backend(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from sparsebalance_ft.profiling.profiler import DenseDriver

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    enable_checkpointing(model)
    settings = ProfileSettings(lengths=[64, 128], token_points=2, warmup=0, repeats=1, threads=1, clock="cpu",
                               calibration_batches=0)
    profile = profile_model(model, DenseDriver(), max_len=128, token_cap=128, settings=settings, progress=False)
    assert profile.densities.tolist() == [1.0] and profile.attention_scope == "micro_batch"
    assert profile.dense_attn is None and np.all(profile.attn > 0)


def test_progress_bar_advances_once_per_measurement(capsys):
    from sparsebalance_ft.profiling.profiler import Cell, _progress_bar, measure_cells

    cells = [Cell(("a",), lambda: None), Cell(("b",), lambda: None)]
    with _progress_bar(6, True, "profile") as bar:
        measure_cells(cells, torch.device("cpu"), warmup=1, repeats=2, progress=bar)
    assert [len(c.samples) for c in cells] == [2, 2]
    assert "6/6" in capsys.readouterr().err  # warm-up and timed passes over both cells


def test_no_garbage_collection_inside_a_timed_run():
    import gc

    from sparsebalance_ft.profiling.profiler import Cell, measure_cells

    seen = []
    cells = [Cell((name,), lambda: seen.append(gc.isenabled())) for name in "ab"]
    measure_cells(cells, torch.device("cpu"), warmup=1, repeats=2)
    assert seen == [False] * 6 and gc.isenabled()  # and the collector is back on afterwards
