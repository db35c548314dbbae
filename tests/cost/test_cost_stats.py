"""Density statistics: prior, observations, monotonicity, sync across ranks, checkpoints."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from sparsebalance_ft.attention.config import SparsityConfig
from sparsebalance_ft.cost import DensityStats
from sparsebalance_ft.cost.stats import attention_prior


def stand_in_prior(lengths, budget):
    """A small stand-in for attention.budget.max_density: shrinks with length, grows with budget."""
    L = np.asarray(lengths, dtype=float)
    return np.clip(budget + (1 - budget) * 256.0 / np.maximum(L, 256.0), 0.0, 1.0)


def make(**kw) -> DensityStats:
    return DensityStats(SparsityConfig(), prior=stand_in_prior, **kw)


def test_prior_before_any_observation():
    s = make()
    L = np.array([256.0, 1024.0, 4096.0, 16384.0])  # bucket centres: exact
    for b in (0.1, 0.3, 0.5, 0.8):
        np.testing.assert_allclose(s.expected(L, b), stand_in_prior(L, b), rtol=1e-9)
    np.testing.assert_array_equal(s.expected(L, 1.0), 1.0)


def test_expected_is_monotone_in_budget_and_bounded():
    s = make()
    rng = np.random.default_rng(0)
    L = rng.integers(16, 65536, 200)
    s.observe(L, rng.uniform(0, 1, L.size), rng.uniform(0, 1, L.size))
    s.sync()
    budgets = np.linspace(0, 1, 41)
    table = np.stack([s.expected(L, b) for b in budgets])
    assert np.all(np.diff(table, axis=0) >= -1e-12)
    assert np.all((table >= 0) & (table <= 1))
    np.testing.assert_array_equal(table[-1], 1.0)


def test_observations_move_the_estimate_after_sync_only():
    s = make(prior_strength=2.0)
    before = s.expected([4096], 0.5)[0]
    s.observe([4096] * 50, [0.1] * 50, 0.5)
    assert s.expected([4096], 0.5)[0] == before  # pending until sync
    s.sync()
    after = s.expected([4096], 0.5)[0]
    # the cell's own observations dominate; the prior part is itself reshaped towards them
    assert 0.1 <= after <= (2 * before + 50 * 0.1) / 52 + 1e-9
    # neighbouring budgets are reshaped by the observed ratio too, and stay monotone
    assert s.expected([4096], 0.45)[0] < stand_in_prior([4096], 0.45)[0]
    assert s.expected([4096], 0.45)[0] <= after <= s.expected([4096], 0.55)[0]
    assert s.counts().sum() == pytest.approx(50)


def test_observations_between_buckets_and_budgets_are_split():
    s = make()
    s.observe([3000], [0.2], 0.52)
    s.sync()
    assert s.counts().sum() == pytest.approx(1.0)
    assert (s.counts() > 0).sum() == 4


def test_per_document_budgets_and_input_checks():
    s = make()
    out = s.expected([1024, 1024], np.array([0.2, 0.9]))
    assert out[0] < out[1]
    with pytest.raises(ValueError, match="2 lengths but 1 densities"):
        s.observe([1, 2], [0.5], 0.5)
    s.observe([], [], 0.5)


def test_state_dict_roundtrip_through_json():
    s = make()
    s.observe([1000, 5000, 20000], [0.3, 0.2, 0.1], 0.4)
    s.sync()
    s.observe([800], [0.9], 0.7)  # pending survives too
    state = json.loads(json.dumps(s.state_dict()))
    t = make()
    t.load_state_dict(state)
    L = np.array([1000, 3000, 20000])
    np.testing.assert_array_equal(t.expected(L, 0.4), s.expected(L, 0.4))
    s.sync()
    t.sync()
    np.testing.assert_array_equal(t.expected(L, 0.7), s.expected(L, 0.7))
    with pytest.raises(ValueError, match="another length/budget grid"):
        make(budget_points=11).load_state_dict(state)


def test_prior_is_the_attention_bound_monotone_and_dense_at_budget_one():
    """One density bound (the attention's), by hand at one point: 16 blocks, k_max 8 at budget 0.5."""
    cfg = SparsityConfig(k_max=8, k_min=4, sink_blocks=1, local_blocks=2)
    prior = attention_prior(cfg)
    L = np.array([64, 1000, 8000, 64000])
    prev = np.zeros(L.size)
    for b in np.linspace(0, 1, 11):
        cur = prior(L, b)
        assert np.all(cur >= prev - 1e-12) and np.all((cur > 0) & (cur <= 1))
        prev = cur
    np.testing.assert_array_equal(prior(L, 1.0), 1.0)
    assert prior(np.array([64]), 0.1)[0] == 1.0  # one block: always dense
    # 16 query blocks keeping min(row, 8) of their causal blocks: (1+..+8 + 8*8) / (1+..+16) = 100/136
    assert prior(np.array([1024]), 0.5)[0] == pytest.approx(100 / 136)


def test_default_prior_uses_the_attention_budget_api_or_the_stand_in():
    s = DensityStats(SparsityConfig())
    out = s.expected([100, 10000], 0.5)
    assert np.all((out > 0) & (out <= 1))


# --------------------------------------------------------------------------- two real ranks



def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        s = make()
        rng = np.random.default_rng(rank)
        for _ in range(3):  # three steps, different data on every rank
            L = rng.integers(64, 32768, 20)
            s.observe(L, rng.uniform(0.05, 0.9, L.size), rng.choice([0.3, 0.5, 0.7]))
            s.sync()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(s.state_dict(), f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sync_across_two_gloo_ranks_is_identical_and_complete(tmp_path, free_port):
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    states = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert states[0]["total"] == states[1]["total"]
    # the merged statistics equal one process observing both ranks' data
    ref = make()
    for rank in range(2):
        rng = np.random.default_rng(rank)
        for _ in range(3):
            L = rng.integers(64, 32768, 20)
            ref.observe(L, rng.uniform(0.05, 0.9, L.size), rng.choice([0.3, 0.5, 0.7]))
    ref.sync()
    assert ref.state_dict()["total"] == states[0]["total"]


def test_observe_report_takes_dense_layers_out():
    from types import SimpleNamespace

    s = DensityStats(SparsityConfig(dense_layers=[0]), prior=stand_in_prior, num_layers=4)
    # 3 sparse layers at 0.2 and one dense layer at 1.0 average to 0.4
    report = SimpleNamespace(doc_densities=[(4096, 0.4), (4096, 0.4)], layer_budget=[1.0, 0.3, 0.3, 0.3],
                             forced_density=None)
    assert s.observe_report(report) == 2
    s.sync()
    cell = s.counts()
    assert cell.sum() == pytest.approx(2)
    raw = s.state_dict()["total"]
    assert np.sum(raw[1]) / np.sum(raw[0]) == pytest.approx(0.2, abs=1e-6)  # mean observed sparse density
    np.testing.assert_allclose(s.budgets[np.nonzero(cell.sum(axis=0))[0]], [0.3])
    forced = SimpleNamespace(doc_densities=[(4096, 0.5)], layer_budget=[0.5] * 4, forced_density=0.5)
    assert s.observe_report(forced) == 0
