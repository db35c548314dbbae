"""The model folder is checked before any work: config, weights, and positions against data.max_seq_len."""
from __future__ import annotations

import json
import shutil

import pytest

from sparsebalance_ft.recipe import recipe_from_dict
from sparsebalance_ft.train.model import ModelLoadError, check_model_dir


def _recipe(model, max_seq_len):
    return recipe_from_dict({"model": {"path": str(model)}, "data": {"path": "unused", "max_seq_len": max_seq_len}})


def _with_config(tiny_model_dir, tmp_path, **config):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    values = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**values, **config}))
    return model


def test_positions_beyond_the_model_are_refused_without_rope_scaling(tiny_model_dir, tmp_path):
    model = _with_config(tiny_model_dir, tmp_path, max_position_embeddings=256)
    check_model_dir(_recipe(model, 256))
    with pytest.raises(ModelLoadError, match=r"data.max_seq_len \(512\) is above model.path's max_position_embeddings \(256\)"):
        check_model_dir(_recipe(model, 512))


def test_rope_scaling_turns_the_refusal_into_a_warning(tiny_model_dir, tmp_path):
    rope = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    model = _with_config(tiny_model_dir, tmp_path, max_position_embeddings=256, rope_parameters=rope)
    with pytest.warns(UserWarning, match="relying on its rope scaling \\(linear\\)"):
        check_model_dir(_recipe(model, 512))
