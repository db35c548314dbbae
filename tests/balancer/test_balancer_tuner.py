import numpy as np
import pytest

from sparsebalance_ft.balancer.config import BalanceConfig, BalanceConfigError
from sparsebalance_ft.balancer.tuner import budget_grid, layer_budgets, tune
from sparsebalance_ft.errors import UserError

MIN, MAX, D = 0.1, 0.9, 0.5
GRID = budget_grid(MIN, MAX, D, 17)


def linear(a, b):
    """A rank whose predicted time is a + b * budget."""
    return a + b * GRID


def test_grid_holds_bounds_and_default():
    assert GRID[0] == pytest.approx(MIN) and GRID[-1] == pytest.approx(MAX)
    assert np.any(np.isclose(GRID, D)) and np.all(np.diff(GRID) > 0)
    odd = budget_grid(0.2, 0.8, 0.33, 5)
    assert np.any(np.isclose(odd, 0.33)) and len(odd) == 6


def test_bidirectional_lowers_straggler_raises_other():
    times = np.stack([linear(1, 2), linear(3, 4)])  # default: 2.0 and 5.0, mean 3.5, floor 3.4
    r = tune(times, GRID, D, MIN, MAX, "bidirectional")
    assert r.target == pytest.approx(3.5)
    assert r.budgets[1] == pytest.approx(0.125)  # 3 + 4b = 3.5
    assert r.budgets[0] == pytest.approx(MAX)  # 1 + 2b reaches 3.5 only at 1.25 > MAX
    assert r.predicted[1] == pytest.approx(3.5) and r.predicted[0] == pytest.approx(2.8)
    assert r.default_times.tolist() == pytest.approx([2.0, 5.0])


def test_straggler_only_never_raises():
    times = np.stack([linear(1, 2), linear(3, 4)])
    r = tune(times, GRID, D, MIN, MAX, "straggler-only")
    assert r.budgets[0] == pytest.approx(D) and r.predicted[0] == pytest.approx(2.0)
    assert r.budgets[1] == pytest.approx(0.125)


def test_floor_straggler_sets_target_and_stops_at_min():
    times = np.stack([linear(1, 2), linear(4, 2), linear(1, 1)])  # rank 1 is 4.2 even at MIN
    for mode in ("straggler-only", "bidirectional"):
        r = tune(times, GRID, D, MIN, MAX, mode)
        assert r.target == pytest.approx(4.2)
        assert r.budgets[1] == pytest.approx(MIN)
    bi = tune(times, GRID, D, MIN, MAX, "bidirectional")
    assert bi.budgets[0] == pytest.approx(MAX) and bi.budgets[2] == pytest.approx(MAX)


def test_fastest_target_is_the_floor():
    times = np.stack([linear(1, 2), linear(3, 4), linear(2, 0.5)])
    r = tune(times, GRID, D, MIN, MAX, "bidirectional", target="fastest")
    assert r.target == pytest.approx(max(1.2, 3.4, 2.05))
    assert r.budgets[1] == pytest.approx(MIN)
    assert np.nanmax(r.predicted) == pytest.approx(3.4)


def test_fill_target_cuts_nobody_and_raises_the_rest_to_the_slowest():
    times = np.stack([linear(1, 2), linear(3, 4), linear(2, 4)])  # default: 2.0, 5.0, 4.0
    r = tune(times, GRID, D, MIN, MAX, "bidirectional", target="fill")
    assert r.target == pytest.approx(5.0)
    assert r.budgets.tolist() == pytest.approx([MAX, D, 0.75])  # 1 + 2b = 5 past MAX; 2 + 4b = 5
    assert np.nanmax(r.predicted) == pytest.approx(5.0)  # the untuned step's time
    straggler_only = tune(times, GRID, D, MIN, MAX, "straggler-only", target="fill")
    assert straggler_only.budgets.tolist() == [D, D, D]


def test_none_keeps_default():
    times = np.stack([linear(1, 2), linear(3, 4)])
    r = tune(times, GRID, D, MIN, MAX, "none")
    assert r.budgets.tolist() == [D, D] and r.predicted.tolist() == pytest.approx([2.0, 5.0])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0])
