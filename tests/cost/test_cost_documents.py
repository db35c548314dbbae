"""Per-document density knowledge: remembered, predicted from features, reported, checkpointed, synced."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from sparsebalance_ft.cost.documents import (
    DocumentDensities,
    document_features,
    feature_matrix,
    sync_step_observations,
)


class LengthModel:
    """A stand-in for DensityStats.expected: 0.6 x budget, whatever the length."""

    def expected(self, lengths, budget):
        return np.broadcast_to(0.6 * np.asarray(budget, dtype=float), np.shape(lengths)).copy()


def test_features_tell_repetitive_from_varied_text():
    rng = np.random.default_rng(0)
    repetitive = np.tile(np.arange(20), 200)
    varied = rng.integers(0, 4000, 4000)
    c_rep, d_rep = document_features(repetitive)
    c_var, d_var = document_features(varied)
    assert c_rep < 0.2 < c_var and d_rep < 0.01 < d_var


def test_remembered_density_comes_back_and_moves_with_budget():
    stats = LengthModel()
    k = DocumentDensities(np.array([1000, 2000, 3000]))
    k.observe(np.array([1]), np.array([0.15]), np.array([0.5]), stats)  # the model says 0.3: this one is half
    assert k.expected(np.array([1]), 0.5, stats)[0] == pytest.approx(0.15)
    assert k.expected(np.array([1]), 0.8, stats)[0] == pytest.approx(0.24)  # same ratio at another budget
    assert k.expected(np.array([1]), 1.0, stats)[0] == 1.0
    assert k.remembered_share(np.array([0, 1, 2])) == pytest.approx(1 / 3)


def test_prediction_learns_from_features_and_reports_its_error():
    rng = np.random.default_rng(1)
    n = 600
    L = rng.integers(500, 8000, n)
    compression = rng.uniform(0.2, 0.7, n)
    truth = np.clip(0.3 * np.exp(2.0 * (compression - 0.45)), 0.01, 1.0)  # content decides the density
    stats = LengthModel()
    k = DocumentDensities(L, feature_matrix(L, compression, rng.uniform(0.1, 0.5, n)))
    errors = []
    for start in range(0, 400, 40):  # ten steps of 40 documents, each never seen before
        docs = np.arange(start, start + 40)
        k.observe(docs, truth[docs], np.full(40, 0.5), stats)
        errors.append(k.pop_errors())
    assert errors[0]["density_error_docs"] == 40
    assert errors[-1]["density_error_median"] < 0.25 * errors[0]["density_error_median"]
    assert errors[-1]["density_error_p90"] >= errors[-1]["density_error_median"]
    unseen = np.arange(400, n)
    predicted = k.expected(unseen, 0.5, stats)
    length_only = stats.expected(L[unseen], 0.5)
    assert np.median(np.abs(predicted - truth[unseen])) < 0.3 * np.median(np.abs(length_only - truth[unseen]))
    assert k.pop_errors() == {}


def test_state_round_trips_through_json():
    stats = LengthModel()
    L = np.arange(100, 1100, 100)
    k = DocumentDensities(L, feature_matrix(L, np.linspace(0.2, 0.6, 10), np.linspace(0.1, 0.4, 10), ["a", "b"] * 5))
    k.observe(np.array([2, 5, 7]), np.array([0.2, 0.4, 0.1]), np.array([0.5, 0.5, 0.3]), stats)
    state = json.loads(json.dumps(k.state_dict()))
    again = DocumentDensities(L, k.features)
    again.load_state_dict(state)
    docs = np.arange(10)
    assert np.allclose(again.expected(docs, 0.6, stats), k.expected(docs, 0.6, stats))
    with pytest.raises(ValueError, match="another dataset"):
        DocumentDensities(L[:5]).load_state_dict(state)



def _sync_worker(rank, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        step_docs = np.array([7, 3, 11, 5])
        mine = {7: (0.25, 0.5), 3: (0.5, 0.4)} if rank == 0 else {11: (0.125, 0.9)}  # rank 1 lost doc 5's report
        docs, dens, budgets = sync_step_observations(step_docs, mine)
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump([docs.tolist(), dens.tolist(), budgets.tolist()], f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_step_observations_are_synced_exactly_on_two_gloo_ranks(tmp_path, free_port):
    mp.spawn(_sync_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1 == [[7, 3, 11], [0.25, 0.5, 0.125], [0.5, 0.4, 0.9]]
