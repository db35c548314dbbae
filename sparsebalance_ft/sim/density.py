"""Per-document attention density for simulation: what each document truly reaches at a budget,
and what the run can know about it.

Truth: `density_i(b) = clip(s_i * base(L_i, b), floor, 1)` (1.0 at budget 1.0), where `s_i` is a
per-document sensitivity, lognormal with mean 1 and log-sigma `sigma`, and `base(L, b)` is either

- a curve: `mean` at the default budget, linear in budget down to 0 at budget 0 and up to 1.0
  at budget 1.0, times `(L / ref_length) ** -length_exponent` (longer documents sparser), or
- a saved `DensityStats` (its `expected(L, b)`), e.g. the statistics of a real run.

`mean`, `sigma`, `length_exponent` and `predicted_r2` can be read from densities measured on a real
model (`sim.calibration.calibrate`); the defaults (0.3, 0.5, 0, 0) are assumptions.

What batching and the tuner may use (`knowledge`, the levels of `cost.documents` in training):
- `none`: the length model `base(L, b)` only (what a run knows before any per-document data);
- `predicted`: the per-document predictor from cheap features, for unseen documents. Its quality is
  `predicted_r2`, the share of the variance of `log s_i` the features explain (measured by
  cross-validation on the real model's documents): the prediction is the conditional mean of a
  Gaussian with that R^2, `log s_hat = R^2 x + sqrt(R^2 (1 - R^2)) sigma z` around the mean;
- `remembered`: each document's own observed density (epoch 2 onward); the simulator's truth does
  not drift between epochs, so this is the true density (training measures the drift).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import numpy as np

from ..cost.stats import DensityStats
from .lengths import SimInputError

Knowledge = Literal["none", "predicted", "remembered"]
KNOWLEDGE = ("none", "predicted", "remembered")


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
    predicted_r2: float = 0.0
    stats: DensityStats | None = None  # when set, base(L, b) = stats.expected(L, b)

    def __post_init__(self) -> None:
        self.lengths = np.asarray(self.lengths, dtype=np.int64)
        if not 0.0 < self.default_budget < 1.0:
            raise SimInputError(f"default budget must be in (0, 1), got {self.default_budget}")
        if not 0.0 < self.mean <= 1.0:
            raise SimInputError(f"--density-mean must be in (0, 1], got {self.mean}")
        if self.sigma < 0:
            raise SimInputError(f"--density-sigma must be >= 0, got {self.sigma}")
        if not 0.0 <= self.predicted_r2 <= 1.0:
            raise SimInputError(f"--predicted-r2 must be in [0, 1], got {self.predicted_r2}")
        rng = np.random.default_rng([self.seed, 11])
        n = self.lengths.shape[0]
        x = rng.normal(0.0, self.sigma, n)  # log-sensitivity around its mean
        self.sensitivity = np.exp(x - 0.5 * self.sigma**2)
        r2 = self.predicted_r2
        x_hat = r2 * x + np.sqrt(r2 * (1.0 - r2)) * self.sigma * np.random.default_rng([self.seed, 12]).normal(0.0, 1.0, n)
        self.predicted_sensitivity = np.exp(x_hat - 0.5 * r2 * self.sigma**2)
        self._predictor = DensityStats(prior=self._curve) if self.stats is None else self.stats

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
    def _scaled(self, docs: np.ndarray, budget, sensitivity: np.ndarray) -> np.ndarray:
        docs = np.asarray(docs, dtype=np.int64)
        b = np.broadcast_to(np.asarray(budget, dtype=np.float64), docs.shape)
        d = np.clip(sensitivity[docs] * self.base(self.lengths[docs], b), self.floor, 1.0)
        return np.where(b >= 1.0, 1.0, d)

    def true(self, docs: np.ndarray, budget: float | np.ndarray) -> np.ndarray:
        return self._scaled(docs, budget, self.sensitivity)

    def predicted(self, docs: np.ndarray, budget: float | np.ndarray, knowledge: Knowledge) -> np.ndarray:
        if knowledge == "remembered":
            return self.true(docs, budget)
        if knowledge == "predicted":
            return self._scaled(docs, budget, self.predicted_sensitivity)
        if knowledge == "none":
            docs = np.asarray(docs, dtype=np.int64)
            return self.base(self.lengths[docs], budget)
        raise SimInputError(f"--knowledge {knowledge!r}: choose one of {', '.join(KNOWLEDGE)}")

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