def test_non_finite_row_gets_default_and_is_ignored(bad):
    times = np.stack([linear(1, 2), linear(3, 4), linear(1, 1)])
    times[2, 3] = bad
    r = tune(times, GRID, D, MIN, MAX, "bidirectional")
    assert r.invalid_ranks == [2] and r.budgets[2] == D and np.isnan(r.predicted[2])
    assert r.target == pytest.approx(3.5)  # mean of ranks 0 and 1 only
    allbad = tune(np.full((3, GRID.size), np.nan), GRID, D, MIN, MAX, "bidirectional")
    assert allbad.budgets.tolist() == [D] * 3 and np.isnan(allbad.target)


def test_flat_rank_goes_to_max():
    times = np.stack([np.full(GRID.size, 0.01), linear(3, 4)])
    r = tune(times, GRID, D, MIN, MAX, "bidirectional")
    assert r.budgets[0] == pytest.approx(MAX)


def random_times(rng, ranks):
    base = rng.lognormal(0.0, 0.8, size=(ranks, 1))
    steps = rng.uniform(0.0, 1.0, size=(ranks, GRID.size)) * rng.uniform(0.1, 3.0, size=(ranks, 1))
    return base + np.cumsum(steps, axis=1) * 0.1


@pytest.mark.parametrize("seed", range(20))
def test_properties_on_random_cases(seed):
    rng = np.random.default_rng(seed)
    times = random_times(rng, int(rng.integers(1, 40)))
    target = ("mean", "fastest", "fill")[seed % 3]
    bi = tune(times, GRID, D, MIN, MAX, "bidirectional", target)
    so = tune(times, GRID, D, MIN, MAX, "straggler-only", target)
    for r in (bi, so):
        assert np.all(r.budgets >= MIN - 1e-12) and np.all(r.budgets <= MAX + 1e-12)
        assert r.predicted.max() <= max(r.target, r.default_times.max()) * (1 + 1e-12)
        assert r.predicted.max() <= r.default_times.max() * (1 + 1e-12)  # never a slower step
    assert bi.predicted.max() <= bi.target * (1 + 1e-12)  # bidirectional never past T*
    assert np.all(so.budgets <= D + 1e-12)  # straggler-only never raises
    assert np.all(so.budgets[so.default_times <= so.target] == D)
    fast = bi.default_times <= bi.target
    assert np.all(bi.budgets[fast] >= D - 1e-12)  # waiting ranks are never cut
    assert np.all(bi.budgets[~fast] < D)


def test_deterministic_and_rank_order_equivariant():
    rng = np.random.default_rng(7)
    times = random_times(rng, 32)
    a = tune(times, GRID, D, MIN, MAX, "bidirectional")
    b = tune(times.copy(), GRID.copy(), D, MIN, MAX, "bidirectional")
    assert np.array_equal(a.budgets, b.budgets) and a.target == b.target
    perm = rng.permutation(32)
    c = tune(times[perm], GRID, D, MIN, MAX, "bidirectional")
    assert np.allclose(c.budgets, a.budgets[perm], rtol=0, atol=1e-12)


def test_non_monotone_rows_are_made_monotone():
    row = linear(1, 2)
    row[5] = 0.1  # a glitch below its neighbours
    r = tune(np.stack([row, linear(3, 4)]), GRID, D, MIN, MAX, "bidirectional")
    assert MIN <= r.budgets[0] <= MAX and r.predicted[0] <= r.target + 1e-12


def test_bad_inputs_raise():
    times = np.stack([linear(1, 2)])
    with pytest.raises(ValueError):
        tune(times, GRID, 0.95, MIN, MAX, "bidirectional")
    with pytest.raises(ValueError):
        tune(times, GRID, D, MIN, MAX, "sideways")
    with pytest.raises(ValueError):
        tune(times[:, :3], GRID, D, MIN, MAX, "bidirectional")
    assert tune(times, GRID, 0.95, MIN, MAX, "none").budgets[0] == 0.95


def test_config_checks_default_budget():
    cfg = BalanceConfig(tuning="bidirectional", min_budget=0.2, max_budget=0.6)
    cfg.check_default_budget(0.5)
    with pytest.raises(BalanceConfigError) as info:
        cfg.check_default_budget(0.8)
    assert isinstance(info.value, UserError) and "sparsity.budget" in str(info.value)
    BalanceConfig(tuning="none", max_budget=0.6).check_default_budget(1.0)
    with pytest.raises(Exception):
        BalanceConfig(min_budget=0.7, max_budget=0.3)


