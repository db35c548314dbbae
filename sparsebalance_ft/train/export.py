"""Merge a trained LoRA adapter into its base model and save a plain Hugging Face checkpoint."""
from __future__ import annotations

from pathlib import Path

from ..recipe import Recipe
from .model import apply_lora, load_base_model, load_tokenizer


def export_merged(recipe: Recipe, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    model = apply_lora(load_base_model(recipe), recipe, adapter_dir, trainable=False)
    merged = model.merge_and_unload()
    out = Path(out_dir)
    merged.save_pretrained(out)
    load_tokenizer(recipe).save_pretrained(out)
    return out
