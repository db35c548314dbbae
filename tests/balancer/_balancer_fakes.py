"""Stand-ins for the cost model and density statistics (the balancer tests only need their contracts)."""
from __future__ import annotations

import numpy as np


class FakeCost:
    """t(doc) = a*L + c*density*L^2, plus a fixed overhead per micro-batch."""

    def __init__(self, a: float = 1e-6, c: float = 1e-9, overhead: float = 1e-3):
        self.a, self.c, self.overhead = a, c, overhead

    def doc_times(self, lengths, densities):
        lengths = np.asarray(lengths, dtype=np.float64)
        return self.a * lengths + self.c * np.asarray(densities, dtype=np.float64) * lengths**2

    def micro_batch_time(self, lengths, densities) -> float:
        return self.overhead + float(self.doc_times(lengths, densities).sum())


class FakeStats:
    """density = budget ** p: monotone in budget, 1 at budget 1."""

    def __init__(self, power: float = 1.5):
        self.power = power
        self.observed: list[tuple] = []
        self.syncs = 0

    def expected(self, lengths, budget):
        return np.broadcast_to(np.asarray(budget, dtype=np.float64), np.asarray(lengths).shape) ** self.power

    def observe(self, lengths, densities, budget):
        self.observed.append((np.asarray(lengths).tolist(), np.asarray(densities).tolist(), float(budget)))

    def observe_report(self, report, budget):
        """Like DensityStats: the report's finite (length, density) pairs, at `budget`."""
        pairs = [(float(n), float(d)) for n, d in report.doc_densities]
        kept = [(n, d) for n, d in pairs if np.isfinite(n) and np.isfinite(d)]
        if kept:
            self.observe([int(n) for n, _ in kept], [d for _, d in kept], budget)

    def sync(self):
        self.syncs += 1

    def state_dict(self):
        return {"power": self.power, "observed": list(self.observed)}

    def load_state_dict(self, state):
        self.power = state["power"]
        self.observed = list(state["observed"])


class BrokenCost(FakeCost):
    def micro_batch_time(self, lengths, densities) -> float:
        raise RuntimeError("profile table missing")


class NanCost(FakeCost):
    def micro_batch_time(self, lengths, densities) -> float:
        return float("nan")


def report(doc_densities, layer_recall=None):
    """An attention report as the controller gives it, with only what the balancer reads."""
    from sparsebalance_ft.attention import AttentionReport

    recall = list(layer_recall) if layer_recall is not None else []
    return AttentionReport(
        layer_density=[None] * len(recall), layer_recall=recall, doc_densities=doc_densities, layer_budget=[]
    )
