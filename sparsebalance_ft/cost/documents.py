"""Per-document density knowledge: remembered when a document comes back, predicted when it is new.

`DensityStats` knows density as a function of length and budget only, so two documents of the same
length look alike to batching even when one keeps twice the blocks of the other. This module keeps
what the run has seen of each document, as a log-ratio to the length model at the budget it ran:
`r_i = log(observed_i / stats.expected(L_i, b_i))`, so it transfers to any other budget.

- Remembered: every observed document's latest ratio, synced across ranks (every rank sees all
  the step's documents), saved in `state_dict()`; used whenever the document comes back (epoch 2+).
- Predicted: a ridge regression of the ratio on cheap features of the document (log length,
  zlib compression ratio of its tokens, token diversity = distinct / total, and an optional
  source/label code hashed to a one-hot), refitted from the synced observations; used for
  documents never seen.
- Reported: for every observed document, the relative error of the prediction made *before* its
  observation (features only), median and p90 per step (`pop_errors`).

The normal equations are sums of synced observations in float64 added in the same order on every
rank, so every rank holds the same model and reaches the same batching decisions.
"""
from __future__ import annotations

import zlib
from typing import Any, Sequence

import numpy as np

_STATE_VERSION = 1
SOURCE_BUCKETS = 8


def document_features(tokens: np.ndarray) -> tuple[float, float]:
    """(compression ratio, token diversity) of one document's token ids: repetitive text compresses
    well and repeats tokens, and tends to concentrate attention (fewer blocks kept)."""
    t = np.asarray(tokens).astype(np.int32, copy=False)
    if t.size == 0:
        return 1.0, 1.0
    raw = t.tobytes()
    ratio = len(zlib.compress(raw, 1)) / max(len(raw), 1)
    return float(ratio), float(np.unique(t).size / t.size)


def feature_matrix(lengths: np.ndarray, compression: np.ndarray | None = None, diversity: np.ndarray | None = None,
                   sources: Sequence[Any] | None = None) -> np.ndarray:
    """[n, F] design matrix: 1, log2 length, compression ratio, diversity, hashed source one-hot."""
    L = np.asarray(lengths, dtype=np.float64)
    n = L.size
    cols = [np.ones(n), np.log2(np.maximum(L, 1.0)) / 10.0,
            np.zeros(n) if compression is None else np.asarray(compression, dtype=np.float64),
            np.zeros(n) if diversity is None else np.asarray(diversity, dtype=np.float64)]
    onehot = np.zeros((n, SOURCE_BUCKETS))
    if sources is not None:
        codes = [zlib.crc32(str(s).encode()) % SOURCE_BUCKETS for s in sources]
        onehot[np.arange(n), codes] = 1.0
    return np.column_stack(cols + [onehot])


