"""Replay an epoch (or N steps) of every batching policy, with and without budget tuning.

Nothing here is a second copy of the training's logic: plans come from `batching.BatchSampler`,
times from the `CostModel`, predictions from `DensityStats` (through `DensityModel`), budgets from
`balancer.tuner.tune` (through a `TuningHook`, so another tuner can be plugged in).

Per step and policy: the sampler plans the step with `doc_cost` = the cost model at the predicted
density at the default budget; each rank's predicted time at every budget of the tuner's grid is
summed over its micro-batches; the hook picks per-rank budgets; the rank's simulated compute time
is the cost model at each document's *true* density at the rank's budget. Tuning `layer` is the
bidirectional per-step decision followed by layer-level DST (`balancer.layer_tuning`): every rank
knows its true work at its budget, at MIN and at MAX, and the same rule moves it toward the
target, with work linear between those points as the selection's counts are. The simulator's
documents have one density for all layers, so the rule acts once per step, as it would on each
of the identical layers. Per micro-batch, the
cost model's non-additive part (`micro_batch_time - sum(doc_times)`: overheads, packing effects) is
taken once at the default budget and added at every budget.

Figures (compute = per-rank forward+backward time; step time = max over ranks + step overhead):
- `epoch_time`: sum of step times; `step_time`: its mean per step;
- `budget_spread`: token-weighted standard deviation of the budget each document ran at: what
  tuning distorts (recall is concave in budget, so at one mean budget a wider spread loses recall);
- `mean_budget`: token-weighted mean budget the documents ran at;
- `imbalance`: sum over steps of max-rank compute / sum of mean-rank compute;
- `bubble`: 1 - sum(mean) / sum(max), the share of rank-time spent waiting;
- `vs_peer`: epoch time of the best fair peer (the fastest of `config.peers`, by default `length-grouped`
  and `verl` at the same look-ahead, knowledge and tuning; token-balanced packing, `tokens` /
  `kk-length`, can join them) / this epoch time; `peer` names it; `vs_peer_untuned`: the same against
  that peer without tuning (DST is the method's own: the peer a user runs today has none);
- `vs_random`: epoch time of `random` without tuning / this epoch time (a reference);
- `attention_share`: the share of the documents' compute time spent in attention at the densities
  they ran at (when the cost model separates it): the only part that density knowledge and budget
  tuning can move, so it bounds what they can gain over a peer that balances the rest.
Every row names its policy and the look-ahead it saw (1 for the one-step references).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..balancer.config import BalanceConfig
from ..balancer.layer_tuning import layer_target, move_toward
from ..batching import LOOKAHEAD_POLICIES, LOOKAHEAD_STEPS, PEERS, POLICIES, BatchSampler, StepPlan
from ..cost.model import CostModel
from .density import DensityModel, Knowledge

TuningHook = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""(predicted times [ranks, grid], grid [budgets ascending]) -> per-rank budgets [ranks]."""

TUNING_MODES = ("none", "straggler-only", "bidirectional", "layer")


def tuner_hook(mode: str, default_budget: float, min_budget: float, max_budget: float, target: str = "mean",
               tolerance: float = 0.0) -> TuningHook | None:
    """The balancer's own per-step tuner (`balancer.tuner.tune`) as a hook; None where the step keeps
    the default budget (mode `none`; `layer` with target `fill`, which only tunes inside the step)."""
    from ..balancer.tuner import step_tuning_mode, tune

    step_mode = step_tuning_mode(mode, target)  # layer: the per-step decision, then in-step
    if step_mode == "none":
        return None

    def hook(times: np.ndarray, grid: np.ndarray) -> np.ndarray:
        return tune(times, grid, default_budget, min_budget, max_budget, mode=step_mode, target=target,
                    tolerance=tolerance).budgets

    return hook


def budget_grid(min_budget: float, max_budget: float, default_budget: float, points: int) -> np.ndarray:
    from ..balancer.tuner import budget_grid as grid

    return grid(min_budget, max_budget, default_budget, points)


def flops_a_of(cost: CostModel, density: float = 1.0) -> float:
    """`a` of the FLOP proxy a*L + L^2 that matches a cost model's dense time (peers see no sparsity)."""
    L = np.array([2048.0, 8192.0])
    t = np.asarray(cost.doc_times(L, np.full(2, density)), dtype=np.float64)
    # t = c1 L + c2 L^2  ->  solve the 2x2 system
    A = np.stack([L, L * L], axis=1)
    c1, c2 = np.linalg.solve(A, t)
    if not (np.isfinite(c1) and np.isfinite(c2)) or c2 <= 0 or c1 <= 0:
        from ..batching import DEFAULT_FLOPS_A

        return DEFAULT_FLOPS_A
    return float(c1 / c2)


