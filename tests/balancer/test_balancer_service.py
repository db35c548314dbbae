import json
import logging
import math
from datetime import timedelta

import numpy as np
import pytest
import torch.multiprocessing as mp

from _balancer_fakes import BrokenCost, FakeCost, FakeStats, NanCost, report
from sparsebalance_ft.balancer.config import BalanceConfig
from sparsebalance_ft.balancer.service import BalancerService


def make(tuning="bidirectional", cost=None, stats=None, **kw):
    per_layer = kw.pop("per_layer", False)
    cfg = BalanceConfig(tuning=tuning, min_budget=0.1, max_budget=0.9, per_layer=per_layer, target="mean")
    return BalancerService(cfg, cost or FakeCost(), stats or FakeStats(), 0.5, **kw)


def test_predict_is_monotone_and_sums_micro_batches():
    svc = make()
    t = svc.predict([[4096, 1024], [], [2048]])
    assert t.shape == svc.grid.shape and np.all(np.diff(t) > 0)
    # by hand from the fakes: per micro-batch 1e-3 + sum(1e-6 L + 1e-9 b^1.5 L^2); the empty one costs nothing
    density = svc.grid**1.5
    one = 1e-3 + 1e-6 * (4096 + 1024) + 1e-9 * density * (4096**2 + 1024**2)
    two = 1e-3 + 1e-6 * 2048 + 1e-9 * density * 2048**2
    assert np.allclose(t, one + two, rtol=1e-12)
    assert np.all(svc.predict([]) == 0)


def test_single_process_decision():
    svc = make()
    d = svc.decide([[8192, 1024]])
    assert d.rank == 0 and d.step == 0 and d.fallback_ranks == [] and d.error is None
    assert d.budget == pytest.approx(0.5) and len(d.budgets) == 1  # alone: T* is its own time
    assert math.isfinite(d.predicted_time) and d.predicted_time == pytest.approx(d.target)
    json.dumps(d.to_dict())
    assert svc.decide([[10]]).step == 1


@pytest.mark.parametrize("cost", [BrokenCost(), NanCost()])
def test_bad_prediction_falls_back_to_default_with_warning(cost, caplog):
    svc = make(cost=cost)
    with caplog.at_level(logging.WARNING, logger="sparsebalance_ft.balancer"):
        d = svc.decide([[4096]])
    assert d.budget == 0.5 and d.fallback_ranks == [0] and math.isnan(d.predicted_time)
    assert any("default budget" in rec.getMessage() for rec in caplog.records)
    assert svc.fallbacks == 1


def test_silenced_warnings_are_counted_at_the_end(caplog):
    """After ten, only every hundredth warning shows; the run's end says how many there were and how many showed."""
    svc = make(cost=NanCost())
    with caplog.at_level(logging.WARNING, logger="sparsebalance_ft.balancer"):
        svc.decide([[4096]])
        assert svc.warnings_summary() is None  # nothing silenced yet
        for _ in range(249):
            svc.decide([[4096]])
    shown = [r for r in caplog.records if "warning" in r.getMessage()]
    assert svc._warned >= 250 and len(shown) < 20
    assert svc.warnings_summary() == (f"balancer on rank 0: {svc._warned} warnings in this run, {len(shown)} of them"
                                      " shown; 250 steps fell back to the default budget")


def test_tuner_error_gives_everyone_the_default(monkeypatch, caplog):
    import sparsebalance_ft.balancer.service as service

    def boom(*args, **kwargs):
        raise FloatingPointError("boom")

    monkeypatch.setattr(service, "tune", boom)
    svc = make(per_layer=True, num_layers=3)
    with caplog.at_level(logging.ERROR, logger="sparsebalance_ft.balancer"):
        d = svc.decide([[4096]])
    assert d.budget == [0.5] * 3 and "boom" in d.error
    assert any("tuner failed" in rec.getMessage() for rec in caplog.records)


def test_no_cost_model_means_default_and_no_exchange():
    cfg = BalanceConfig(tuning="none")
    svc = BalancerService(cfg, None, None, 1.0)
    d = svc.decide([[100]])
    assert d.budget == 1.0 and d.error is None
    svc.observe(None, 0.1, 0.0)
    with pytest.raises(ValueError):
        BalancerService(BalanceConfig(tuning="bidirectional"), None, FakeStats(), 0.5)


def test_observe_feeds_stats_and_state_round_trips():
    stats = FakeStats()
    svc = make(stats=stats, per_layer=True, num_layers=2)
    d = svc.decide([[4096, 512]])
    svc.observe(report([(4096, 0.3), (512, float("nan"))], [0.95, 0.8]), compute_time=2 * d.predicted_time, wait_time=0.0)
    assert stats.observed == [([4096], [0.3], pytest.approx(d.rank_budget))] and stats.syncs == 1
    assert svc.sensitivity.tolist() == pytest.approx([0.05, 0.2])
    assert svc.prediction_ratio == pytest.approx(2.0)
    svc.decide([[1024]])
    svc.observe(report([(1024, 0.5)], [0.9, None]), 0.1, 0.01)

    state = json.loads(json.dumps(svc.state_dict()))  # plain data
    fresh_stats = FakeStats(power=2.0)
    other = make(stats=fresh_stats, per_layer=True, num_layers=2)
    other.load_state_dict(state)
    assert other.step == svc.step == 2
    assert np.allclose(other.sensitivity, svc.sensitivity)
    assert other.prediction_ratio == svc.prediction_ratio
    assert fresh_stats.power == 1.5 and len(fresh_stats.observed) == 2
    a, b = svc.decide([[2048, 64]]), other.decide([[2048, 64]])
    assert a.to_dict() | {"decide_seconds": 0} == b.to_dict() | {"decide_seconds": 0}
    with pytest.raises(ValueError):
        other.load_state_dict({"version": 99})


