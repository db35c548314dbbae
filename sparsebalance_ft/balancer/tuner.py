"""Dynamic sparsity tuning (DST): the pure, deterministic per-step choice of every rank's budget.

Input: every rank's predicted step time on one shared grid of budgets (an [R, G] array, the
grid ascending and holding the default budget), the default budget, the bounds MIN..MAX and a
mode. Output: one budget per rank and the time predicted for it. Nothing here communicates,
times or draws random numbers, so every rank (and the simulator) reaches the same decision.

Time as a function of budget is taken piecewise linear between grid points and made monotone
(a running maximum along the grid), so "the largest budget whose predicted time is at most T"
is well defined and found with one comparison per grid point.

The target T* (documented choice). The step ends when the slowest rank ends, so the step's
predicted time is max_r t_r(b_r). Three rules, `BalanceConfig.target`:

- ``mean`` (default): T* = max(mean_r t_r(default), max_r t_r(MIN)), the mean over the ranks
  that can absorb work (time rising with budget; idle and padding-only ranks cannot). The mean keeps the step's
  total attention work about where the untuned step had it: stragglers give up budget down to the
  mean, waiting ranks take budget up to it. The second term is the floor no cut can go under: a
  rank that is still slower than the mean at MIN is the bottleneck whatever the others do, so
  holding them below its time would only leave them idle; they may fill up to it ("free
  accuracy") without making the step any slower.
- ``fastest``: T* = max_r t_r(MIN), the shortest step any choice of budgets can reach; everyone
  slower is cut to it and (bidirectional) everyone faster raised to it. Fastest, sparsest.
- ``fill``: T* = max_r t_r(default), the untuned step's predicted time. Nobody is cut; with
  ``bidirectional`` every faster rank takes budget up to the slowest rank's time. The step takes
  as long as untuned and the waiting ranks' time goes into budget (the paper's "free accuracy").

All three are at most max_r t_r(default), so no mode ever predicts a slower step than no tuning.

Tolerance: a rank predicted slower than T* by less than ``tolerance`` x T* is not treated as a
straggler. Such a gap is within the cost model's own error (5-10% median on the profiled CPU), so
cutting it would trade recall for a gain the prediction cannot promise.

Modes: ``none`` keeps the default everywhere; ``straggler-only`` lowers ranks predicted above T*
to the largest budget that meets T* (MIN when none does) and leaves all others at the default;
``bidirectional`` gives every rank the largest budget in [MIN, MAX] whose prediction is at most T*
(MIN when none is), which lowers the stragglers and raises the others, never above MAX and never
past T*. A rank whose row is not finite (or negative) gets the default and takes no part in T*.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MODES = ("none", "straggler-only", "bidirectional")
TARGETS = ("mean", "fastest", "fill")


def step_tuning_mode(tuning: str, target: str) -> str:
    """The per-step decision a tuning mode makes before any in-step correction.

    `layer` corrects inside the step, on measured work, so its per-step decision is a first guess:
    the bidirectional one, except with target ``fill``, where a guess that raises a waiting rank
    by prediction overshoots about half the time (then the raised rank becomes the straggler) and
    the layer tuner can fill exactly from the default budget.
    """
    if tuning != "layer":
        return tuning
    return "none" if target == "fill" else "bidirectional"


@dataclass(frozen=True)
class TuneResult:
    """One step's decision over all ranks (arrays indexed by rank)."""

    budgets: np.ndarray  # [R] chosen budget
    predicted: np.ndarray  # [R] predicted time at the chosen budget; NaN for invalid ranks
    default_times: np.ndarray  # [R] predicted time at the default budget; NaN for invalid ranks
    target: float  # T*; NaN when no rank had a valid prediction
    valid: np.ndarray  # [R] bool: the rank's prediction was usable

    @property
    def invalid_ranks(self) -> list[int]:
        return [int(r) for r in np.flatnonzero(~self.valid)]


