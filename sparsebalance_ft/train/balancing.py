"""Assemble what decides the work of each rank: the batch sampler, the cost model and density
knowledge (length statistics plus remembered/predicted per-document densities), the balancer
service, the layer tuner and the sparse attention's budget controller.

The training loop sees four calls per step: `sampler.plan(...)`, `before_step(...)` (the budget
decision, a collective when a balancer runs), `finish_micro_batches()` (after the rank's last
micro-batch: joins the layer exchanges it has no work for, with `balance.tuning: layer`) and
`after_step(...)` (the attention report fed back into the statistics and the per-document
densities, collectives too). With dense attention there is no budget to tune, so no balancer runs
and all calls are local no-ops.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ..batching import BatchSampler, doc_cost_from_densities
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


class KnownDensities:
    """`expected(lengths, budget)` for one rank's documents, in the order `predict_times` asks for them
    (its micro-batches concatenated, tiled once per budget): per-document knowledge, not length alone."""

    def __init__(self, knowledge, stats, docs: np.ndarray):
        self.knowledge, self.stats, self.docs = knowledge, stats, np.asarray(docs, dtype=np.int64)

    def expected(self, lengths: np.ndarray, budget) -> np.ndarray:
        reps = max(1, np.asarray(lengths).size // max(self.docs.size, 1))
        return self.knowledge.expected(np.tile(self.docs, reps), budget, self.stats)


def report_documents(report, micro_batches: list[list[int]], lengths: np.ndarray) -> dict[int, float]:
    """Map the report's per-document densities (in forward order) to document indices; {} if they disagree."""
    docs = [d for mb in micro_batches for d in mb]
    pairs = list(report.doc_densities or [])
    if len(pairs) != len(docs) or any(int(lengths[d]) != int(n) for d, (n, _) in zip(docs, pairs)):
        return {}
    return {int(d): float(density) for d, (_, density) in zip(docs, pairs)}


