"""The adapter a run saves loads back to the same model, and `sbft export` merges it exactly."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from sparsebalance_ft.recipe import load_recipe
from sparsebalance_ft.train.export import export_merged
from sparsebalance_ft.train.loop import train
from sparsebalance_ft.train.model import load_model


def test_adapter_save_load_and_merge(write_recipe, tmp_path):
    recipe = load_recipe(write_recipe(training={"max_steps": 3}, lora={"modules_to_save": ["norm"]}))
    summary = train(recipe)
    ids = torch.arange(5, 69).unsqueeze(0)

    trained, _ = load_model(recipe, adapter_dir=summary["adapter_dir"], trainable=False)
    base, _ = load_model(recipe.model_copy(update={"lora": recipe.lora.model_copy(update={"enabled": False})}), trainable=False)
    with torch.no_grad():
        with_adapter = trained(input_ids=ids).logits
        without = base(input_ids=ids).logits
    assert not torch.allclose(with_adapter, without, atol=1e-4), "the saved adapter changed nothing"

    merged_dir = export_merged(recipe, summary["adapter_dir"], tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, with_adapter, rtol=1e-4, atol=1e-4)
