"""Per-document density of the sparse attention on a real model: how much it varies, and with what.

The balancer predicts each rank's time from document lengths and an expected density; this measures the
density that real documents actually get at one budget. Each document runs alone through the model (its own
forward, the LM head skipped) with the `sparsebalance` attention; its density is the attention report's
per-document density: kept key blocks over causal blocks, summed over layers and key-value heads, which is
the share of its causal blocks averaged over layers.

The result is the `densities` section of real.json, a contract read by the simulator:
{"budget", "block_size", "model", "documents": [{"kind", "source", "tokens", "density", "compression_ratio",
"token_diversity"}], "summary": {...}}.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from ..attention.budget import SparseAttentionController
from ..attention.config import SparsityConfig
from .real_documents import KINDS, Document


def document_density(model, controller: SparseAttentionController, doc: Document) -> float:
    ids = torch.as_tensor(doc.ids)[None]
    controller.pop_report()
    with torch.no_grad():
        model.model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None])
    report = controller.pop_report()
    (length, density), = report.doc_densities
    assert length == doc.tokens
    return float(density)


def measure_densities(model, documents: list[Document], config: SparsityConfig, time_limit: float | None = None,
                      progress: Callable[[int, Document, float], None] | None = None) -> list[dict]:
    """One row per document, in order, until the documents or the time limit (seconds) run out."""
    controller = SparseAttentionController.attach(model, config)
    controller.set_budget(config.budget)
    rows, start = [], time.perf_counter()
    try:
        for i, doc in enumerate(documents):
            if time_limit is not None and time.perf_counter() - start > time_limit:
                break
            density = document_density(model, controller, doc)
            rows.append({"kind": doc.kind, "source": doc.source, "tokens": doc.tokens, "density": density,
                         "compression_ratio": doc.compression_ratio, "token_diversity": doc.token_diversity})
            if progress is not None:
                progress(i, doc, density)
    finally:
        model.set_attn_implementation("sdpa")  # the next user of the model gets it dense again
    return rows


def _stats(values: np.ndarray) -> dict:
    if len(values) == 0:
        return {"n": 0}
    q10, q50, q90 = np.quantile(values, [0.1, 0.5, 0.9])
    return {"n": int(len(values)), "mean": float(values.mean()), "std": float(values.std()),
            "min": float(values.min()), "p10": float(q10), "median": float(q50), "p90": float(q90),
            "max": float(values.max())}


def _fit_log_length(tokens: np.ndarray, density: np.ndarray) -> dict | None:
    """density ~ a + b * log2(tokens), least squares, with the residual spread the fit leaves."""
    if len(tokens) < 3 or np.ptp(tokens) == 0:
        return None
    x = np.log2(tokens)
    b, a = np.polyfit(x, density, 1)
    residual = density - (a + b * x)
    return {"intercept": float(a), "slope_per_doubling": float(b), "residual_std": float(residual.std())}


def _correlation(x: np.ndarray, y: np.ndarray) -> float | None:
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def summarize(rows: list[dict], kinds: tuple[str, ...] = KINDS) -> dict:
    """Mean and spread overall and per kind (of `kinds`); dependence on length (log-linear fit and length bins) and on
    content (correlation with compression ratio and token diversity, overall and after the length fit)."""
    tokens = np.array([r["tokens"] for r in rows], dtype=float)
    density = np.array([r["density"] for r in rows])
    fit = _fit_log_length(tokens, density)
    residual = density - (fit["intercept"] + fit["slope_per_doubling"] * np.log2(tokens)) if fit else density
    ratio = np.array([r["compression_ratio"] for r in rows])
    diversity = np.array([r["token_diversity"] for r in rows])
    edges = [0, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 1 << 30]
    bins = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (tokens >= lo) & (tokens < hi)
        if inside.any():
            bins.append({"tokens_from": lo, "tokens_below": hi, **_stats(density[inside])})
    by_kind = {}
    for kind in kinds:
        mine = np.array([r["kind"] == kind for r in rows], dtype=bool)
        by_kind[kind] = {**_stats(density[mine]), "fit_log_length": _fit_log_length(tokens[mine], density[mine]),
                         "mean_length_residual": float(residual[mine].mean()) if mine.any() else None}
    return {
        "all": _stats(density),
        "by_kind": by_kind,
        "by_length": bins,
        "fit_log_length": fit,
        "correlation": {
            "compression_ratio": _correlation(ratio, density),
            "token_diversity": _correlation(diversity, density),
            "compression_ratio_after_length": _correlation(ratio, residual),
            "token_diversity_after_length": _correlation(diversity, residual),
        },
    }


def densities_section(model, model_name: str, documents: list[Document], config: SparsityConfig,
                      time_limit: float | None = None, progress=None, kinds: tuple[str, ...] = KINDS) -> dict:
    rows = measure_densities(model, documents, config, time_limit, progress)
    return {"budget": float(config.budget), "block_size": int(config.block_size), "model": model_name,
            "selection": config.selection, "documents": rows, "summary": summarize(rows, kinds),
            "planned_documents": len(documents)}
