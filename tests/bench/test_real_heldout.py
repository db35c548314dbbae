"""Held-out loss: pooled token cross-entropy, sparse equal to dense when every block is kept."""
import numpy as np
import pytest
import torch
import yaml

from sparsebalance_ft.bench.real_heldout import heldout_documents, heldout_losses, mean_token_loss
from sparsebalance_ft.errors import UserError
from sparsebalance_ft.recipe import load_recipe


def test_mean_token_loss_pools_tokens(tiny_model):
    docs = [np.arange(5, 45), np.arange(100, 120)]
    with torch.no_grad():
        losses = [float(tiny_model(input_ids=torch.as_tensor(d)[None], labels=torch.as_tensor(d)[None]).loss) for d in docs]
    assert mean_token_loss(tiny_model, docs) == pytest.approx((losses[0] * 39 + losses[1] * 19) / 58, rel=1e-5)


@pytest.fixture
def recipe(tmp_path, tiny_model_dir, text_corpus_dir):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_model_dir)},
        "data": {"path": str(text_corpus_dir), "text_glob": "a*", "cache_dir": str(tmp_path / "cache")},
        "sparsity": {"budget": 1.0, "exact_dense_at_full_budget": False},
        "balance": {"tuning": "none"},  # a fixed full budget: nothing to tune
    }))
    return load_recipe(path)


def test_heldout_at_full_budget_sparse_equals_dense(recipe, tiny_tokenizer):
    docs = heldout_documents(recipe, tiny_tokenizer, "*", count=2, tokens=256)
    assert len(docs) == 2 and all(128 <= len(d) <= 256 for d in docs)
    result = heldout_losses(recipe, None, docs)
    assert "tuned" not in result and result["base"]["density"] == pytest.approx(1.0)
    assert result["base"]["sparse"] == pytest.approx(result["base"]["dense"], abs=1e-4)


def test_heldout_glob_must_differ_from_training(recipe, tiny_tokenizer):
    with pytest.raises(UserError, match="must differ from data.text_glob"):
        heldout_documents(recipe, tiny_tokenizer, "a*", count=2, tokens=256)