@dataclass
class SimConfig:
    world_size: int
    docs_per_rank: int = 4
    token_cap: int = 131072
    seed: int = 0
    policies: tuple[str, ...] = POLICIES
    tuning: tuple[str, ...] = ("none", "bidirectional")
    knowledge: Knowledge = "none"
    default_budget: float = 0.5
    min_budget: float = 0.1
    max_budget: float = 0.9
    grid_points: int = 17
    target: str = "mean"
    tolerance: float = BalanceConfig.model_fields["tolerance"].default
    steps: int | None = None  # None: one full epoch
    lookahead_steps: int = LOOKAHEAD_STEPS
    peers: tuple[str, ...] = PEERS  # the policies whose fastest is the fair peer (each must be in `policies`)
    record_steps: int = 4
    flops_a: float | None = None


@dataclass
class PolicyResult:
    policy: str
    tuning: str
    lookahead: int
    knowledge: str
    steps: int
    epoch_time: float
    step_time: float
    imbalance: float
    imbalance_step_mean: float
    bubble: float
    vs_peer: float = float("nan")
    peer: str = ""
    vs_peer_untuned: float = float("nan")
    vs_random: float = float("nan")
    mean_budget: float = float("nan")
    budget_spread: float = float("nan")
    mean_density: float = float("nan")
    attention_share: float = float("nan")
    micro_batches: float = float("nan")
    plan_seconds: float = 0.0
    rank_loads: list[list[float]] = field(default_factory=list)  # first record_steps steps, per rank

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SimResult:
    config: SimConfig
    num_docs: int
    cost_model: dict[str, Any]
    rows: list[PolicyResult]

    def row(self, policy: str, tuning: str = "none") -> PolicyResult:
        for r in self.rows:
            if r.policy == policy and r.tuning == tuning:
                return r
        raise KeyError((policy, tuning))

    def to_dict(self) -> dict[str, Any]:
        return {"config": asdict(self.config), "num_docs": self.num_docs, "cost_model": self.cost_model,
                "rows": [r.to_dict() for r in self.rows]}


def _describe(cost: Any) -> dict[str, Any]:
    try:
        return dict(cost.describe())
    except Exception:
        return {"kind": type(cost).__name__}


