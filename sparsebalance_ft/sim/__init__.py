"""Cluster simulator: replays the batching policies, the tuner and the cost model without a model."""
from .calibration import Calibration, calibrate, load_calibration
from .density import KNOWLEDGE, DensityModel, load_density_stats
from .lengths import SimInputError, apply_cap, long_tail_lengths, lengths_from_recipe, lengths_from_text_dir, load_lengths, synthetic_lengths
from .simulator import (
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
    "KNOWLEDGE",
    "Calibration",
    "calibrate",
    "load_calibration",
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
    "long_tail_lengths",
    "simulate",
    "simulate_ranks",
    "synthetic_lengths",
    "time_partition",
    "tuner_hook",
]
