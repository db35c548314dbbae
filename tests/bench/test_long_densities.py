"""Densities past the native length: the scaled copy reads as linear position interpolation, and the
measurement writes the simulator's calibration contract, continued (not repeated) by a second run."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from sparsebalance_ft.attention.config import SparsityConfig
from sparsebalance_ft.bench.long_densities import load_scaled_model, long_densities
from sparsebalance_ft.data.long_documents import default_stdlib
from sparsebalance_ft.errors import UserError
from sparsebalance_ft.sim.calibration import calibrate


def test_scaled_model_is_linear_interpolation_of_the_checkpoint(tiny_model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    base_config = AutoConfig.from_pretrained(tiny_model_dir)
    native = base_config.max_position_embeddings
    model, _ = load_scaled_model(tiny_model_dir, 4.0, 4 * native)
    assert model.config.max_position_embeddings == 4 * native
    theta = base_config.rope_parameters["rope_theta"]
    dim = base_config.hidden_size // base_config.num_attention_heads
    expected = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)) / 4.0  # positions / factor
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, expected)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for (name, p), (_, q) in zip(model.state_dict().items(), base.state_dict().items()):
        assert torch.equal(p, q), name  # the same weights
    with pytest.raises(UserError, match="above 1"):
        load_scaled_model(tiny_model_dir, 1.0, native)
    with pytest.raises(UserError, match="rope-factor to 8"):
        long_densities(tiny_model_dir, [8 * native], [1], 4.0)


def test_measurement_feeds_the_calibration_and_continues(tiny_model_dir, tmp_path):
    stdlib = tmp_path / "stdlib"
    for package in ("json", "tomllib", "wsgiref"):
        shutil.copytree(default_stdlib() / package, stdlib / package, ignore=shutil.ignore_patterns("__pycache__"))
    config = SparsityConfig(budget=0.3, k_min=1, k_max=2, local_blocks=1, sink_blocks=0)
    lines: list[str] = []
    first = long_densities(tiny_model_dir, [512, 1024], [2, 1], 2.0, config,
                           say=lines.append, stdlib=stdlib)
    rows = first["densities"]["documents"]
    assert {r["tokens"] for r in rows} == {512, 1024} and all(0 < r["density"] < 1 for r in rows)
    assert {r["kind"] for r in rows} == {"code", "documentation"} and all(r["rope_factor"] == 2.0 for r in rows)
    assert first["densities"]["by_length"]["512"]["all"]["n"] == sum(r["tokens"] == 512 for r in rows)
    calibration = calibrate(json.loads(json.dumps(first["densities"])))
    assert calibration.documents == len(rows) and calibration.length_exponent > 0  # longer: sparser at one k_max
    again = long_densities(tiny_model_dir, [512, 1024], [2, 1], 2.0, config,
                           say=lines.append, stdlib=stdlib, previous=first)
    assert again["densities"]["documents"] == rows  # nothing measured twice
    with pytest.raises(UserError, match="--append"):
        long_densities(tiny_model_dir, [512], [1], 4.0, config, stdlib=stdlib, previous=first)