def test_layer_budgets_keep_mean_and_follow_sensitivity():
    sens = np.array([0.05, 0.1, 0.3, 0.02])
    up = layer_budgets(0.7, D, sens, 4, MIN, MAX)
    down = layer_budgets(0.3, D, sens, 4, MIN, MAX)
    assert up.mean() == pytest.approx(0.7) and down.mean() == pytest.approx(0.3)
    assert np.argmax(up) == 2  # the most sensitive layer takes most of a raise
    assert np.argmax(down) == 2  # ... and gives up least of a cut
    assert np.all(up <= MAX) and np.all(down >= MIN)
    assert layer_budgets(0.3, D, None, 3, MIN, MAX).tolist() == [0.3] * 3
    assert layer_budgets(0.3, D, np.full(3, np.nan), 3, MIN, MAX).tolist() == [0.3] * 3
    near_max = layer_budgets(0.88, D, sens, 4, MIN, MAX)
    assert np.all(near_max <= MAX + 1e-12) and near_max.mean() == pytest.approx(0.88)


def test_headroom_keeps_waiting_ranks_below_target():
    times = np.stack([linear(1, 4), linear(3, 4)])  # default 3 and 5; T* = 4
    plain = tune(times, GRID, D, MIN, MAX, "bidirectional")
    spare = tune(times, GRID, D, MIN, MAX, "bidirectional", headroom=0.1)
    assert plain.budgets[0] == pytest.approx(0.75) and plain.predicted[0] == pytest.approx(4.0)
    assert spare.budgets[0] == pytest.approx(0.65) and spare.predicted[0] == pytest.approx(3.6)
    assert spare.budgets[1] == pytest.approx(plain.budgets[1]) == pytest.approx(0.25)
    tight = tune(times, GRID, D, MIN, MAX, "bidirectional", headroom=0.3)  # 2.8 < 3: no room, keeps default
    assert tight.budgets[0] == D and tight.predicted[0] == pytest.approx(3.0)
    with pytest.raises(ValueError):
        tune(times, GRID, D, MIN, MAX, "bidirectional", headroom=1.0)


def test_tolerance_leaves_small_predicted_gaps_alone():
    times = np.stack([linear(1, 1.8), linear(1, 2.2)])  # default 1.9 and 2.1: T* = 2.0, the slower 5% above it
    plain = tune(times, GRID, D, MIN, MAX, "bidirectional")
    assert plain.budgets[1] < D  # without tolerance a 5% gap is cut
    tolerant = tune(times, GRID, D, MIN, MAX, "bidirectional", tolerance=0.06)
    assert tolerant.budgets[1] == D and tolerant.predicted[1] == pytest.approx(2.1)
    assert tolerant.budgets[0] == pytest.approx(plain.budgets[0])  # the waiting rank still fills up to T*
    assert tolerant.budgets[0] > D
    wide = np.stack([linear(1, 2), linear(3, 4)])  # a 43% gap is cut whatever the tolerance
    assert tune(wide, GRID, D, MIN, MAX, "bidirectional", tolerance=0.06).budgets[1] < D
    with pytest.raises(ValueError):
        tune(times, GRID, D, MIN, MAX, "bidirectional", tolerance=-0.1)


def test_idle_ranks_do_not_drag_the_mean_target_down():
    """Issue 15: an idle rank (predicted 0 at every budget) must not cut three equal working ranks."""
    grid = budget_grid(0.1, 0.9, 0.5, 17)
    working = 2.0 + 16.0 * grid  # 10 s at the default budget 0.5, rising with budget
    times = np.vstack([np.zeros_like(grid), working, working, working])
    result = tune(times, grid, 0.5, 0.1, 0.9, mode="bidirectional", target="mean")
    assert result.target == pytest.approx(10.0)
    assert np.allclose(result.budgets[1:], 0.5)
    padding_only = np.vstack([np.full_like(grid, 0.3), working, working, working])  # flat: cannot absorb
    assert np.allclose(tune(padding_only, grid, 0.5, 0.1, 0.9).budgets[1:], 0.5)
