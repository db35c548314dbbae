"""Cluster simulator: replays the batching policies, the tuner and the cost model without a model."""
from .density import DensityModel, load_density_stats
from .lengths import SimInputError, apply_cap, lengths_from_recipe, lengths_from_text_dir, load_lengths, synthetic_lengths
from .simulator import (
    NO_BUCKET,
    TUNING_MODES,
    PolicyResult,
    SimConfig,
    SimResult,
    TuningHook,
    flops_a_of,
    simulate,
    simulate_ranks,
    time_partition,
    tuner_hook,
)

__all__ = [
    "DensityModel",
    "NO_BUCKET",
    "PolicyResult",
    "SimConfig",
    "SimInputError",
    "SimResult",
    "TUNING_MODES",
    "TuningHook",
    "apply_cap",
    "flops_a_of",
    "lengths_from_recipe",
    "lengths_from_text_dir",
    "load_density_stats",
    "load_lengths",
    "simulate",
    "simulate_ranks",
    "synthetic_lengths",
    "time_partition",
    "tuner_hook",
]
