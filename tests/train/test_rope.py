"""`model.rope_scaling` / `model.rope_theta`: the built model's rotary frequencies are what transformers' own rope
initialisation computes for the setting, the factor covers data.max_seq_len, and bad settings are one line."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from sparsebalance_ft.recipe import RecipeError, recipe_from_dict
from sparsebalance_ft.train.model import ModelLoadError, check_model_dir, load_base_model
from sparsebalance_ft.train.rope import RopeError, check_rope_record, recipe_rope, write_rope_record

NATIVE = 256


@pytest.fixture
def short_model(tiny_model_dir, tmp_path):
    """The tiny model with 256 native positions, so that 512 tokens need scaling."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": NATIVE}))
    return model


def _recipe(model, max_seq_len=512, **model_keys):
    return recipe_from_dict({"model": {"path": str(model), "dtype": "float32", **model_keys},
                             "data": {"path": "unused", "max_seq_len": max_seq_len}})


def _reference(model_dir, rope_parameters: dict, positions: int):
    """inv_freq and attention scaling as transformers computes them from a config written by hand."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(model_dir)
    config.rope_parameters = rope_parameters
    config.max_position_embeddings = positions
    return ROPE_INIT_FUNCTIONS[rope_parameters["rope_type"]](config, torch.device("cpu"))


def _unscaled(theta: float) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, 32, 2, dtype=torch.float) / 32)  # the tiny model's head_dim is 32


CASES = [
    ("linear", {}, {"rope_type": "linear", "factor": 2.0}, 512),
    ("dynamic", {}, {"rope_type": "dynamic", "factor": 2.0}, NATIVE),
    ("yarn", {"beta_fast": 16, "attention_factor": 1.2},
     {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": NATIVE, "beta_fast": 16.0,
      "attention_factor": 1.2}, 512),
    ("llama3", {"high_freq_factor": 8.0},
     {"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": NATIVE, "low_freq_factor": 1.0,
      "high_freq_factor": 8.0}, 512),
]


@pytest.mark.parametrize("kind,extra,expected,positions", CASES, ids=[c[0] for c in CASES])
def test_the_built_model_rotates_as_transformers_computes_the_setting(short_model, kind, extra, expected, positions):
    recipe = _recipe(short_model, rope_scaling={"type": kind, **extra}, rope_theta=20000.0)
    rotary = load_base_model(recipe).model.rotary_emb
    inv_freq, scaling = _reference(short_model, {**expected, "rope_theta": 20000.0}, positions)
    torch.testing.assert_close(rotary.inv_freq, inv_freq, rtol=0, atol=0)
    assert rotary.attention_scaling == pytest.approx(scaling)
    assert rotary.config.max_position_embeddings == positions
    if kind != "dynamic":  # changed frequencies: the setting is not a no-op
        assert not torch.allclose(inv_freq, _unscaled(20000.0))


def test_theta_alone_changes_the_base_and_extends_to_the_training_length(short_model):
    model = load_base_model(_recipe(short_model, 1024, rope_theta=8e6))
    assert model.config.rope_parameters == {"rope_type": "default", "rope_theta": 8e6}
    assert model.config.max_position_embeddings == 1024
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, _unscaled(8e6))


def test_auto_is_the_smallest_factor_covering_max_seq_len(short_model):
    setting = recipe_rope(_recipe(short_model, 640, rope_scaling={"type": "yarn"}))
    assert setting.parameters["factor"] == 2.5 and setting.max_position_embeddings == 640
    assert "factor auto: 640 / 256 native positions" in setting.describe()
    within = recipe_rope(_recipe(short_model, 128, rope_scaling={"type": "yarn"}))
    assert within.parameters["rope_type"] == "default" and "no scaling" in within.describe()


def test_an_exported_scaled_model_resolves_to_the_same_setting(short_model, tmp_path):
    recipe = _recipe(short_model, rope_scaling={"type": "yarn"})
    load_base_model(recipe).save_pretrained(tmp_path / "export")
    again = recipe_rope(_recipe(tmp_path / "export", rope_scaling={"type": "yarn"}))
    assert again.record() == recipe_rope(recipe).record()
    with pytest.raises(RopeError, match=r"already rope-scaled \(yarn x2, theta 500000\); the recipe asks for linear x2"):
        recipe_rope(_recipe(tmp_path / "export", rope_scaling={"type": "linear"}))


def test_a_factor_too_small_says_which_would_cover(short_model):
    with pytest.raises(RopeError, match=r"factor: 1.5 covers 384 positions \(256 native x 1.5\), below data.max_seq_len "
                                        r"\(600\); use factor 2.35 or auto"):
        check_model_dir(_recipe(short_model, 600, rope_scaling={"type": "linear", "factor": 1.5}))


def test_positions_beyond_native_without_scaling_name_the_key(short_model):
    with pytest.raises(ModelLoadError, match="extend the model with model.rope_scaling"):
        check_model_dir(_recipe(short_model))


def test_a_model_without_rotary_positions(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(RopeError, match=r"model.rope_scaling: .* has no rotary position embeddings \(model_type gpt2\)"):
        check_model_dir(_recipe(tmp_path / "gpt2", 512, rope_scaling={"type": "linear"}))


@pytest.mark.parametrize("scaling,theta,message", [
    ({"type": "ntk"}, None, "unknown rope scaling type 'ntk'; choose one of linear, dynamic, yarn, llama3"),
    ({"type": "longrope"}, None, "longrope needs per-dimension factor lists"),
    ({"type": "linear", "factor": 1.0}, None, "factor must be above 1"),
    ({"type": "linear", "beta_fast": 8}, None, "beta_fast is a yarn key; type is linear"),
    ({"type": "yarn", "low_freq_factor": 2}, None, "low_freq_factor is a llama3 key; type is yarn"),
    (None, 0, "model.rope_theta: Input should be greater than 0"),
])
def test_bad_settings_are_one_line(short_model, scaling, theta, message):
    keys = {"rope_scaling": scaling} if scaling else {}
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace(")", r"\)")) as raised:
        _recipe(short_model, **keys, **({"rope_theta": theta} if theta is not None else {}))
    assert "\n" not in str(raised.value)


def test_a_record_refuses_another_setting_naming_both(short_model, tmp_path):
    yarn = recipe_rope(_recipe(short_model, rope_scaling={"type": "yarn"}))
    write_rope_record(tmp_path, yarn)
    check_rope_record(tmp_path, yarn, "--resume")
    linear = recipe_rope(_recipe(short_model, rope_scaling={"type": "linear"}))
    with pytest.raises(RopeError, match=r"--resume: .* was trained with rope yarn x2, theta 500000, 512 positions, "
                                        r"the recipe asks for rope linear x2, theta 500000, 512 positions"):
        check_rope_record(tmp_path, linear, "--resume")
    with pytest.raises(RopeError, match="the recipe asks for the checkpoint's own positions"):
        check_rope_record(tmp_path, None, "adapter")
