"""The trainer's balancing glue: report-to-document mapping and per-document predictions in the tuner's order."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from sparsebalance_ft.balancer.service import predict_times
from sparsebalance_ft.cost.documents import DocumentDensities
from sparsebalance_ft.cost.model import AnalyticCostModel
from sparsebalance_ft.train.balancing import KnownDensities, report_documents


class LengthModel:
    def expected(self, lengths, budget):
        return np.broadcast_to(0.5 * np.asarray(budget, dtype=float), np.shape(lengths)).copy()


def test_report_densities_map_to_documents_in_forward_order():
    lengths = np.array([100, 200, 300, 400])
    report = SimpleNamespace(doc_densities=[(300, 0.2), (100, 0.4), (400, 0.6)])
    assert report_documents(report, [[2, 0], [3]], lengths) == {2: 0.2, 0: 0.4, 3: 0.6}
    assert report_documents(report, [[0, 2], [3]], lengths) == {}  # lengths disagree: nothing is remembered
    assert report_documents(SimpleNamespace(doc_densities=[]), [[0]], lengths) == {}


def test_known_densities_follow_the_documents_through_the_budget_grid():
    stats = LengthModel()
    lengths = np.array([4096, 4096, 8192])
    knowledge = DocumentDensities(lengths)
    knowledge.observe(np.array([1]), np.array([0.05]), np.array([0.5]), stats)  # doc 1 is far sparser than doc 0
    cost = AnalyticCostModel.llama_8b()
    grid = np.array([0.2, 0.5, 0.8])
    sparse_doc = predict_times(cost, KnownDensities(knowledge, stats, [1]), [[4096]], grid)
    other_doc = predict_times(cost, KnownDensities(knowledge, stats, [0]), [[4096]], grid)
    assert np.all(sparse_doc < other_doc)
    both = predict_times(cost, KnownDensities(knowledge, stats, [0, 1, 2]), [[4096, 4096], [8192]], grid)
    alone = predict_times(cost, KnownDensities(knowledge, stats, [2]), [[8192]], grid)
    with_two = predict_times(cost, KnownDensities(knowledge, stats, [0, 1]), [[4096, 4096]], grid)
    assert np.allclose(both, with_two + alone)
