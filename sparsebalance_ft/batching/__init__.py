"""Sparsity-aware batching: policies and the deterministic distributed batch sampler."""
from .errors import BatchingError, DocumentTooLongError
from .kk import karmarkar_karp, karmarkar_karp_equal, lpt
from .lookahead import regroup_windows
from .policies import (
    DEFAULT_FLOPS_A,
    LOOKAHEAD_POLICIES,
    PEERS,
    POLICIES,
    VERL_FLOPS_A,
    assign_ranks,
    flops_proxy,
    plan_window,
    refine,
)
from .sampler import (
    LOOKAHEAD_STEPS,
    BatchSampler,
    DocCost,
    StepPlan,
    doc_cost_flops,
    doc_cost_from_densities,
    doc_cost_from_stats,
)

__all__ = [
    "BatchSampler",
    "BatchingError",
    "DEFAULT_FLOPS_A",
    "DocCost",
    "DocumentTooLongError",
    "LOOKAHEAD_POLICIES",
    "LOOKAHEAD_STEPS",
    "PEERS",
    "POLICIES",
    "StepPlan",
    "VERL_FLOPS_A",
    "assign_ranks",
    "doc_cost_flops",
    "doc_cost_from_densities",
    "doc_cost_from_stats",
    "flops_proxy",
    "karmarkar_karp",
    "karmarkar_karp_equal",
    "lpt",
    "plan_window",
    "refine",
    "regroup_windows",
]
