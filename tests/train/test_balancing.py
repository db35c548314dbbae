"""The trainer's balancing glue: report-to-document mapping and per-document predictions in the tuner's order."""
from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

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


@pytest.mark.slow
def test_layer_tuning_on_two_ranks_with_uneven_micro_batches_and_a_second_epoch(write_recipe, tmp_path):
    """`sbft train --nproc 2` with balance.tuning: layer: ranks whose micro-batch counts differ still meet at
    every layer's exchange; the second epoch runs on remembered per-document densities."""
    from transformers import AutoTokenizer

    from sparsebalance_ft.batching import BatchSampler
    from sparsebalance_ft.data import load_corpus
    from sparsebalance_ft.recipe import load_recipe
    from sparsebalance_ft.train.metrics import read_metrics

    path = write_recipe(
        model={"attn_implementation": "sparsebalance"},
        sparsity={"k_max": 4, "k_min": 2, "block_size": 16, "recall_samples": 1},
        balance={"batching": "length-grouped", "tuning": "layer", "lookahead_steps": 2},
        data={"max_documents": 12, "max_seq_len": 256},
        training={"max_steps": 4, "docs_per_rank": 3, "micro_batch_tokens": 256},
    )
    recipe = load_recipe(path)
    corpus = load_corpus(recipe.data, AutoTokenizer.from_pretrained(recipe.model.path))
    sampler = BatchSampler(corpus.lengths, 2, "length-grouped", recipe.token_cap, 3, recipe.training.seed,
                           lookahead_steps=2)
    real = [[sum(1 for mb in plan.micro_batches[r] if mb) for r in (0, 1)] for plan in
            (sampler.plan(e, s) for e in (0, 1) for s in range(2))]
    assert any(a != b for a, b in real), real  # the setting really gives the ranks different counts

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "sbft_cli.app", "train", str(path), "--nproc", "2"],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all(row["layer_exchange_seconds"] >= 0 for row in rows)
    assert [row["density_remembered_share"] for row in rows] == [0.0, 0.0, 1.0, 1.0]  # epoch 2: all seen
    assert all(row["density_error_docs"] > 0 for row in rows)
