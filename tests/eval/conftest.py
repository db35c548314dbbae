"""Fixtures of the evaluation tests: a recipe over the shared tiny model, a saved LoRA adapter, the CLI."""
from __future__ import annotations

from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner


@pytest.fixture(scope="session")
def eval_recipe_path(tmp_path_factory, tiny_model_dir, jsonl_corpus) -> Path:
    root = tmp_path_factory.mktemp("eval_recipe")
    recipe = {
        "model": {"path": str(tiny_model_dir), "dtype": "float32"},
        "lora": {"r": 4, "alpha": 8},
        "data": {"path": str(jsonl_corpus), "max_seq_len": 512},
        "training": {"output_dir": str(root / "run"), "tensorboard": False},
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="session")
def eval_recipe(eval_recipe_path):
    from sparsebalance_ft.recipe import load_recipe

    return load_recipe(eval_recipe_path)


@pytest.fixture(scope="session")
def adapter_dir(tmp_path_factory, eval_recipe) -> Path:
    """A LoRA adapter saved the way training saves it (random B made non-zero so that it matters)."""
    import torch

    from sparsebalance_ft.train.model import load_model

    model, _ = load_model(eval_recipe)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    out = tmp_path_factory.mktemp("adapter") / "adapter"
    model.save_pretrained(out)
    return out


@pytest.fixture
def cli():
    from sbft_cli import eval as eval_cli
    from sbft_cli import synth

    app = typer.Typer(pretty_exceptions_enable=False)
    eval_cli.register(app)
    synth.register(app)
    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(app, [str(a) for a in args])

    return invoke
