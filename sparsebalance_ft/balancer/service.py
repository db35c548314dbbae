"""The balancer the training loop calls each step: predict, exchange once, tune, report back.

Per optimizer step, on every rank, in this order:

    decision = service.decide(my_micro_batch_lengths)   # collective: every rank, every step
    controller.set_budget(decision.budget)              # float, or a list per layer
    ... forward / backward of this rank's micro-batches, gradient all-reduce ...
    service.observe(controller.pop_report(), compute_time, wait_time)  # may be collective (stats.sync)

`decide` predicts this rank's step time at every budget of a fixed grid (cost model x density
statistics), exchanges the row with ONE `all_gather` of a small float64 tensor (gloo on CPU, NCCL
on GPU; no collective at all when torch.distributed is not initialised or the world has one
rank), and runs the pure tuner on the gathered [ranks, grid] array, so every rank reaches the
same decision for every rank. Failure rules: a prediction that raises or is not finite is sent
as NaN and that rank gets the default budget, with a warning logged (every rank sees it in the
gathered array, so no rank needs to agree on anything else); a tuner error gives every rank the
default budget and logs an error; the all_gather is always entered, exactly once per call, so
no local failure can leave peers waiting. A failure of the collective itself is raised: that
is a broken process group, not something to train through silently.
"""
from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .config import BalanceConfig
from .tuner import budget_grid, layer_budgets, step_tuning_mode, tune

log = logging.getLogger("sparsebalance_ft.balancer")

STATE_VERSION = 1


