"""Mixed precision on CPU: bf16 autocast really runs (the loss moves off float32's), fp16 is refused in one line."""
from __future__ import annotations

import math

import pytest
import torch

from sparsebalance_ft.recipe import load_recipe
from sparsebalance_ft.train.loop import train
from sparsebalance_ft.train.metrics import read_metrics
from sparsebalance_ft.train.model import ModelLoadError, resolve_mixed_precision


@pytest.fixture(autouse=True)
def _default_precision_afterwards():
    """accelerate keeps one precision per process: leave the next test module the default one."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _first_loss(write_recipe, tmp_path, precision: str, attention: str) -> float:
    recipe = load_recipe(
        write_recipe(
            model={"attn_implementation": attention},
            sparsity={"k_max": 4, "k_min": 2, "block_size": 16, "recall_samples": 1},
            training={"max_steps": 1, "mixed_precision": precision, "output_dir": str(tmp_path / precision)},
        )
    )
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # accelerate keeps one precision per process
    train(recipe)
    return read_metrics(tmp_path / precision / "metrics.jsonl")[0]["loss"]


@pytest.mark.parametrize("attention", ["sdpa", pytest.param("sparsebalance", marks=pytest.mark.slow)])
def test_bf16_autocast_trains_on_cpu(write_recipe, tmp_path, attention):
    full = _first_loss(write_recipe, tmp_path, "no", attention)
    half = _first_loss(write_recipe, tmp_path, "bf16", attention)
    assert math.isfinite(half)
    assert half != full and half == pytest.approx(full, rel=0.02)  # bf16 rounding, not a different model


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 autocast is a GPU feature")
def test_fp16_on_cpu_is_refused():
    with pytest.raises(ModelLoadError, match="training.mixed_precision: fp16 needs a CUDA GPU; on CPU use bf16 or no"):
        resolve_mixed_precision("fp16")
