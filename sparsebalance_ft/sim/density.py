"""Per-document attention density for simulation: what each document truly reaches at a budget,
and what the run can predict about it.

Truth: `density_i(b) = clip(s_i * base(L_i, b), floor, 1)` (1.0 at budget 1.0), where `s_i` is a
per-document sensitivity, lognormal with mean 1 and log-sigma `sigma`, and `base(L, b)` is either

- a curve: `mean` at the default budget, linear in budget down to 0 at budget 0 and up to 1.0
  at budget 1.0, times `(L / ref_length) ** -length_exponent` (longer documents sparser), or
- a saved `DensityStats` (its `expected(L, b)`), e.g. the statistics of a real run.

Prediction (what batching and the tuner may use):
- `stats`: a `DensityStats` whose prior is `base` and which has seen no per-document data, so it
  predicts `base(L, b)`, a function of length and budget only (what a run knows in epoch 1);
- `oracle`: each document's true density (what a run that remembered every document would know).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import numpy as np

from ..cost.stats import DensityStats
from .lengths import SimInputError

Knowledge = Literal["stats", "oracle"]


@dataclass
class DensityModel:
    lengths: np.ndarray
    default_budget: float = 0.5
    mean: float = 0.3
    sigma: float = 0.5
    length_exponent: float = 0.0
    ref_length: float = 8192.0
    floor: float = 0.01
    seed: int = 0
    stats: DensityStats | None = None  # when set, base(L, b) = stats.expected(L, b)

    def __post_init__(self) -> None:
        self.lengths = np.asarray(self.lengths, dtype=np.int64)
        if not 0.0 < self.default_budget < 1.0:
            raise SimInputError(f"default budget must be in (0, 1), got {self.default_budget}")
        if not 0.0 < self.mean <= 1.0:
            raise SimInputError(f"--density-mean must be in (0, 1], got {self.mean}")
        if self.sigma < 0:
            raise SimInputError(f"--density-sigma must be >= 0, got {self.sigma}")
        rng = np.random.default_rng([self.seed, 11])
        self.sensitivity = rng.lognormal(-0.5 * self.sigma**2, self.sigma, self.lengths.shape[0])
        if self.stats is None:
            self._predictor = DensityStats(prior=self._curve)
        else:
            self._predictor = self.stats

    # the noiseless curve --------------------------------------------------------------
    def _curve(self, lengths: np.ndarray, budget: float) -> np.ndarray:
        L = np.asarray(lengths, dtype=np.float64)
        b, b0, m = float(budget), self.default_budget, self.mean
        level = m * b / b0 if b <= b0 else m + (1.0 - m) * (b - b0) / (1.0 - b0)
        scale = (np.maximum(L, 1.0) / self.ref_length) ** (-self.length_exponent)
        return np.clip(level * scale, self.floor, 1.0)

    def base(self, lengths: np.ndarray, budget: float | np.ndarray) -> np.ndarray:
        return np.asarray(self._predictor.expected(lengths, budget), dtype=np.float64)

    # truth and prediction per document -----------------------------------------------------
    def true(self, docs: np.ndarray, budget: float | np.ndarray) -> np.ndarray:
        docs = np.asarray(docs, dtype=np.int64)
        b = np.broadcast_to(np.asarray(budget, dtype=np.float64), docs.shape)
        d = np.clip(self.sensitivity[docs] * self.base(self.lengths[docs], b), self.floor, 1.0)
        return np.where(b >= 1.0, 1.0, d)

    def predicted(self, docs: np.ndarray, budget: float | np.ndarray, knowledge: Knowledge) -> np.ndarray:
        if knowledge == "oracle":
            return self.true(docs, budget)
        docs = np.asarray(docs, dtype=np.int64)
        return self.base(self.lengths[docs], budget)

    def predictor(self, knowledge: Knowledge) -> Callable[[np.ndarray, float | np.ndarray], np.ndarray]:
        return lambda docs, budget: self.predicted(docs, budget, knowledge)


def load_density_stats(path: str | Path) -> DensityStats:
    """A `DensityStats` from its `state_dict()` saved as JSON (e.g. from a training run)."""
    path = Path(path)
    if not path.is_file():
        raise SimInputError(f"{path}: density statistics file not found")
    try:
        state = json.loads(path.read_text())
        if isinstance(state, dict) and "density_stats" in state:
            state = state["density_stats"]
        stats = DensityStats()
        stats.load_state_dict(state)
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise SimInputError(f"{path}: not a saved DensityStats state ({error})") from None
    return stats
