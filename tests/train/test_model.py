"""The model a recipe loads: gradient checkpointing on without a deprecation warning, and LoRA's gradients
through the recomputed layers equal to those without checkpointing."""
from __future__ import annotations

import warnings

import torch

from sparsebalance_ft.recipe import load_recipe
from sparsebalance_ft.train.model import load_model


def _lora_grads(recipe) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        # transformers' "`gradient_checkpointing_enable` is deprecated" (peft's own deprecated reads are not ours)
        warnings.filterwarnings("error", message=".*gradient_checkpointing_enable.*", category=FutureWarning)
        model, _ = load_model(recipe)
    model.train()
    ids = torch.arange(5, 133).unsqueeze(0)
    model(input_ids=ids, labels=ids).loss.backward()
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}, model


def test_checkpointed_lora_gradients_equal_plain_ones(write_recipe):
    checkpointed, model = _lora_grads(load_recipe(write_recipe(model={"gradient_checkpointing": True})))
    plain, _ = _lora_grads(load_recipe(write_recipe(model={"gradient_checkpointing": False})))
    assert all(layer.gradient_checkpointing for layer in model.base_model.model.model.layers)  # really recomputed
    assert checkpointed.keys() == plain.keys() and plain
    for name, grad in plain.items():
        assert checkpointed[name] is not None, name
        if "lora_B" in name:  # lora_A's gradient is zero at the start: B is initialised to zero
            assert grad.abs().sum() > 0, name
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-6)
