"""Density statistics: what density a document of a given length is expected to reach at a budget.

The run keeps them itself. Every step the attention reports each document's achieved density
(at the budget it ran under); `observe` bins those into a fixed table of (log2-length bucket,
budget grid point), splitting each observation linearly between the two nearest buckets and the
two nearest budget points. `sync` sums the observations made since the last sync over all ranks
with one `all_reduce` of a fixed-size int64 tensor. The table holds fixed-point integers, so the
sum is exact and order-independent: every rank ends with bit-identical statistics, which keeps
the batching and balancing decisions identical on every rank.

`expected(lengths, budget)` blends, per cell, a prior (`prior_strength` pseudo-observations of
the prior density) with the observed mean, interpolates linearly in budget and in log length,
and is monotone non-decreasing in budget (a running maximum over the budget grid). Budget 1.0
always means density 1.0 (dense). The prior is the attention's own bound,
`sparsebalance_ft.attention.budget.max_density(length, config, budget)`: the most blocks the
budget's caps allow, a conservative (pessimistic for time) guess until the data says otherwise.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..attention.config import SparsityConfig

PriorFn = Callable[[np.ndarray, float], np.ndarray]

_SCALE = 1 << 20  # fixed-point unit of weights and densities
_STATE_VERSION = 1


def attention_prior(config: SparsityConfig) -> PriorFn:
    """The prior density at (lengths, budget): the attention's own bound, `attention.budget.max_density`."""
    from ..attention.budget import max_density

    def prior(lengths: np.ndarray, budget: float) -> np.ndarray:
        lengths = np.asarray(lengths)
        return np.array([max_density(int(n), config, budget) for n in lengths.reshape(-1)],
                        dtype=np.float64).reshape(lengths.shape)

    return prior


