"""The recipe's rotary position setting (`model.rope_scaling`, `model.rope_theta`), resolved against a checkpoint.

transformers 5 reads a model's rotary positions from `config.rope_parameters` and computes the frequencies
itself (`modeling_rope_utils.ROPE_INIT_FUNCTIONS`), so extending a model's context is a config edit made
before the model is built: this module computes that edit (`resolve_rope`), applies it (`apply_rope`) and
records it beside every checkpoint and adapter (`write_rope_record`) so that a resume, an evaluation or an
export with a different setting is refused in one line instead of silently reading positions another way.

The native length is the checkpoint's own (its `original_max_position_embeddings` when it is already scaled),
so resolving the same recipe against an exported, already scaled model gives the same setting again.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..recipe import Recipe

ROPE_RECORD = "rope.json"


class RopeError(UserError):
    """A rope setting that cannot apply to the recipe's model or length."""


@dataclass(frozen=True)
class RopeSetting:
    """What the model's config gets: `rope_parameters` and `max_position_embeddings`; `native` positions and
    `note` (how the factor was chosen) are for the start-up line."""

    parameters: dict
    max_position_embeddings: int
    native: int
    note: str = ""

    def record(self) -> dict:
        return {"rope_parameters": self.parameters, "max_position_embeddings": self.max_position_embeddings}

    def describe(self) -> str:
        p = self.parameters
        kind = p.get("rope_type", "default")
        scale = "no scaling" if kind == "default" else f"{kind} x{p['factor']:g}"
        extra = f"; {self.note}" if self.note else ""
        return (f"rope: {scale}, theta {p.get('rope_theta'):g}, {self.max_position_embeddings} positions "
                f"({self.native} native){extra}")


def rope_parameters_of(config) -> dict | None:
    """The config's flat rope parameters; None for a model without rotary positions (or one per layer type)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or "rope_type" not in params:
        return None
    return dict(params)


def native_positions(config) -> int:
    """Positions the checkpoint was pretrained for, before any scaling it already carries."""
    params = rope_parameters_of(config) or {}
    if params.get("original_max_position_embeddings"):
        return int(params["original_max_position_embeddings"])
    if params.get("rope_type") == "linear":  # saved without its original length: positions / factor
        return int(round(config.max_position_embeddings / params["factor"]))
    return int(config.max_position_embeddings)


def _factor(recipe: Recipe, native: int) -> tuple[float, str]:
    """The factor to apply and how it was chosen; refuses one that does not reach data.max_seq_len."""
    scaling = recipe.model.rope_scaling
    length = recipe.data.max_seq_len
    cover = length / native
    if scaling.factor == "auto":
        if cover <= 1.0:
            return 1.0, f"factor auto: data.max_seq_len ({length}) is within the {native} native positions, no scaling"
        return cover, f"factor auto: {length} / {native} native positions"
    if scaling.factor * native < length:
        raise RopeError(
            f"model.rope_scaling.factor: {scaling.factor:g} covers {int(scaling.factor * native)} positions "
            f"({native} native x {scaling.factor:g}), below data.max_seq_len ({length}); "
            f"use factor {_round_up(cover)} or auto")
    return float(scaling.factor), ""


def _round_up(value: float) -> str:
    return f"{math.ceil(value * 100) / 100:g}"


def _scaled_parameters(recipe: Recipe, base: dict, native: int, factor: float) -> dict:
    scaling = recipe.model.rope_scaling
    params = {"rope_type": scaling.type, "rope_theta": base["rope_theta"], "factor": factor}
    if scaling.type in ("yarn", "llama3"):
        params["original_max_position_embeddings"] = native
    if scaling.type == "yarn":
        params.update({key: getattr(scaling, key) for key in ("beta_fast", "beta_slow", "attention_factor")
                       if getattr(scaling, key) is not None})
    if scaling.type == "llama3":
        params.update(zip(("low_freq_factor", "high_freq_factor"), scaling.llama3_band))
    return params


def resolve_rope(recipe: Recipe, config) -> RopeSetting | None:
    """The setting the recipe asks of this checkpoint's config; None when it asks nothing (positions as saved).

    Refuses, in one line: scaling or theta on a model without rotary positions, a factor that does not cover
    data.max_seq_len, and a scaling different from one the checkpoint already carries."""
    model = recipe.model
    if model.rope_scaling is None and model.rope_theta is None:
        return None
    base = rope_parameters_of(config)
    key = "model.rope_scaling" if model.rope_scaling is not None else "model.rope_theta"
    if base is None:
        raise RopeError(f"{key}: {model.path} has no rotary position embeddings "
                        f"(model_type {getattr(config, 'model_type', '?')}); remove {key}")
    native = (model.rope_scaling.original_max_position_embeddings if model.rope_scaling else None) or native_positions(config)
    params = {**base, "rope_theta": float(model.rope_theta or base["rope_theta"])}
    positions, note = int(config.max_position_embeddings), ""
    if model.rope_scaling is not None:
        factor, note = _factor(recipe, native)
        if factor > 1.0:
            params = _scaled_parameters(recipe, params, native, factor)
            # dynamic scaling measures the current length against max_position_embeddings: it must stay native
            positions = native if model.rope_scaling.type == "dynamic" else math.ceil(native * factor)
    elif recipe.data.max_seq_len > positions:  # a raised theta alone (ProLong) extends to the training length
        positions = recipe.data.max_seq_len
    if base.get("rope_type", "default") != "default" and params != base:
        raise RopeError(f"{key}: {model.path} is already rope-scaled ({_phrase(base)}); the recipe asks for "
                        f"{_phrase(params)}; start from the unscaled checkpoint or remove {key}")
    return RopeSetting(params, positions, native, note)


def _phrase(params: dict) -> str:
    kind = params.get("rope_type", "default")
    scale = "" if kind == "default" else f" x{params['factor']:g}"
    return f"{kind}{scale}, theta {params.get('rope_theta'):g}"


def apply_rope(config, setting: RopeSetting | None):
    """Write the setting into a transformers config (in place; returned) before the model is built."""
    if setting is None:
        return config
    config.rope_parameters = dict(setting.parameters)
    config.max_position_embeddings = setting.max_position_embeddings
    config.standardize_rope_params()
    config.validate_rope()
    return config


def load_model_config(path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def recipe_rope(recipe: Recipe) -> RopeSetting | None:
    """`resolve_rope` against the recipe's own checkpoint config."""
    return resolve_rope(recipe, load_model_config(recipe.model.path))


def write_rope_record(folder: str | Path, setting: RopeSetting | None) -> None:
    """Record the setting a checkpoint or adapter was trained with (absent file: the checkpoint's own positions)."""
    if setting is not None:
        (Path(folder) / ROPE_RECORD).write_text(json.dumps(setting.record(), indent=1, sort_keys=True) + "\n")


def check_rope_record(folder: str | Path, setting: RopeSetting | None, what: str) -> None:
    """Refuse, naming both, a recipe whose rope setting differs from the one `folder` was trained with."""
    path = Path(folder) / ROPE_RECORD
    saved = json.loads(path.read_text()) if path.is_file() else None
    wanted = setting.record() if setting is not None else None
    if saved != wanted:
        raise RopeError(f"{what}: {folder} was trained with {_recorded(saved)}, the recipe asks for {_recorded(wanted)}; "
                        "use the same model.rope_scaling and model.rope_theta")


def _recorded(record: dict | None) -> str:
    if record is None:
        return "the checkpoint's own positions (no model.rope_scaling or rope_theta)"
    return f"rope {_phrase(record['rope_parameters'])}, {record['max_position_embeddings']} positions"
