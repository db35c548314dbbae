"""The simulator's density model read from densities measured on a real pretrained model.

Input: the real-model benchmark's JSON (`bench_results/real/real.json`), whose `densities` entry is
`{"budget", "block_size", "model", "documents": [{"kind", "source", "tokens", "density",
"compression_ratio", "token_diversity"}], "summary"}`: one row per document run at `budget`.

Fitted, on log density (the simulator's truth is `s_i * mean * (L / ref) ** -exponent`), over the
documents of at least `min_tokens` tokens (2,048 = 32 blocks of 64) that did not keep every block (those
are censored at 1.0). Shorter documents are left out because there the anchors and `k_min` decide much of
what is kept (at 1K tokens they cover 7 of a query block's at most 16 key blocks): on SmolLM2 the law bends
there, and fitted through them it predicts 8K-token documents denser than they measure. When fewer than
`MIN_DOCUMENTS` documents are that long (a `--quick` real-model run stops at 2K tokens), every uncensored
document is used and `min_tokens` records the shortest one fitted:
- `length_exponent`: minus the least-squares slope of log density on log length;
- `mean`: the mean density at the reference length, with the lognormal spread's mean-one correction;
- `sigma`: the standard deviation of the residual (content: what length does not explain);
- `predicted_r2`: the share of that residual variance that `cost.documents`' own feature predictor
  (compression ratio, token diversity, and the document's kind as its source label; the file path would
  be a label of one document) explains on documents it did not see (5-fold
  cross-validation; ridge 0.05, lighter than training's 1.0, which thousands of observations
  outweigh while a calibration set holds tens; 0 when it explains nothing or rows are too few).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..cost.documents import feature_matrix
from .lengths import SimInputError

DENSE = 0.999  # at or above: every causal block kept
MIN_DOCUMENTS = 10  # fewest long documents the fit uses before it falls back to every uncensored one


@dataclass(frozen=True)
class Calibration:
    mean: float
    sigma: float
    length_exponent: float
    predicted_r2: float
    ref_length: float
    min_tokens: int
    budget: float
    documents: int
    model: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cross_validated_r2(X: np.ndarray, y: np.ndarray, folds: int = 5, ridge: float = 0.05) -> float:
    n = y.size
    if n < 2 * folds:
        return 0.0
    pred = np.empty(n)
    fold = np.arange(n) % folds
    for f in range(folds):
        train, test = fold != f, fold == f
        reg = ridge * np.eye(X.shape[1])
        reg[0, 0] = 1e-6
        w = np.linalg.solve(X[train].T @ X[train] + reg, X[train].T @ y[train])
        pred[test] = X[test] @ w
    ss = float(((y - y.mean()) ** 2).sum())
    return float(max(0.0, 1.0 - ((y - pred) ** 2).sum() / ss)) if ss > 0 else 0.0


def calibrate(densities: dict[str, Any], ref_length: float = 8192.0, min_tokens: int = 2048) -> Calibration:
    """Fit the density model to a `real["densities"]` entry (see the module docstring)."""
    rows = [d for d in densities.get("documents", []) if d.get("density") and d.get("tokens")]
    rows = [d for d in rows if 0.0 < float(d["density"]) <= 1.0 and int(d["tokens"]) > 0]
    # a document that kept every block (short ones: anchors cover it) says only "density >= 1": censored,
    # it would flatten the length slope, so it is left out of the fit
    rows = [d for d in rows if float(d["density"]) < DENSE]
    long_rows = [d for d in rows if int(d["tokens"]) >= min_tokens]
    rows = long_rows if len(long_rows) >= MIN_DOCUMENTS else rows
    if len(rows) < 3:
        raise SimInputError("density calibration: fewer than 3 usable documents (need tokens and a density in (0, 1))")
    L = np.array([float(d["tokens"]) for d in rows])
    logd = np.log(np.array([float(d["density"]) for d in rows]))
    x = np.log(L / ref_length)
    if np.ptp(x) > 0:
        slope, intercept = np.polyfit(x, logd, 1)
    else:
        slope, intercept = 0.0, float(logd.mean())
    resid = logd - (intercept + slope * x)
    sigma = float(resid.std())
    mean = float(min(1.0, np.exp(intercept + 0.5 * sigma**2)))
    X = feature_matrix(L, [float(d.get("compression_ratio") or 0.0) for d in rows],
                       [float(d.get("token_diversity") or 0.0) for d in rows],
                       [d.get("kind") or "" for d in rows])  # the kind plays a dataset's source label
    r2 = _cross_validated_r2(X, resid)
    return Calibration(mean=mean, sigma=sigma, length_exponent=float(-slope), predicted_r2=r2, ref_length=ref_length,
                       min_tokens=int(L.min()), budget=float(densities.get("budget", float("nan"))), documents=len(rows),
                       model=str(densities.get("model", "?")))


def load_calibration(path: str | Path, ref_length: float = 8192.0) -> Calibration:
    """`calibrate` on a real-model JSON file (the whole file, or just its `densities` entry)."""
    path = Path(path)
    if not path.is_file():
        raise SimInputError(f"{path}: density calibration file not found")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise SimInputError(f"{path}: not JSON ({error})") from None
    entry = data.get("densities", data) if isinstance(data, dict) else None
    if not isinstance(entry, dict) or not isinstance(entry.get("documents"), list):
        raise SimInputError(f"{path}: no densities.documents list (the real-model benchmark's density contract)")
    return calibrate(entry, ref_length)