def _isotonic(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted least-squares non-decreasing fit (pool adjacent violators)."""
    means: list[float] = []
    wsum: list[float] = []
    sizes: list[int] = []
    for v, w in zip(values.tolist(), np.maximum(weights, 1e-12).tolist()):
        means.append(v)
        wsum.append(w)
        sizes.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            w2 = wsum[-2] + wsum[-1]
            m2 = (means[-2] * wsum[-2] + means[-1] * wsum[-1]) / w2
            n2 = sizes[-2] + sizes[-1]
            del means[-1], wsum[-1], sizes[-1]
            means[-1], wsum[-1], sizes[-1] = m2, w2, n2
    return np.repeat(np.array(means), sizes)


class DensityStats:
    """Expected per-document density at a budget, learned from the run's own attention reports."""

    def __init__(
        self,
        config: SparsityConfig | None = None,
        prior: PriorFn | None = None,
        min_length: int = 16,
        max_length: int = 1 << 20,
        buckets_per_octave: int = 2,
        budget_points: int = 21,
        prior_strength: float = 2.0,
        decay: float = 1.0,
        budget_bandwidth: float = 0.15,
        length_bandwidth: float = 1.0,
        num_layers: int | None = None,
    ) -> None:
        self.config = config or SparsityConfig()
        self.num_layers = num_layers
        self._prior_fn = prior or attention_prior(self.config)
        lo, hi = np.log2(min_length), np.log2(max_length)
        n_len = int(np.ceil((hi - lo) * buckets_per_octave)) + 1
        self.log_lengths = np.linspace(lo, lo + (n_len - 1) / buckets_per_octave, n_len)  # bucket centres, log2
        self.budgets = np.linspace(0.0, 1.0, budget_points)
        self.prior_strength = float(prior_strength)
        self.decay = float(decay)
        self.budget_bandwidth = float(budget_bandwidth)
        self.length_bandwidth = float(length_bandwidth)
        shape = (3, n_len, budget_points)  # weight, weight*density, weight*density^2 (fixed point)
        self._total = np.zeros(shape, dtype=np.int64)
        self._pending = np.zeros(shape, dtype=np.int64)
        self._prior_table = self._build_prior()
        self._cache: np.ndarray | None = None

    # ------------------------------------------------------------------ tables
    def _build_prior(self) -> np.ndarray:
        lengths = np.exp2(self.log_lengths)
        table = np.empty((self.log_lengths.size, self.budgets.size))
        for j, b in enumerate(self.budgets):
            table[:, j] = np.clip(self._prior_fn(lengths, float(b)), 0.0, 1.0) if b < 1.0 else 1.0
        return np.maximum.accumulate(table, axis=1)

    def table(self) -> np.ndarray:
        """Expected density per (length bucket, budget point), monotone in budget; cached.

        The observed/prior ratio of the observed cells is smoothed over budget and log length
        (exponential kernels of widths `budget_bandwidth` and `length_bandwidth` octaves, plus
        `prior_strength` pseudo-weight at ratio 1), which reshapes the prior at unobserved budgets
        and nearby lengths; each cell then blends that
        shaped prior (weight `prior_strength`) with its own observations, and a weighted
        isotonic fit makes the row non-decreasing in budget.
        """
        if self._cache is None:
            k = self.prior_strength
            weight = self._total[0] / _SCALE
            mass = self._total[1] / _SCALE
            prior = np.maximum(self._prior_table, 1e-6)
            with np.errstate(invalid="ignore", divide="ignore"):
                ratio = np.where(weight > 0, mass / np.maximum(weight, 1e-12) / prior, 1.0)
            kb = np.exp(-np.abs(self.budgets[:, None] - self.budgets[None, :]) / self.budget_bandwidth)
            kl = np.exp(-np.abs(self.log_lengths[:, None] - self.log_lengths[None, :]) / self.length_bandwidth)
            smooth = (kl @ (weight * ratio) @ kb.T + k) / (kl @ weight @ kb.T + k)
            shaped = np.clip(prior * smooth, 0.0, 1.0)
            table = (k * shaped + mass) / np.maximum(k + weight, 1e-12)
            table = np.vstack([_isotonic(row, k + w) for row, w in zip(table, weight)])
            table[:, self.budgets >= 1.0] = 1.0
            self._cache = np.clip(table, 0.0, 1.0)
        return self._cache

    def _coords(self, values: np.ndarray, grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        i = np.clip(np.searchsorted(grid, values, side="right") - 1, 0, grid.size - 2)
        t = np.clip((values - grid[i]) / (grid[i + 1] - grid[i]), 0.0, 1.0)
        return i, t

    # ------------------------------------------------------------------ queries
    def expected(self, lengths: np.ndarray, budget: float | np.ndarray) -> np.ndarray:
        """Expected density of documents of `lengths` at `budget` (scalar, or one per document)."""
        x = np.log2(np.maximum(np.asarray(lengths, dtype=np.float64).reshape(-1), 1.0))
        b = np.broadcast_to(np.clip(np.asarray(budget, dtype=np.float64), 0.0, 1.0), x.shape)
        table = self.table()
        i, t = self._coords(x, self.log_lengths)
        j, s = self._coords(b, self.budgets)
        row0 = table[i, j] + s * (table[i, j + 1] - table[i, j])
        row1 = table[i + 1, j] + s * (table[i + 1, j + 1] - table[i + 1, j])
        out = row0 + t * (row1 - row0)
        return np.where(b >= 1.0, 1.0, out)

    def prior(self, lengths: np.ndarray, budget: float) -> np.ndarray:
        return np.clip(self._prior_fn(np.asarray(lengths, dtype=np.float64), float(budget)), 0.0, 1.0)

    def counts(self) -> np.ndarray:
        """Synced observation weight per (length bucket, budget point)."""
        return self._total[0] / _SCALE

    def std(self) -> np.ndarray:
        """Observed standard deviation per cell (NaN where nothing was observed)."""
        w = self._total[0] / _SCALE
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = (self._total[1] / _SCALE) / w
            var = (self._total[2] / _SCALE) / w - mean * mean
        return np.sqrt(np.maximum(var, 0.0))

    # ------------------------------------------------------------------ updates
    def observe(self, lengths: Any, densities: Any, budget: float | Any, weight: float | Any = 1.0) -> None:
        """Record achieved densities of documents run at `budget` (pending until `sync`).

        Without torch.distributed, call `sync()` anyway (it then just folds the pending ones in).
        Documents whose length or density is not finite are skipped.
        """
        L = np.asarray(lengths, dtype=np.float64).reshape(-1)
        d = np.asarray(densities, dtype=np.float64).reshape(-1)
        if L.shape != d.shape:
            raise ValueError(f"{L.size} lengths but {d.size} densities")
        finite = np.isfinite(L) & np.isfinite(d) & (L > 0)
        L, d = L[finite], np.clip(d[finite], 0.0, 1.0)
        if L.size == 0:
            return
        b = np.clip(np.asarray(budget, dtype=np.float64), 0.0, 1.0)
        b = b[finite] if b.ndim else np.broadcast_to(b, L.shape)
        w = np.asarray(weight, dtype=np.float64)
        w = w[finite] if w.ndim else np.broadcast_to(w, L.shape)
        x = np.log2(np.maximum(L, 1.0))
        i, t = self._coords(x, self.log_lengths)
        j, s = self._coords(b, self.budgets)
        for di, wi in ((0, 1.0 - t), (1, t)):
            for dj, wj in ((0, 1.0 - s), (1, s)):
                cw = w * wi * wj
                fixed = np.rint(np.stack([cw, cw * d, cw * d * d]) * _SCALE).astype(np.int64)
                for q in range(3):
                    np.add.at(self._pending[q], (i + di, j + dj), fixed[q])

    def sparse_layers(self) -> list[int] | None:
        if not self.num_layers:
            return None
        n = int(self.num_layers)
        dense = {i % n for i in self.config.dense_layers if -n <= i < n}
        return [i for i in range(n) if i not in dense]

    def sparse_only(self, densities: np.ndarray) -> np.ndarray:
        """A report's per-document densities (averaged over every layer, dense ones at 1.0) as densities of the sparse layers."""
        dens = np.asarray(densities, dtype=np.float64)
        sparse = self.sparse_layers()
        if sparse is not None and 0 < len(sparse) < self.num_layers:
            n, k = float(self.num_layers), float(len(sparse))
            dens = np.clip((dens * n - (n - k)) / k, 0.0, 1.0)
        return dens

    def observe_report(self, report: Any, budget: float | None = None) -> int:
        """Observe an `attention.AttentionReport`: its per-document densities at the run's budget.

        The report's document density averages every layer, dense layers (always 1.0) included;
        the statistics (like the prior and the cost model's per-document density) describe the
        sparse layers, so with `num_layers` known the dense layers are taken out. `budget`
        defaults to the mean budget of the sparse layers in the report. Forced-density reports
        (profiling) are ignored. Returns how many documents were recorded.
        """
        if getattr(report, "forced_density", None) is not None or not report.doc_densities:
            return 0
        sparse = self.sparse_layers()
        budgets = list(getattr(report, "layer_budget", []) or [])
        if budget is None:
            chosen = [budgets[i] for i in (sparse or range(len(budgets))) if i < len(budgets)]
            budget = float(np.mean(chosen)) if chosen else float(self.config.budget)
        lengths = np.array([n for n, _ in report.doc_densities], dtype=np.float64)
        dens = self.sparse_only(np.array([d for _, d in report.doc_densities], dtype=np.float64))
        self.observe(lengths, dens, budget)
        return int(lengths.size)

    def sync(self, group: Any = None) -> None:
        """Merge pending observations of every rank (one all_reduce); identical result on all ranks."""
        pending = self._pending
        try:
            import torch
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
                device = torch.device("cpu")
                if dist.get_backend(group) == "nccl":
                    device = torch.device("cuda", torch.cuda.current_device())
                buf = torch.from_numpy(pending.copy()).to(device)
                dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
                pending = buf.cpu().numpy()
        except ImportError:  # pragma: no cover
            pass
        if self.decay < 1.0:
            self._total = np.floor(self._total * self.decay).astype(np.int64)
        self._total = self._total + pending
        self._pending = np.zeros_like(self._pending)
        self._cache = None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "log_lengths": self.log_lengths.tolist(),
            "budgets": self.budgets.tolist(),
            "prior_strength": self.prior_strength,
            "decay": self.decay,
            "total": self._total.tolist(),
            "pending": self._pending.tolist(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("version", 0)) != _STATE_VERSION:
            raise ValueError(f"density statistics version {state.get('version')} is not {_STATE_VERSION}")
        same = (np.shape(state["log_lengths"]) == self.log_lengths.shape and np.shape(state["budgets"]) == self.budgets.shape
                and np.allclose(state["log_lengths"], self.log_lengths) and np.allclose(state["budgets"], self.budgets))
        if not same:
            raise ValueError("density statistics were saved with another length/budget grid")
        self.prior_strength = float(state.get("prior_strength", self.prior_strength))
        self.decay = float(state.get("decay", self.decay))
        self._total = np.asarray(state["total"], dtype=np.int64).reshape(self._total.shape)
        self._pending = np.asarray(state.get("pending", np.zeros_like(self._pending)), dtype=np.int64).reshape(
            self._pending.shape)
        self._cache = None


__all__ = ["DensityStats", "attention_prior"]
