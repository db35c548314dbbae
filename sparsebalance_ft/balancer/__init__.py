"""Dynamic sparsity tuning: the pure tuner and the per-step balancer service."""
from .config import BalanceConfig, BalanceConfigError
from .tuner import TuneResult, budget_grid, layer_budgets, tune

__all__ = [
    "BalanceConfig",
    "BalanceConfigError",
    "TuneResult",
    "budget_grid",
    "layer_budgets",
    "tune",
    "BalancerService",
    "BalanceDecision",
]


def __getattr__(name):  # the service pulls in torch; import it only when asked for
    if name in ("BalancerService", "BalanceDecision"):
        from . import service

        return getattr(service, name)
    raise AttributeError(name)