def budget_grid(min_budget: float, max_budget: float, default_budget: float, points: int = 17) -> np.ndarray:
    """Ascending budgets: `points` evenly from MIN to MAX, plus the default when it lies outside them."""
    if min_budget > max_budget:
        raise ValueError(f"min_budget ({min_budget}) exceeds max_budget ({max_budget})")
    grid = np.linspace(float(min_budget), float(max_budget), max(int(points), 2))
    grid = np.append(grid, float(default_budget))
    return np.unique(np.round(grid, 12))


def _interp_rows(t: np.ndarray, grid: np.ndarray, b: float) -> np.ndarray:
    """Each row of t (piecewise linear over grid) evaluated at the one budget b (clamped to the grid)."""
    if grid.size == 1:
        return t[:, 0].copy()
    b = min(max(b, grid[0]), grid[-1])
    j = int(np.clip(np.searchsorted(grid, b, side="right") - 1, 0, grid.size - 2))
    frac = (b - grid[j]) / (grid[j + 1] - grid[j])
    return t[:, j] + frac * (t[:, j + 1] - t[:, j])


def tune(
    times: np.ndarray,
    grid: np.ndarray,
    default_budget: float,
    min_budget: float,
    max_budget: float,
    mode: str = "bidirectional",
    target: str = "mean",
    headroom: float = 0.0,
    tolerance: float = 0.0,
) -> TuneResult:
    """Choose every rank's budget; see the module docstring for the rules.

    times: [R, G] predicted seconds of rank r at budget grid[g] (NaN/inf marks a missing prediction).
    grid:  [G] ascending budgets; tuned budgets are searched over the part of it in [MIN, MAX].
    MIN <= default <= MAX is required unless mode is ``none``.
    headroom: ranks at or under T* are raised only up to T* * (1 - headroom) (never below the
    default), leaving that share as a margin for prediction error; stragglers still aim at T*.
    tolerance: only ranks predicted above T* * (1 + tolerance) at the default are stragglers.
    """
    if mode not in MODES:
        raise ValueError(f"unknown tuning mode {mode!r}; expected one of {MODES}")
    if target not in TARGETS:
        raise ValueError(f"unknown target rule {target!r}; expected one of {TARGETS}")
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    if not tolerance >= 0.0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    times = np.asarray(times, dtype=np.float64)
    grid = np.asarray(grid, dtype=np.float64)
    if times.ndim != 2 or grid.ndim != 1 or times.shape[1] != grid.size or grid.size == 0:
        raise ValueError(f"times must be [ranks, {grid.size}] for a grid of {grid.size} budgets, got {times.shape}")
    if grid.size > 1 and np.any(np.diff(grid) <= 0):
        raise ValueError("budget grid must be strictly ascending")
    d = float(default_budget)
    n_ranks = times.shape[0]

    with np.errstate(invalid="ignore"):
        valid = (times >= 0).all(axis=1) & (times < np.inf).all(axis=1)  # NaN fails both comparisons
    t = times if valid.all() else np.where(valid[:, None], times, 0.0)
    t = np.maximum.accumulate(t, axis=1)  # more budget never predicted faster
    default_times = np.where(valid, _interp_rows(t, grid, d), np.nan)
    budgets = np.full(n_ranks, d)

    if mode == "none" or not valid.any():
        target_time = float(np.mean(default_times[valid])) if valid.any() else float("nan")
        return TuneResult(budgets, default_times.copy(), default_times, target_time, valid)

    if not (min_budget <= d <= max_budget):
        raise ValueError(f"default budget {d} lies outside [{min_budget}, {max_budget}]")
    first = int(np.searchsorted(grid, min_budget - 1e-12, side="left"))
    last = int(np.searchsorted(grid, max_budget + 1e-12, side="right"))
    g = grid[first:last]
    tb = t[:, first:last]  # a view: the grid is ascending
    if g.size == 0 or not np.isclose(g[0], min_budget) or not np.isclose(g[-1], max_budget):
        raise ValueError("the budget grid must contain min_budget and max_budget (use budget_grid)")

    floor = float(tb[valid, 0].max())  # the slowest rank's time at MIN: no cut gets the step below it
    # The mean is taken over the ranks that can absorb work (their time grows with budget): an idle
    # or padding-only rank (flat row, often all zeros) would drag T* down and cut the working
    # ranks for a share of work that nobody can take up.
    absorbs = valid & (tb[:, -1] > tb[:, 0])
    pool = absorbs if absorbs.any() else valid
    if target == "fastest":
        target_time = floor
    elif target == "fill":
        target_time = float(default_times[valid].max())
    else:
        target_time = max(float(default_times[pool].mean()), floor)

    # Largest budget in [MIN, MAX] whose predicted time is at most the rank's threshold (T* for
    # stragglers, T*(1 - headroom) for the others): rows are monotone, so the grid points that
    # meet it are a prefix of length k; interpolate inside the first segment that crosses it.
    straggler = valid & (default_times > target_time * (1.0 + tolerance))
    threshold = np.where(straggler, target_time, target_time * (1.0 - headroom))
    k = np.count_nonzero(tb <= threshold[:, None], axis=1)
    n = g.size
    lo_i = np.clip(k - 1, 0, n - 1)
    hi_i = np.clip(k, 0, n - 1)
    rows = np.arange(n_ranks)
    t0, t1 = tb[rows, lo_i], tb[rows, hi_i]
    g0, g1 = g[lo_i], g[hi_i]
    crossing = (k > 0) & (k < n)
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(crossing, (threshold - t0) / np.where(crossing, t1 - t0, 1.0), 0.0)
    best = np.where(k == 0, g[0], np.where(k == n, g[-1], g0 + frac * (g1 - g0)))
    best_time = np.where(k == 0, tb[:, 0], np.where(k == n, tb[:, -1], np.minimum(t0 + frac * (t1 - t0), threshold)))
    best = np.clip(best, min_budget, max_budget)

    if mode == "straggler-only":
        budgets = np.where(straggler, np.minimum(best, d), d)
        predicted = np.where(straggler, best_time, default_times)
    else:  # bidirectional; with headroom a waiting rank may find no room above the default: it keeps it
        keep = valid & ~straggler & (best <= d)
        budgets = np.where(valid, np.where(keep, d, best), d)
        predicted = np.where(valid, np.where(keep, default_times, best_time), np.nan)
    return TuneResult(budgets, predicted, default_times, target_time, valid)


