"""Held-out loss of a base model and its fine-tuned adapter, under dense and sparse attention.

What a user wants to see after a fine-tune: did the loss on documents the run never saw go down, and what
does the sparse attention cost at the same weights? `heldout_losses` answers both with four numbers
(base/tuned x dense/sparse), each the token-weighted mean cross-entropy over the same documents, the
sparse ones at the recipe's default budget with the recipe's selection settings.

Held-out documents come from the recipe's data folder through a different glob than the training's
(`heldout_documents`), so they are real text of the same kind that training never drew.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from ..recipe import Recipe


def heldout_documents(recipe: Recipe, tokenizer, glob: str, count: int, tokens: int) -> list[np.ndarray]:
    """The first `count` documents of `glob` under data.path, truncated to `tokens` (half of that at least)."""
    from ..data.corpus import load_corpus

    if glob == recipe.data.text_glob:
        raise UserError(f"--heldout-glob: must differ from data.text_glob ({glob!r}) or training saw the documents")
    cfg = recipe.data.model_copy(update={"text_glob": glob, "max_seq_len": tokens, "too_long": "truncate",
                                         "min_seq_len": max(2, tokens // 2), "max_documents": None})
    corpus = load_corpus(cfg, tokenizer, progress=False)
    docs = [np.asarray(corpus[i]) for i in range(len(corpus))][:count]
    if not docs:
        raise UserError(f"--heldout-glob: no document of at least {tokens // 2} tokens matches {glob!r} in {recipe.data.path}")
    return docs


def mean_token_loss(model, docs: list[np.ndarray]) -> float:
    """Cross-entropy per predicted token, pooled over the documents (each run alone)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for doc in docs:
            ids = torch.tensor(doc, dtype=torch.long)[None]
            out = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], labels=ids)
            total += float(out.loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return total / count


def _dense_and_sparse(model, docs: list[np.ndarray], recipe: Recipe) -> dict:
    from ..attention.budget import SparseAttentionController

    model.set_attn_implementation("sdpa")
    dense = mean_token_loss(model, docs)
    controller = SparseAttentionController.attach(model, recipe.sparsity)
    controller.set_budget(recipe.sparsity.budget)
    sparse = mean_token_loss(model, docs)
    report = controller.pop_report()
    model.set_attn_implementation("sdpa")
    return {"dense": dense, "sparse": sparse, "sparse_vs_dense": sparse / dense - 1.0,
            "density": report.mean_density, "sampled_recall": report.mean_recall}


def heldout_losses(recipe: Recipe, adapter_dir: Path | None, docs: list[np.ndarray]) -> dict:
    """{"base": {...}, "tuned": {...}} with dense and sparse loss, the sparse/dense gap, density and recall."""
    from ..train.model import apply_lora, load_base_model

    plain = recipe.model_copy(update={"model": recipe.model.model_copy(update={"attn_implementation": "sdpa",
                                                                               "dtype": "float32"})})
    model = load_base_model(plain).eval()
    result = {"budget": recipe.sparsity.budget, "documents": len(docs), "tokens": int(sum(len(d) for d in docs)),
              "base": _dense_and_sparse(model, docs, recipe)}
    if adapter_dir is not None:
        tuned = apply_lora(model, recipe, adapter_dir, trainable=False).eval()
        result["tuned"] = _dense_and_sparse(tuned, docs, recipe)
    return result