class Balancing:
    def __init__(self, sampler: BatchSampler, lengths: np.ndarray, controller=None, service=None, knowledge=None,
                 layer_costs=None):
        self.sampler = sampler
        self.lengths = lengths
        self.controller = controller
        self.service = service
        self.knowledge = knowledge
        self.layer_costs = layer_costs  # micro-batch lengths -> LayerCost, with balance.tuning: layer
        self._mine: list[list[int]] = []
        self._budget = math.nan
        self._metrics: dict[str, float] = {}

    @property
    def layer_tuner(self):
        return getattr(self.controller, "layer_tuner", None) if self.controller is not None else None

    def before_step(self, micro_batches: list[list[int]]) -> StepDecision:
        """Pick this rank's budget for the step (all ranks must call it) and set it on the attention."""
        self._mine = [list(mb) for mb in micro_batches]
        if self.service is None:
            return StepDecision()
        lengths = [[int(self.lengths[i]) for i in mb] for mb in micro_batches]
        known = None
        if self.knowledge is not None:
            known = KnownDensities(self.knowledge, self.service.stats, [d for mb in micro_batches for d in mb])
        decision = self.service.decide(lengths, densities=known)
        self.controller.set_budget(decision.budget)
        self._budget = decision.rank_budget
        if self.layer_tuner is not None:
            real = [np.asarray(mb, dtype=np.int64) for mb in lengths if mb]
            self.layer_tuner.begin_step([self.layer_costs(mb) for mb in real], len(micro_batches))
        return StepDecision(budget=decision.rank_budget, predicted_time=decision.predicted_time)

    def finish_micro_batches(self) -> None:
        """After this rank's last micro-batch, before the gradient exchange (all ranks must call it)."""
        if self.layer_tuner is not None:
            self.layer_tuner.finish_step()

    @contextmanager
    def padding_forward(self, model):
        """Around a sharded model's padding forward (a micro-batch this rank lacks): each sparse layer joins
        its exchange with zero work when it runs, in the same order as the other ranks' collectives (the
        layers' weight gathers come between exchanges, so joining them all afterwards would deadlock)."""
        tuner = self.layer_tuner
        if tuner is None:
            yield
            return
        from ..attention.register import bound_attention_modules, in_backward

        def join(module, args):
            if not in_backward():  # a gradient-checkpoint recompute exchanges nothing
                tuner.join_exchange()

        modules = [m for m in bound_attention_modules(model, self.controller)
                   if int(m.layer_idx) not in self.controller.dense_layers]
        handles = [m.register_forward_pre_hook(join) for m in modules]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def after_step(self, compute_time: float, wait_time: float) -> AttentionSummary:
        """Feed the attention's report to the statistics (all ranks must call it) and summarise it."""
        if self.controller is None:
            return AttentionSummary()
        report = self.controller.pop_report()
        if self.service is not None:
            self.service.observe(report, compute_time, wait_time)
            if self.knowledge is not None:
                self._observe_documents(report)
        if self.layer_tuner is not None:
            self._metrics.update(self.layer_tuner.pop_stats())
        return AttentionSummary(density=_or_nan(report.mean_density), recall=_or_nan(report.mean_recall))

    def _observe_documents(self, report) -> None:
        from ..cost.documents import sync_step_observations

        stats = self.service.stats
        plan = self.sampler.last_plan
        mine = report_documents(report, [mb for mb in self._mine if mb], self.lengths)
        sparse = np.array(list(mine.values()), dtype=np.float64)
        if sparse.size:
            sparse = stats.sparse_only(sparse)
        ran = {d: (float(x), self._budget) for d, x in zip(mine, sparse.tolist())}
        docs, dens, budgets = sync_step_observations(plan.all_docs(), ran, self.service.group)  # every rank
        self._metrics["density_remembered_share"] = self.knowledge.remembered_share(plan.all_docs())
        self.knowledge.observe(docs, dens, budgets, stats)
        self._metrics.update(self.knowledge.pop_errors())

    def step_metrics(self) -> dict[str, float]:
        """Balancing figures of the last step for metrics.jsonl (identical on every rank but the exchange time)."""
        out, self._metrics = self._metrics, {}
        return out

    def state_dict(self) -> dict:
        """The sampler's too: a look-ahead block's order is fixed when its first step is planned."""
        return {
            "sampler": self.sampler.state_dict(),
            "balancer": self.service.state_dict() if self.service is not None else None,
            "documents": self.knowledge.state_dict() if self.knowledge is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("sampler") is not None:
            self.sampler.load_state_dict(state["sampler"])
        if self.service is not None and state.get("balancer") is not None:
            self.service.load_state_dict(state["balancer"])
        if self.knowledge is not None and state.get("documents") is not None:
            self.knowledge.load_state_dict(state["documents"])


def layer_cost_of(cost_model, num_layers: int, kv_heads: int, block_size: int):
    """micro-batch lengths -> LayerCost: the cost model's attention-free share per layer, and its
    attention seconds per kept (query block, key block, kv head) of one layer."""
    from ..balancer.layer_tuning import LayerCost

    def cost(lengths: np.ndarray) -> LayerCost:
        L = np.asarray(lengths, dtype=np.int64)
        linear = float(cost_model.micro_batch_time(L, np.zeros(L.size)))
        attention = float(cost_model.micro_batch_time(L, np.ones(L.size))) - linear
        nb = np.ceil(L / block_size)
        blocks = float((nb * (nb + 1) / 2).sum()) * kv_heads * num_layers
        return LayerCost(linear / num_layers, attention / max(blocks, 1.0))

    return cost


def build_balancing(recipe: Recipe, model, lengths: np.ndarray, world_size: int, documents=None) -> Balancing:
    """The recipe's batching policy and, with sparse attention, its controller, balancer and density knowledge.

    `documents[i]` (token ids) gives the per-document features of the density predictor; without it
    the predictor sees length only.
    """
    balance, sparse = recipe.balance, recipe.model.attn_implementation == "sparsebalance"
    controller = service = doc_cost = knowledge = layer_costs = None
    if sparse or balance.batching == "sparsebalance":
        from ..cost.model import load_cost_model
        from ..cost.stats import DensityStats

        cost_model = load_cost_model(recipe, model_config=model.config)
        if sparse:
            from ..attention import SparseAttentionController
            from ..balancer.service import BalancerService
            from ..cost.documents import DocumentDensities

            layers = model.config.num_hidden_layers
            controller = SparseAttentionController.attach(model, recipe.sparsity)
            stats = DensityStats(recipe.sparsity, num_layers=layers)
            service = BalancerService.from_recipe(recipe, cost_model, stats, num_layers=layers)
            knowledge = (DocumentDensities.from_tokens(lengths, documents) if documents is not None
                         else DocumentDensities(lengths))
            budget = recipe.sparsity.budget

            def doc_cost(idx: np.ndarray) -> np.ndarray:
                return np.asarray(cost_model.doc_times(lengths[idx], knowledge.expected(idx, budget, stats)))

            if balance.tuning == "layer":
                from ..balancer.layer_tuning import LayerTuner

                kv_heads = int(getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads)
                controller.layer_tuner = LayerTuner(balance.min_budget, balance.max_budget, layers,
                                                    controller.dense_layers, target=balance.target)
                layer_costs = layer_cost_of(cost_model, layers, kv_heads, recipe.sparsity.block_size)
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
        lookahead_steps=balance.lookahead_steps,
    )
    return Balancing(sampler, lengths, controller, service, knowledge, layer_costs)