def test_bad_report_never_raises(caplog):
    stats = FakeStats()
    svc = make(stats=stats)
    svc.decide([[100]])
    with caplog.at_level(logging.WARNING, logger="sparsebalance_ft.balancer"):
        svc.observe(report([("x", "y")]), 0.1, 0.0)
    assert stats.syncs == 1 and stats.observed == []


# -- two real processes on gloo -----------------------------------------------------------------


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        results = {}
        # rank 0 holds one long document, rank 1 short ones: rank 0 is the straggler
        mine = [[16384]] if rank == 0 else [[2048, 2048], [1024]]
        svc = make()
        results["normal"] = svc.decide(mine).to_dict()
        # rank 1's prediction breaks: it keeps the default, rank 0 is tuned alone, nobody hangs
        broken = make(cost=BrokenCost() if rank == 1 else FakeCost())
        results["broken"] = broken.decide(mine).to_dict()
        layered = make(per_layer=True, num_layers=3)
        layered.observe(report([], [0.9, 0.7, 0.99] if rank == 0 else [0.9, 0.8, 0.97]), 0.1, 0)
        results["layered"] = layered.decide(mine).to_dict()
        # real statistics: observe ends in DensityStats.sync (an all_reduce); rank 1's report is
        # broken, yet both ranks reach the collective and end with identical tables
        from sparsebalance_ft.cost import DensityStats

        stats = DensityStats()
        real = make(stats=stats)
        real.decide(mine)
        real.observe(report([(16384, 0.25)]) if rank == 0 else report([("bad", None)]), 0.1, 0.0)
        results["stats_table"] = stats.table().round(12).tolist()
        results["stats_count"] = float(stats.counts().sum())
        with open(f"{out_dir}/rank{rank}.json", "w") as handle:
            json.dump(results, handle)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_process_exchange_on_gloo(tmp_path, free_port):
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))

    for key in ("normal", "broken", "layered"):  # the same decision on both ranks
        for name in ("budgets", "predicted", "default_times", "target", "fallback_ranks"):
            assert r0[key][name] == r1[key][name], (key, name)
    n = r0["normal"]
    assert n["default_times"][0] > n["default_times"][1]
    assert n["budgets"][0] < 0.5 < n["budgets"][1]  # straggler lowered, the other raised
    assert r0["normal"]["budget"] == n["budgets"][0] and r1["normal"]["budget"] == n["budgets"][1]
    assert max(n["predicted"]) <= n["target"] * (1 + 1e-12)

    b = r0["broken"]
    assert b["fallback_ranks"] == [1] and b["budgets"][1] == 0.5 and r1["broken"]["budget"] == 0.5
    assert b["predicted"][1] is None

    assert r0["stats_table"] == r1["stats_table"] and r0["stats_count"] == r1["stats_count"] > 0

    l0, l1 = r0["layered"]["budget"], r1["layered"]["budget"]
    assert len(l0) == 3 and np.mean(l0) == pytest.approx(r0["layered"]["budgets"][0])
    assert np.argmax(l0) == 1 and np.ptp(l0) > 0  # the most sensitive layer (lowest mean recall) is cut least
    assert l1 == [0.9] * 3  # rank 1 is raised to MAX: every layer there


def test_with_the_real_cost_model_and_density_stats():
    from sparsebalance_ft.attention.config import SparsityConfig
    from sparsebalance_ft.cost import AnalyticCostModel, DensityStats

    cost = AnalyticCostModel(num_layers=4, linear_flops_per_token=1e6, attn_flops_coeff=1e3, flops_per_s=1e12)
    stats = DensityStats(SparsityConfig())
    svc = make(cost=cost, stats=stats, per_layer=True, num_layers=4)
    times = svc.predict([[8192, 512], [4096]])
    assert np.all(np.isfinite(times)) and np.all(np.diff(times) >= 0) and times[-1] > times[0]
    d = svc.decide([[8192, 512], [4096]], step=7)
    assert d.step == 7 and d.fallback_ranks == [] and len(d.budget) == 4
    svc.observe(report([(8192, 0.2), (512, 0.6), (4096, 0.3)], [0.9, 0.92, 0.95, 0.97]), 0.2, 0.0)
    assert stats.counts().sum() > 0  # observed and synced
    other = make(cost=cost, stats=DensityStats(SparsityConfig()), per_layer=True, num_layers=4)
    other.load_state_dict(svc.state_dict())
    assert np.allclose(other.stats.table(), stats.table()) and other.step == 8