@dataclass
class BalanceDecision:
    """One step's balancing decision as seen from one rank (lists are indexed by rank)."""

    step: int
    rank: int
    mode: str
    budget: float | list[float]  # pass to controller.set_budget
    rank_budget: float  # this rank's scalar budget (the mean over layers when per layer)
    predicted_time: float  # this rank's predicted compute time at its budget (NaN: unknown)
    target: float  # T*
    budgets: list[float] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)
    default_times: list[float] = field(default_factory=list)
    fallback_ranks: list[int] = field(default_factory=list)
    error: str | None = None
    decide_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (NaN becomes None)."""

        def clean(value):
            if isinstance(value, float):
                return value if math.isfinite(value) else None
            if isinstance(value, list):
                return [clean(v) for v in value]
            return value

        return {k: clean(v) for k, v in asdict(self).items()}


def predict_times(cost_model, density_stats, micro_batches: Sequence[Sequence[int]], grid: np.ndarray) -> np.ndarray:
    """Predicted compute seconds of one rank's micro-batches at each budget of `grid` ([G]).

    Sum over micro-batches of `cost_model.micro_batch_time(lengths, densities)`, the densities
    being `density_stats.expected(lengths, budget)`. Empty micro-batches cost nothing.
    """
    batches = [np.asarray(mb, dtype=np.int64).ravel() for mb in micro_batches]
    batches = [mb for mb in batches if mb.size]
    out = np.zeros(len(grid), dtype=np.float64)
    if not batches:
        return out
    lengths = np.concatenate(batches)
    splits = np.cumsum([mb.size for mb in batches])[:-1]
    budgets = np.asarray(grid, dtype=np.float64)
    # one query for every (budget, document) pair: DensityStats.expected takes a budget per document
    densities = np.asarray(
        density_stats.expected(np.tile(lengths, budgets.size), np.repeat(budgets, lengths.size)), dtype=np.float64
    ).reshape(budgets.size, lengths.size)
    for g in range(budgets.size):
        out[g] = sum(
            float(cost_model.micro_batch_time(mb, dens)) for mb, dens in zip(batches, np.split(densities[g], splits))
        )
    return out


def report_layer_recall(report) -> np.ndarray | None:
    values = report.layer_recall
    if values is None:
        return None
    return np.asarray([np.nan if v is None else float(v) for v in np.ravel(values)], dtype=np.float64)


class BalancerService:
    """Per-step dynamic sparsity tuning over torch.distributed (see the module docstring).

    cost_model: has `micro_batch_time(lengths, densities) -> float` (None only with tuning none:
    then nothing is predicted or exchanged and every rank keeps the default budget).
    density_stats: has `expected(lengths, budget)`, `observe(lengths, densities, budget)`, `sync()`
    and optionally `state_dict()` / `load_state_dict()`.
    default_budget: `sparsity.budget`. num_layers: needed when `config.per_layer`.
    sync_stats: call `density_stats.sync()` at the end of every `observe` (on every rank).
    """

    def __init__(
        self,
        config: BalanceConfig,
        cost_model,
        density_stats,
        default_budget: float,
        *,
        num_layers: int | None = None,
        group=None,
        sync_stats: bool = True,
        sensitivity_decay: float = 0.9,
    ):
        config.check_default_budget(default_budget)
        if cost_model is None and config.tuning != "none":
            raise ValueError(f"balance.tuning '{config.tuning}' needs a cost model")
        if config.per_layer and not num_layers:
            raise ValueError("balance.per_layer needs num_layers")
        self.config = config
        self.cost_model = cost_model
        self.stats = density_stats
        self.default_budget = float(default_budget)
        self.num_layers = int(num_layers) if num_layers else None
        self.group = group
        self.sync_stats = sync_stats
        self.sensitivity_decay = float(sensitivity_decay)
        self.grid = budget_grid(config.min_budget, config.max_budget, self.default_budget, config.grid_points)
        self.step = 0
        self.fallbacks = 0
        self.sensitivity: np.ndarray | None = None  # this rank's running mean of 1 - recall per layer
        self.prediction_ratio: float | None = None  # running mean of measured / predicted compute time
        self.last_decision: BalanceDecision | None = None
        self._warned = 0

    @classmethod
    def from_recipe(cls, recipe, cost_model, density_stats, *, num_layers: int | None = None, group=None, **kwargs):
        """The service a recipe asks for: `recipe.balance`, default budget `recipe.sparsity.budget`."""
        return cls(
            recipe.balance, cost_model, density_stats, recipe.sparsity.budget, num_layers=num_layers, group=group, **kwargs
        )

    # -- distributed -----------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_available() and dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1

    def _all_gather(self, row: np.ndarray) -> np.ndarray:
        if not self.distributed:
            return row[None, :].copy()
        device = torch.device("cpu")
        if dist.get_backend(self.group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        local = torch.from_numpy(np.ascontiguousarray(row)).to(device=device, dtype=torch.float64)
        rows = [torch.empty_like(local) for _ in range(self.world_size)]
        try:
            dist.all_gather(rows, local, group=self.group)
        except Exception:
            log.error("balancer all_gather failed at step %d (process group broken?)", self.step, exc_info=True)
            raise
        return torch.stack(rows).cpu().numpy()

    def _warn(self, message: str, *args, exc_info: bool = False) -> None:
        self._warned += 1
        if self._warned <= 10 or self._warned % 100 == 0:
            log.warning(message + (" (warning %d)" % self._warned), *args, exc_info=exc_info)

    def warnings_summary(self) -> str | None:
        """One line for the end of the run when warnings were silenced (after the 10th, only every 100th shows)."""
        shown = min(self._warned, 10) + self._warned // 100  # the first ten, then every hundredth
        if shown == self._warned:
            return None
        return (f"balancer on rank {self.rank}: {self._warned} warnings in this run, {shown} of them shown;"
                f" {self.fallbacks} steps fell back to the default budget")

    # -- the per-step decision --------------------------------------------------------------
    def predict(self, micro_batches: Sequence[Sequence[int]]) -> np.ndarray:
        """This rank's predicted compute seconds on the budget grid ([G]); raises on bad input."""
        return predict_times(self.cost_model, self.stats, micro_batches, self.grid)

    def decide(self, micro_batches: Sequence[Sequence[int]], step: int | None = None, densities=None) -> BalanceDecision:
        """Collective: call on every rank every step, with this rank's micro-batches' document lengths.

        `step` (optional) labels the decision; by default the service counts its own calls.
        `densities` (optional): an object with `expected(lengths, budget)` that knows these very
        documents (remembered or predicted per document); by default the length statistics.
        With `tuning: layer` the per-step decision is `step_tuning_mode`'s (the layer tuner then
        corrects it inside the step).
        """
        started = time.perf_counter()
        if step is not None:
            self.step = int(step)
        rank, step, mode = self.rank, self.step, self.config.tuning
        tune_mode = step_tuning_mode(mode, self.config.target)
        self.step += 1
        grid_n = self.grid.size
        layers = self.num_layers if self.config.per_layer else 0
        if self.cost_model is None:  # tuning none without a cost model: the same on every rank
            decision = self._default_decision(step, rank, mode, [math.nan] * self.world_size, None)
            decision.decide_seconds = time.perf_counter() - started
            self.last_decision = decision
            return decision

        row = np.full(grid_n + layers, np.nan)
        try:
            row[:grid_n] = predict_times(self.cost_model, densities or self.stats, micro_batches, self.grid)
            if not np.isfinite(row[:grid_n]).all():
                self._warn("rank %d step %d: prediction not finite; this rank keeps the default budget", rank, step)
        except Exception:
            row[:grid_n] = np.nan
            self._warn("rank %d step %d: prediction failed; this rank keeps the default budget", rank, step, exc_info=True)
        if layers and self.sensitivity is not None:
            row[grid_n:] = self.sensitivity

        gathered = self._all_gather(row)  # always entered, exactly once

        try:
            result = tune(
                gathered[:, :grid_n],
                self.grid,
                self.default_budget,
                self.config.min_budget,
                self.config.max_budget,
                tune_mode,
                self.config.target,
                self.config.headroom,
                self.config.tolerance,
            )
        except Exception as error:
            log.error("balancer step %d: tuner failed; every rank keeps the default budget", step, exc_info=True)
            self.fallbacks += 1
            decision = self._default_decision(step, rank, mode, [math.nan] * gathered.shape[0], f"tuner: {error!r}")
            decision.decide_seconds = time.perf_counter() - started
            self.last_decision = decision
            return decision

        fallback = result.invalid_ranks
        if fallback:
            self.fallbacks += 1
            if rank not in fallback:
                self._warn("step %d: ranks %s had no usable prediction and keep the default budget", step, fallback)
        rank_budget = float(result.budgets[rank])
        budget: float | list[float] = rank_budget
        if layers:
            sens = gathered[:, grid_n:]
            consensus = None
            if np.isfinite(sens).any():
                with np.errstate(all="ignore"), warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # a layer no rank has measured yet
                    consensus = np.nanmean(np.where(np.isfinite(sens), sens, np.nan), axis=0)
            try:
                per_layer = layer_budgets(
                    rank_budget, self.default_budget, consensus, layers, self.config.min_budget, self.config.max_budget
                )
            except Exception:
                self._warn("step %d: per-layer split failed; every layer gets the rank budget", step, exc_info=True)
                per_layer = np.full(layers, rank_budget)
            budget = [float(b) for b in per_layer]
            rank_budget = float(np.mean(per_layer))
        decision = BalanceDecision(
            step=step,
            rank=rank,
            mode=mode,
            budget=budget,
            rank_budget=rank_budget,
            predicted_time=float(result.predicted[rank]),
            target=float(result.target),
            budgets=[float(b) for b in result.budgets],
            predicted=[float(t) for t in result.predicted],
            default_times=[float(t) for t in result.default_times],
            fallback_ranks=fallback,
        )
        decision.decide_seconds = time.perf_counter() - started
        self.last_decision = decision
        return decision

    def _default_decision(self, step, rank, mode, nans, error) -> BalanceDecision:
        budget: float | list[float] = self.default_budget
        if self.config.per_layer and self.num_layers:
            budget = [self.default_budget] * self.num_layers
        return BalanceDecision(
            step=step,
            rank=rank,
            mode=mode,
            budget=budget,
            rank_budget=self.default_budget,
            predicted_time=math.nan,
            target=math.nan,
            budgets=[self.default_budget] * len(nans),
            predicted=list(nans),
            default_times=list(nans),
            fallback_ranks=list(range(len(nans))) if error else [],
            error=error,
        )

    # -- feedback -------------------------------------------------------------------------
    def observe(self, report, compute_time: float, wait_time: float) -> None:
        """After the step: feed achieved densities into the statistics and track prediction error.

        `report` is `controller.pop_report()` (None when there is none, e.g. dense attention). With
        `sync_stats` this ends in `density_stats.sync()`, so call it on every rank every step.
        """
        decision = self.last_decision
        budget = decision.rank_budget if decision is not None else self.default_budget
        if report is not None:
            try:
                if self.stats is not None:
                    self.stats.observe_report(report, budget)
            except Exception:
                self._warn("step %d: could not update density statistics from the report", self.step, exc_info=True)
            try:
                recall = report_layer_recall(report)
                if recall is not None and self.num_layers and recall.size == self.num_layers:
                    self._update_sensitivity(1.0 - recall)
            except Exception:
                self._warn("step %d: could not read per-layer recall from the report", self.step, exc_info=True)
        predicted = decision.predicted_time if decision is not None else math.nan
        if math.isfinite(predicted) and predicted > 0 and math.isfinite(compute_time) and compute_time > 0:
            ratio = compute_time / predicted
            self.prediction_ratio = ratio if self.prediction_ratio is None else 0.9 * self.prediction_ratio + 0.1 * ratio
        if self.sync_stats and self.stats is not None and hasattr(self.stats, "sync"):
            # outside the try blocks: every rank reaches this collective
            self.stats.sync() if self.group is None else self.stats.sync(self.group)

    def _update_sensitivity(self, sample: np.ndarray) -> None:
        sample = np.clip(sample, 0.0, 1.0)
        if self.sensitivity is None:
            self.sensitivity = np.where(np.isfinite(sample), sample, np.nan)
            return
        old = self.sensitivity
        mixed = self.sensitivity_decay * old + (1.0 - self.sensitivity_decay) * sample
        self.sensitivity = np.where(np.isfinite(sample), np.where(np.isfinite(old), mixed, sample), old)

    # -- resume -----------------------------------------------------------------------------
    def state_dict(self, include_stats: bool = True) -> dict[str, Any]:
        """Plain Python state (JSON- and torch.save-able); with `include_stats`, the density statistics too."""
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "step": self.step,
            "fallbacks": self.fallbacks,
            "sensitivity": None if self.sensitivity is None else [float(v) for v in self.sensitivity],
            "prediction_ratio": self.prediction_ratio,
            "grid": [float(g) for g in self.grid],
        }
        if include_stats and self.stats is not None and hasattr(self.stats, "state_dict"):
            state["density_stats"] = self.stats.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"balancer state version {state.get('version')!r} is not {STATE_VERSION}")
        self.step = int(state["step"])
        self.fallbacks = int(state.get("fallbacks", 0))
        sens = state.get("sensitivity")
        self.sensitivity = None if sens is None else np.asarray(sens, dtype=np.float64)
        if self.sensitivity is not None and self.num_layers and self.sensitivity.size != self.num_layers:
            log.warning("balancer state has %d layers, the model %d: sensitivity reset", self.sensitivity.size, self.num_layers)
            self.sensitivity = None
        self.prediction_ratio = state.get("prediction_ratio")
        if "density_stats" in state and self.stats is not None and hasattr(self.stats, "load_state_dict"):
            self.stats.load_state_dict(state["density_stats"])