class DocumentDensities:
    """Remembered and predicted per-document density, on top of a length model (`DensityStats`)."""

    def __init__(self, lengths: np.ndarray, features: np.ndarray | None = None, ridge: float = 1.0):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.features = feature_matrix(self.lengths) if features is None else np.asarray(features, dtype=np.float64)
        if self.features.shape[0] != self.lengths.size:
            raise ValueError(f"{self.features.shape[0]} feature rows for {self.lengths.size} documents")
        f = self.features.shape[1]
        self.ridge = float(ridge)
        self._xtx = np.zeros((f, f))
        self._xty = np.zeros(f)
        self._weights = np.zeros(f)
        self.log_ratio = np.full(self.lengths.size, np.nan)  # remembered; NaN: never seen
        self._errors: list[float] = []

    @classmethod
    def from_tokens(cls, lengths: np.ndarray, documents, sources: Sequence[Any] | None = None) -> "DocumentDensities":
        """Features from each document's token ids (`documents[i]`)."""
        feats = np.array([document_features(documents[i]) for i in range(len(lengths))]).reshape(-1, 2)
        return cls(lengths, feature_matrix(lengths, feats[:, 0], feats[:, 1], sources))

    # -- queries -----------------------------------------------------------------------------------
    def predicted_log_ratio(self, docs: np.ndarray) -> np.ndarray:
        return self.features[np.asarray(docs, dtype=np.int64)] @ self._weights

    def known_log_ratio(self, docs: np.ndarray) -> np.ndarray:
        """Remembered where seen, predicted elsewhere."""
        docs = np.asarray(docs, dtype=np.int64)
        mem = self.log_ratio[docs]
        return np.where(np.isfinite(mem), mem, self.predicted_log_ratio(docs))

    def expected(self, docs: np.ndarray, budget: float | np.ndarray, stats) -> np.ndarray:
        """Density of each document at `budget`: the length model scaled by what is known of the document."""
        docs = np.asarray(docs, dtype=np.int64)
        b = np.broadcast_to(np.asarray(budget, dtype=np.float64), docs.shape)
        base = np.asarray(stats.expected(self.lengths[docs], b), dtype=np.float64)
        out = np.clip(base * np.exp(self.known_log_ratio(docs)), 0.0, 1.0)
        return np.where(b >= 1.0, 1.0, out)

    def remembered_share(self, docs: np.ndarray) -> float:
        docs = np.asarray(docs, dtype=np.int64)
        return float(np.isfinite(self.log_ratio[docs]).mean()) if docs.size else 0.0

    # -- learning ------------------------------------------------------------------------------------
    def observe(self, docs: np.ndarray, densities: np.ndarray, budgets: np.ndarray, stats) -> None:
        """Synced observations (identical on every rank): remember them, record the prediction error, refit."""
        docs = np.asarray(docs, dtype=np.int64)
        d = np.asarray(densities, dtype=np.float64)
        b = np.broadcast_to(np.asarray(budgets, dtype=np.float64), docs.shape)
        ok = np.isfinite(d) & (d > 0) & (b < 1.0)
        docs, d, b = docs[ok], d[ok], b[ok]
        if docs.size == 0:
            return
        base = np.maximum(np.asarray(stats.expected(self.lengths[docs], b), dtype=np.float64), 1e-6)
        y = np.log(np.clip(d, 1e-6, 1.0) / base)
        guess = np.clip(base * np.exp(self.predicted_log_ratio(docs)), 0.0, 1.0)
        self._errors.extend((np.abs(guess - d) / d).tolist())
        self.log_ratio[docs] = y
        X = self.features[docs]
        self._xtx += X.T @ X
        self._xty += X.T @ y
        reg = self.ridge * np.eye(X.shape[1])
        reg[0, 0] = 1e-6  # the intercept is not shrunk
        self._weights = np.linalg.solve(self._xtx + reg, self._xty)

    def pop_errors(self) -> dict[str, float]:
        """Median and p90 relative error of the feature prediction over the documents observed since the last call."""
        errs, self._errors = self._errors, []
        if not errs:
            return {}
        return {"density_error_median": float(np.median(errs)), "density_error_p90": float(np.percentile(errs, 90)),
                "density_error_docs": float(len(errs))}

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        seen = np.flatnonzero(np.isfinite(self.log_ratio))
        return {"version": _STATE_VERSION, "num_docs": int(self.lengths.size), "seen": seen.tolist(),
                "log_ratio": self.log_ratio[seen].tolist(), "xtx": self._xtx.tolist(), "xty": self._xty.tolist(),
                "weights": self._weights.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION or state.get("num_docs") != int(self.lengths.size):
            raise ValueError("per-document densities were saved for another dataset or version")
        self.log_ratio[:] = np.nan
        self.log_ratio[np.asarray(state["seen"], dtype=np.int64)] = np.asarray(state["log_ratio"], dtype=np.float64)
        self._xtx = np.asarray(state["xtx"], dtype=np.float64)
        self._xty = np.asarray(state["xty"], dtype=np.float64)
        self._weights = np.asarray(state["weights"], dtype=np.float64)


def sync_step_observations(step_docs: np.ndarray, mine: dict[int, tuple[float, float]], group=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every rank's observations of one step, on every rank: (docs, densities, budgets).

    `step_docs` are all the step's documents (every rank knows the plan); `mine` maps this rank's
    documents to (density, budget). One all_reduce (sum) of a [3, n] float64 tensor: each document
    is filled by exactly one rank and zero elsewhere, so the sum is exact and identical everywhere.
    """
    step_docs = np.asarray(step_docs, dtype=np.int64)
    buf = np.zeros((3, step_docs.size))
    pos = {int(d): i for i, d in enumerate(step_docs.tolist())}
    for doc, (density, budget) in mine.items():
        i = pos.get(int(doc))
        if i is not None:
            buf[:, i] = (density, budget, 1.0)
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
        t = torch.from_numpy(buf).to(device)
        dist.all_reduce(t, group=group)
        buf = t.cpu().numpy()
    seen = buf[2] > 0
    return step_docs[seen], buf[0, seen], buf[1, seen]
