"""Sparsity-aware batching: policies and the deterministic distributed batch sampler."""
from .errors import BatchingError, DocumentTooLongError
from .kk import karmarkar_karp, lpt
from .policies import DEFAULT_FLOPS_A, POLICIES, assign_ranks, flops_proxy, plan_window, refine
from .sampler import (
    BUCKET_STEPS,
    BatchSampler,
    DocCost,
    StepPlan,
    doc_cost_flops,
    doc_cost_from_densities,
    doc_cost_from_stats,
)

__all__ = [
    "BUCKET_STEPS",
    "BatchSampler",
    "BatchingError",
    "DEFAULT_FLOPS_A",
    "DocCost",
    "DocumentTooLongError",
    "POLICIES",
    "StepPlan",
    "assign_ranks",
    "doc_cost_flops",
    "doc_cost_from_densities",
    "doc_cost_from_stats",
    "flops_proxy",
    "karmarkar_karp",
    "lpt",
    "plan_window",
    "refine",
]