def _flatten(plan: StepPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    docs, ranks, mbs = [], [], []
    gm = 0
    for r, rank_mbs in enumerate(plan.micro_batches):
        for mb in rank_mbs:
            if mb:
                docs.extend(mb)
                ranks.extend([r] * len(mb))
                mbs.extend([gm] * len(mb))
                gm += 1
    return (np.asarray(docs, dtype=np.int64), np.asarray(ranks, dtype=np.int64), np.asarray(mbs, dtype=np.int64))


def simulate(
    lengths: np.ndarray,
    cost: CostModel,
    density: DensityModel,
    config: SimConfig,
    hooks: dict[str, TuningHook | None] | None = None,
) -> SimResult:
    """Replay `config.steps` (default: one epoch) for every policy and tuning mode."""
    lengths = np.asarray(lengths, dtype=np.int64)
    R = int(config.world_size)
    b0 = float(config.default_budget)
    grid = budget_grid(config.min_budget, config.max_budget, b0, config.grid_points)
    if hooks is None:
        hooks = {m: tuner_hook(m, b0, config.min_budget, config.max_budget, config.target, config.tolerance) for m in config.tuning}
    flops_a = config.flops_a if config.flops_a is not None else flops_a_of(cost)
    predict = density.predictor(config.knowledge)

    def doc_cost(idx: np.ndarray) -> np.ndarray:
        return np.asarray(cost.doc_times(lengths[idx], predict(idx, b0)), dtype=np.float64)

    step_overhead = float(getattr(cost, "step_overhead", 0.0) or 0.0)
    attention_times = getattr(cost, "attention_times", None)
    rows: list[PolicyResult] = []
    for policy in config.policies:
        sampler = BatchSampler(lengths, R, policy, config.token_cap, config.docs_per_rank, config.seed, doc_cost,
                               flops_a=flops_a, lookahead_steps=config.lookahead_steps)
        n_steps = sampler.steps_per_epoch if config.steps is None else min(int(config.steps), sampler.steps_per_epoch)
        t0 = time.perf_counter()
        plans = [sampler.plan(0, s) for s in range(n_steps)]
        plan_seconds = time.perf_counter() - t0
        acc = {m: {"max": [], "mean": [], "dens_num": 0.0, "dens_den": 0.0, "loads": [],
                   "b_num": 0.0, "b_sq": 0.0, "attn": 0.0, "doc_time": 0.0} for m in hooks}
        n_mb = []
        for s, plan in enumerate(plans):
            n_mb.append(plan.num_micro_batches)
            docs, ranks, mbs = _flatten(plan)
            L = lengths[docs]
            n_real = int(mbs.max()) + 1 if mbs.size else 0
            # non-additive part of each micro-batch (overheads), taken at the default budget
            d0 = predict(docs, b0)
            add0 = np.asarray(cost.doc_times(L, d0), dtype=np.float64)
            corr_r = np.zeros(R)
            if n_real:
                starts = np.flatnonzero(np.r_[True, mbs[1:] != mbs[:-1]])
                ends = np.r_[starts[1:], mbs.size]
                for a, e in zip(starts.tolist(), ends.tolist()):
                    c = float(cost.micro_batch_time(L[a:e], d0[a:e])) - float(add0[a:e].sum())
                    corr_r[ranks[a]] += c
            for mode, hook in hooks.items():
                if hook is None or docs.size == 0:
                    budgets = np.full(R, b0)
                else:
                    G = grid.size
                    dg = predict(np.repeat(docs, G), np.tile(grid, docs.size)).reshape(docs.size, G)
                    tg = np.asarray(cost.doc_times(np.repeat(L, G), dg.reshape(-1)), dtype=np.float64).reshape(docs.size, G)
                    pred = np.zeros((R, G))
                    np.add.at(pred, ranks, tg)
                    pred += corr_r[:, None]
                    has = np.bincount(ranks, minlength=R) > 0
                    budgets = np.full(R, b0)
                    sub = np.asarray(hook(pred[has], grid), dtype=np.float64)
                    budgets[has] = sub
                bd = budgets[ranks]
                dt = density.true(docs, bd)
                t_docs = np.asarray(cost.doc_times(L, dt), dtype=np.float64)
                compute = np.bincount(ranks, weights=t_docs, minlength=R) + corr_r
                if mode == "layer" and docs.size:
                    budgets, compute, dt = _layer_correction(budgets, compute, dt, docs, ranks, L, corr_r, cost,
                                                             density, config.min_budget, config.max_budget,
                                                             config.target)
                a = acc[mode]
                a["max"].append(float(compute.max()))
                a["mean"].append(float(compute.mean()))
                a["dens_num"] += float((dt * L).sum())
                a["dens_den"] += float(L.sum())
                a["b_num"] += float((budgets[ranks] * L).sum())
                a["b_sq"] += float((budgets[ranks] ** 2 * L).sum())
                if attention_times is not None:
                    a["attn"] += float(np.sum(attention_times(L, dt)))
                    a["doc_time"] += float(np.sum(cost.doc_times(L, dt)))
                if s < config.record_steps:
                    a["loads"].append(compute.tolist())
        for mode, a in acc.items():
            mx, mn = np.asarray(a["max"]), np.asarray(a["mean"])
            epoch = float(mx.sum() + step_overhead * len(mx))
            with np.errstate(invalid="ignore", divide="ignore"):
                per_step = np.where(mn > 0, mx / np.where(mn > 0, mn, 1.0), 1.0)
            rows.append(PolicyResult(
                policy=policy, tuning=mode, lookahead=sampler.lookahead_steps, knowledge=config.knowledge,
                steps=len(mx), epoch_time=epoch,
                step_time=epoch / max(len(mx), 1),
                imbalance=float(mx.sum() / mn.sum()) if mn.sum() > 0 else 1.0,
                imbalance_step_mean=float(per_step.mean()) if per_step.size else 1.0,
                bubble=float(1.0 - mn.sum() / mx.sum()) if mx.sum() > 0 else 0.0,
                mean_budget=a["b_num"] / a["dens_den"] if a["dens_den"] else b0,
                mean_density=a["dens_num"] / a["dens_den"] if a["dens_den"] else float("nan"),
                budget_spread=_weighted_std(a["b_num"], a["b_sq"], a["dens_den"]),
                attention_share=a["attn"] / a["doc_time"] if a["doc_time"] > 0 else float("nan"),
                micro_batches=float(np.mean(n_mb)) if n_mb else 0.0,
                plan_seconds=plan_seconds, rank_loads=a["loads"],
            ))
    base = next((r for r in rows if r.policy == "random" and r.tuning == "none"), None)
    for r in rows:
        r.vs_random = base.epoch_time / r.epoch_time if base is not None and r.epoch_time > 0 else float("nan")
        peers = [p for p in rows if p.policy in config.peers and p.tuning == r.tuning]
        if peers:
            best = min(peers, key=lambda p: p.epoch_time)
            r.peer, r.vs_peer = best.policy, best.epoch_time / r.epoch_time
        untuned = [p for p in rows if p.policy in config.peers and p.tuning == "none"]
        if untuned:
            r.vs_peer_untuned = min(p.epoch_time for p in untuned) / r.epoch_time
    return SimResult(config, int(lengths.size), _describe(cost), rows)


def _weighted_std(total: float, squares: float, weight: float) -> float:
    if weight <= 0:
        return float("nan")
    mean = total / weight
    return float(np.sqrt(max(squares / weight - mean * mean, 0.0)))


def _layer_correction(budgets, compute, dt, docs, ranks, L, corr_r, cost, density, min_budget, max_budget, rule):
    """Layer-level DST on true work: each rank's time now, at MIN and at MAX, the shared rule, linear moves."""
    R = budgets.size

    def rank_times(b):
        d = density.true(docs, np.full(docs.size, b) if np.isscalar(b) else b[ranks])
        t = np.asarray(cost.doc_times(L, d), dtype=np.float64)
        return np.bincount(ranks, weights=t, minlength=R) + corr_r, d

    lo, d_lo = rank_times(float(min_budget))
    hi, d_hi = rank_times(float(max_budget))
    busy = np.bincount(ranks, minlength=R) > 0
    rows = np.stack([compute, lo, hi], axis=1) * busy[:, None]
    target = layer_target(rows, rule)
    alpha = np.array([move_toward(target, *rows[r].tolist()) if busy[r] else 0.0 for r in range(R)])
    new_compute = np.where(alpha < 0, compute + alpha * (compute - lo), compute + alpha * (hi - compute))
    new_budgets = np.where(alpha < 0, budgets + alpha * (budgets - min_budget), budgets + alpha * (max_budget - budgets))
    a = alpha[ranks]
    new_dt = np.where(a < 0, dt + a * (dt - d_lo), dt + a * (d_hi - dt))
    return new_budgets, new_compute, new_dt


def simulate_ranks(
    lengths: np.ndarray,
    cost: CostModel,
    density: DensityModel,
    config: SimConfig,
    world_sizes: Sequence[int],
) -> list[SimResult]:
    """`simulate` at several world sizes (same documents, densities and settings)."""
    out = []
    for R in world_sizes:
        cfg = SimConfig(**{**asdict(config), "world_size": int(R)})
        out.append(simulate(lengths, cost, density, cfg))
    return out


def time_partition(
    num_docs: int = 100_000,
    world_size: int = 1024,
    docs_per_rank: int = 4,
    policies: Sequence[str] = POLICIES,
    token_cap: int = 131072,
    seed: int = 0,
    cost: CostModel | None = None,
) -> dict[str, dict[str, float]]:
    """Seconds to plan every step of an epoch of `num_docs` lognormal documents, per policy.

    Also times one window holding every document (`docs_per_rank = ceil(num_docs / world_size)`).
    """
    from ..cost.model import AnalyticCostModel
    from .lengths import synthetic_lengths

    cost = cost or AnalyticCostModel.llama_8b()
    L = synthetic_lengths(num_docs, 4096, 1.2, token_cap, seed)
    doc_cost = lambda idx: np.asarray(cost.doc_times(L[idx], 0.3), dtype=np.float64)  # noqa: E731
    out: dict[str, dict[str, float]] = {}
    one_window = -(-num_docs // world_size)
    for policy in policies:
        row: dict[str, float] = {}
        for label, dpr in (("epoch", docs_per_rank), ("one_window", one_window)):
            t0 = time.perf_counter()
            s = BatchSampler(L, world_size, policy, token_cap, dpr, seed, doc_cost)
            for step in range(s.steps_per_epoch):
                s.plan(0, step)
            row[label] = time.perf_counter() - t0
            row[f"{label}_steps"] = s.steps_per_epoch
        out[policy] = row
    return out