def layer_budgets(
    budget: float,
    default_budget: float,
    sensitivity: np.ndarray | None,
    num_layers: int,
    min_budget: float,
    max_budget: float,
) -> np.ndarray:
    """Spread a rank's budget change over layers by sensitivity, keeping the layers' mean budget.

    A heuristic, not measured to help: `sensitivity[l]` is how much attention mass layer l loses
    at a given budget (the service uses a running mean of 1 - sampled recall). When the rank's
    budget is cut, insensitive layers give up more; when it is raised, sensitive layers take more.
    The layers' mean stays at `budget` as far as [MIN, MAX] allows, because the cost model
    predicts from one budget per rank and layers cost about the same. Without sensitivity
    (None, all NaN or all equal) every layer simply gets `budget`.
    """
    flat = np.full(num_layers, float(budget))
    if sensitivity is None or num_layers == 0:
        return flat
    s = np.asarray(sensitivity, dtype=np.float64)
    if s.shape != (num_layers,) or not np.isfinite(s).any():
        return flat
    s = np.where(np.isfinite(s), s, np.nanmean(s))
    s = np.clip(s, 0.0, None)
    delta = float(budget) - float(default_budget)
    if delta == 0.0 or np.ptp(s) <= 1e-12:
        return flat
    s = s + 0.1 * s.mean() + 1e-9
    w = s if delta > 0 else 1.0 / s
    w = w / w.mean()
    w = np.minimum(w, 3.0)
    out = np.clip(default_budget + delta * w, min_budget, max_budget)
    for _ in range(4):  # put back what the bounds clipped, on the layers still free to move
        residual = num_layers * float(budget) - out.sum()
        free = (out < max_budget - 1e-12) if residual > 0 else (out > min_budget + 1e-12)
        if abs(residual) < 1e-12 or not free.any():
            break
        share = w * free
        out = np.clip(out + residual * share / share.sum(), min_budget, max_budget)
    return out
