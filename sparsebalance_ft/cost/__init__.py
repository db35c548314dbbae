"""Latency cost model: profiled or analytic predictor of micro-batch time, and density statistics.

The only place batching, balancer and simulator consult for time (see docs/seams.md).
"""
from .model import (
    AnalyticCostModel,
    CostModel,
    OutOfProfileError,
    ProfiledCostModel,
    ProfileError,
    ProfileExtrapolationWarning,
    ProfileMismatchWarning,
    load_cost_model,
)
from .stats import DensityStats

__all__ = [
    "AnalyticCostModel",
    "CostModel",
    "DensityStats",
    "OutOfProfileError",
    "ProfiledCostModel",
    "ProfileError",
    "ProfileExtrapolationWarning",
    "ProfileMismatchWarning",
    "load_cost_model",
]
