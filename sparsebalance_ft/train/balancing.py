"""Assemble what decides the work of each rank: the batch sampler, the cost model and density
statistics, the balancer service and the sparse attention's budget controller.

The training loop sees only three calls per step: `sampler.plan(...)`, `before_step(...)` (the
budget decision, a collective when a balancer runs) and `after_step(...)` (the attention
report fed back into the statistics, also a collective then). With dense attention there is
no budget to tune, so no balancer runs and both calls are local no-ops.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..batching import BatchSampler, doc_cost_from_densities, doc_cost_from_stats
from ..recipe import Recipe


@dataclass
class StepDecision:
    budget: float = math.nan
    predicted_time: float = math.nan


@dataclass
class AttentionSummary:
    density: float = math.nan
    recall: float = math.nan


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


class Balancing:
    def __init__(self, sampler: BatchSampler, lengths: np.ndarray, controller=None, service=None):
        self.sampler = sampler
        self.lengths = lengths
        self.controller = controller
        self.service = service

    def before_step(self, micro_batches: list[list[int]]) -> StepDecision:
        """Pick this rank's budget for the step (all ranks must call it) and set it on the attention."""
        if self.service is None:
            return StepDecision()
        decision = self.service.decide([[int(self.lengths[i]) for i in mb] for mb in micro_batches])
        self.controller.set_budget(decision.budget)
        return StepDecision(budget=decision.rank_budget, predicted_time=decision.predicted_time)

    def after_step(self, compute_time: float, wait_time: float) -> AttentionSummary:
        """Feed the attention's report to the statistics (all ranks must call it) and summarise it."""
        if self.controller is None:
            return AttentionSummary()
        report = self.controller.pop_report()
        if self.service is not None:
            self.service.observe(report, compute_time, wait_time)
        return AttentionSummary(density=_or_nan(report.mean_density), recall=_or_nan(report.mean_recall))

    def state_dict(self) -> dict:
        """The sampler's too: a `sparsebalance` group's order is fixed when its first step is planned."""
        return {
            "sampler": self.sampler.state_dict(),
            "balancer": self.service.state_dict() if self.service is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("sampler") is not None:
            self.sampler.load_state_dict(state["sampler"])
        if self.service is not None and state.get("balancer") is not None:
            self.service.load_state_dict(state["balancer"])


def build_balancing(recipe: Recipe, model, lengths: np.ndarray, world_size: int) -> Balancing:
    """The recipe's batching policy and, with sparse attention, its controller and balancer."""
    balance, sparse = recipe.balance, recipe.model.attn_implementation == "sparsebalance"
    controller = service = doc_cost = None
    if sparse or balance.batching == "sparsebalance":
        from ..cost.model import load_cost_model
        from ..cost.stats import DensityStats

        cost_model = load_cost_model(recipe, model_config=model.config)
        if sparse:
            from ..attention import SparseAttentionController
            from ..balancer.service import BalancerService

            controller = SparseAttentionController.attach(model, recipe.sparsity)
            stats = DensityStats(recipe.sparsity, num_layers=model.config.num_hidden_layers)
            service = BalancerService.from_recipe(recipe, cost_model, stats, num_layers=model.config.num_hidden_layers)
            doc_cost = doc_cost_from_stats(cost_model, stats, lengths, recipe.sparsity.budget)
        else:
            doc_cost = doc_cost_from_densities(cost_model, lengths, np.ones(len(lengths)))
    sampler = BatchSampler(
        lengths,
        world_size,
        policy=balance.batching,
        token_cap=recipe.token_cap,
        docs_per_rank=recipe.training.docs_per_rank,
        seed=recipe.training.seed,
        doc_cost=doc_cost,
    )
    return Balancing(sampler, lengths, controller, service)
