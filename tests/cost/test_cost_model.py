"""Cost models: analytic sanity, profile interpolation, extrapolation, files and mismatch warnings."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from sparsebalance_ft.cost import (
    AnalyticCostModel,
    CostModel,
    OutOfProfileError,
    ProfiledCostModel,
    ProfileError,
    ProfileExtrapolationWarning,
    ProfileMismatchWarning,
)
from sparsebalance_ft.cost.model import current_hardware, model_config_hash


# --------------------------------------------------------------------------- analytic


def test_analytic_llama_8b_matches_the_brief():
    m = AnalyticCostModel.llama_8b(flops_per_s=1e15)
    assert isinstance(m, CostModel)
    t = m.doc_times(np.array([1000.0]), np.array([0.5]))[0]
    assert t == pytest.approx((6 * 8e9 * 1000 + 9.2e5 * 0.5 * 1000**2) / 1e15)


def test_analytic_attention_scales_quadratically_and_linearly_in_density():
    m = AnalyticCostModel.llama_8b()
    a = m.attention_times(np.array([4096.0, 8192.0]), 0.3)
    assert a[1] / a[0] == pytest.approx(4.0)
    assert m.attention_times([4096], 0.6)[0] / m.attention_times([4096], 0.3)[0] == pytest.approx(2.0)
    lin = m.doc_times([4096], 0.0)[0]
    assert lin == pytest.approx(6 * 8e9 * 4096 / m.flops_per_s)


def test_analytic_from_hf_config_reproduces_llama_8b_counts():
    from transformers import LlamaConfig

    c = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256)
    m = AnalyticCostModel.from_hf_config(c)
    assert m.attn_flops_coeff == pytest.approx(9.2e5, rel=0.01)
    assert m.linear_flops_per_token / 6 == pytest.approx(7.5e9, rel=0.02)  # matmul parameters incl. LM head
    assert m.num_layers == 32
    assert AnalyticCostModel.from_hf_config(c.to_dict()).attn_flops_coeff == m.attn_flops_coeff


def test_analytic_dense_layers_and_per_layer_densities():
    m = AnalyticCostModel(num_layers=4, linear_flops_per_token=0.0, attn_flops_coeff=4.0, flops_per_s=1.0,
                          dense_layers=[0])
    # layer 0 dense: effective density (3 * 0.2 + 1) / 4
    assert m.doc_times([10], 0.2)[0] == pytest.approx(4.0 * (3 * 0.2 + 1) / 4 * 100)
    per_layer = np.array([[0.1, 0.2, 0.3, 0.4]])  # the dense layer's entry is forced to 1
    assert m.doc_times([10], per_layer)[0] == pytest.approx(4.0 * (1 + 0.2 + 0.3 + 0.4) / 4 * 100)


def test_micro_batch_time_adds_overhead_and_empty_is_zero():
    m = AnalyticCostModel.llama_8b(micro_batch_overhead=0.01)
    L, d = np.array([1000, 3000]), np.array([0.2, 0.4])
    assert m.micro_batch_time(L, d) == pytest.approx(m.doc_times(L, d).sum() + 0.01)
    assert m.micro_batch_time(np.array([]), np.array([])) == 0.0


def test_doc_times_covers_a_large_window():
    m = AnalyticCostModel.llama_8b()
    rng = np.random.default_rng(0)
    L = rng.integers(16, 131072, 100_000)
    d = rng.uniform(0.1, 0.6, L.size)
    out = m.doc_times(L, d)  # its time: python -m sparsebalance_ft.bench.overhead
    assert out.shape == (100_000,) and np.all(out > 0)


# --------------------------------------------------------------------------- profiled

LENGTHS = np.array([128.0, 256.0, 512.0, 1024.0])
DENSITIES = np.array([0.1, 0.5, 1.0])


def power_law_profile(**kwargs) -> ProfiledCostModel:
    """attn(L, d) = 1e-9 * (0.2 + d) * L^2: exact under log-log (length) and linear (density) interpolation."""
    attn = 1e-9 * (0.2 + DENSITIES[None, :]) * LENGTHS[:, None] ** 2
    tokens = np.array([128.0, 512.0, 2048.0])
    linear = 1e-3 + 2e-6 * tokens
    defaults = dict(lengths=LENGTHS, densities=DENSITIES, attn=attn, tokens=tokens, linear=linear, num_layers=4,
                    attn_call_overhead=1e-4, micro_batch_overhead=5e-4, step_overhead=0.02,
                    meta={"hardware": {"device": "cpu", "device_name": "Test CPU 9000", "cpu": "Test CPU 9000",
                                       "cpu_count": 2}})
    defaults.update(kwargs)
    return ProfiledCostModel(**defaults)


def truth(L, d):
    return 1e-9 * (0.2 + np.asarray(d)) * np.asarray(L, dtype=float) ** 2


def test_interpolation_is_exact_at_grid_points():
    p = power_law_profile()
    for L in LENGTHS:
        for d in DENSITIES:
            assert p.layer_attention([L], d)[0] == pytest.approx(truth(L, d), rel=1e-12)


def test_interpolation_between_grid_points_follows_the_axes():
    p = power_law_profile()
    L = np.array([181.0, 300.0, 700.0, 1000.0])  # between lengths: power law is exact in log-log
    d = np.array([0.3, 0.75, 0.2, 0.95])  # between densities: linear
    np.testing.assert_allclose(p.layer_attention(L, d), truth(L, d), rtol=1e-9)
    # the whole model's attention counts every layer; per-document sums are what micro-batches add
    np.testing.assert_allclose(p.attention_times(L, d), 4 * truth(L, d), rtol=1e-9)


def test_micro_batch_time_composes_linear_on_total_tokens_and_per_document_attention():
    p = power_law_profile()
    L, d = np.array([200.0, 300.0, 400.0]), np.array([0.1, 0.5, 1.0])
    expected = (1e-3 + 2e-6 * 900) + 4 * truth(L, d).sum() + 4 * 1e-4 + 5e-4
    assert p.micro_batch_time(L, d) == pytest.approx(expected, rel=1e-9)
    # doc_times: marginal cost (linear slope, no fixed intercept) + attention
    np.testing.assert_allclose(p.doc_times(L, d), 2e-6 * L + 4 * truth(L, d), rtol=1e-9)


def test_micro_batch_scope_charges_the_packed_length():
    p = power_law_profile(attention_scope="micro_batch", densities=np.array([1.0]),
                          attn=1e-9 * 1.2 * LENGTHS[:, None] ** 2)
    t = p.micro_batch_time(np.array([256.0, 256.0]), 1.0)
    assert t == pytest.approx((1e-3 + 2e-6 * 512) + 4 * 1e-9 * 1.2 * 512**2 + 4e-4 + 5e-4, rel=1e-9)


def test_single_density_profile_ignores_density():
    p = power_law_profile(densities=np.array([1.0]), attn=1e-9 * 1.2 * LENGTHS[:, None] ** 2)
    assert p.layer_attention([300], 0.1)[0] == pytest.approx(p.layer_attention([300], 1.0)[0])


def test_extrapolation_beyond_the_grid_warns_once_by_default():
    p = power_law_profile()
    with pytest.warns(ProfileExtrapolationWarning, match="beyond the profiled grid"):
        out = p.doc_times([2048.0], 0.5)
    # the last segment's power law (exactly quadratic here) continues
    assert out[0] == pytest.approx(2e-6 * 2048 + 4 * truth(2048, 0.5), rel=1e-9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p.doc_times([4096.0], 0.5)  # second time: silent


def test_extrapolation_can_be_refused_or_allowed():
    with pytest.raises(OutOfProfileError, match="beyond the profiled grid"):
        power_law_profile(extrapolate="error").micro_batch_time([100, 5000], 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        power_law_profile(extrapolate="allow").micro_batch_time([100, 5000], 0.5)
        power_law_profile(extrapolate="error").micro_batch_time([16, 64, 1024], 0.5)  # short documents: fine


def test_predictions_are_positive_and_monotone():
    p = power_law_profile()
    L = np.geomspace(16, 1024, 50)
    for d in (0.0, 0.05, 0.3, 1.0):
        t = p.doc_times(L, d)
        assert np.all(t > 0) and np.all(np.diff(t) > 0)
    dens = np.linspace(0, 1, 21)
    t = p.doc_times(np.full(21, 700.0), dens)
    assert np.all(np.diff(t) >= 0)


def test_save_and_load_roundtrip(tmp_path):
    p = power_law_profile()
    path = tmp_path / "profile.json"
    p.save(path)
    q = ProfiledCostModel.load(path, hardware=p.meta["hardware"])
    L, d = np.array([150.0, 700.0]), np.array([0.3, 0.9])
    assert q.micro_batch_time(L, d) == pytest.approx(p.micro_batch_time(L, d))
    assert q.step_overhead == 0.02 and q.num_layers == 4


def test_hardware_mismatch_warns_clearly(tmp_path):
    path = tmp_path / "profile.json"
    power_law_profile().save(path)
    other = {"device": "cuda", "device_name": "Other GPU", "cpu": "Other CPU", "cpu_count": 64}
    with pytest.warns(ProfileMismatchWarning, match="hardware device_name was 'Test CPU 9000', is 'Other GPU'"):
        ProfiledCostModel.load(path, hardware=other)
    # the real machine is not "Test CPU 9000" either
    if current_hardware()["device_name"] != "Test CPU 9000":
        with pytest.warns(ProfileMismatchWarning, match="re-run `sbft profile`"):
            ProfiledCostModel.load(path)


def test_model_and_recipe_mismatch_warn(tmp_path):
    from transformers import LlamaConfig

    from sparsebalance_ft.cost.model import timing_key
    from sparsebalance_ft.recipe import recipe_from_dict

    hw = power_law_profile().meta["hardware"]
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
    recipe = recipe_from_dict({"model": {"path": "m"}, "data": {"path": "d"}})
    p = power_law_profile(meta={"hardware": hw, "model_config_hash": model_config_hash(cfg),
                                "timing_key": timing_key(recipe)})
    path = tmp_path / "p.json"
    p.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ProfiledCostModel.load(path, recipe=recipe, model_config=cfg, hardware=hw)
        # a budget change does not change timing
        ProfiledCostModel.load(path, recipe=recipe.model_copy(update={"sparsity": recipe.sparsity.model_copy(
            update={"budget": 0.3})}), hardware=hw)
    bigger = LlamaConfig(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
    with pytest.warns(ProfileMismatchWarning, match="model architecture differs"):
        ProfiledCostModel.load(path, model_config=bigger, hardware=hw)
    lora = recipe.model_copy(update={"lora": recipe.lora.model_copy(update={"r": 64})})
    with pytest.warns(ProfileMismatchWarning, match="recipe's model/LoRA"):
        ProfiledCostModel.load(path, recipe=lora, hardware=hw)


def test_bad_profile_files_are_user_errors(tmp_path):
    with pytest.raises(ProfileError, match="not found"):
        ProfiledCostModel.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ProfileError, match="not readable JSON"):
        ProfiledCostModel.load(bad)
    bad.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ProfileError, match="not a latency profile"):
        ProfiledCostModel.load(bad)
    data = power_law_profile().to_dict()
    data["attention"]["seconds_per_layer"] = [[1.0]]
    bad.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="attention table has shape"):
        ProfiledCostModel.load(bad)


def test_separate_dense_path_column():
    dense = 1e-9 * 0.5 * LENGTHS**2  # a fused dense kernel: cheaper than keeping every block sparsely
    p = power_law_profile(densities=np.array([0.1, 0.5, 0.9]),
                          attn=1e-9 * (0.2 + np.array([0.1, 0.5, 0.9])[None, :]) * LENGTHS[:, None] ** 2,
                          dense_attn=dense, dense_layers=[0])
    L = np.array([300.0, 300.0])
    out = p.layer_attention(L, np.array([0.95, 1.0]))
    assert out[0] == pytest.approx(truth(300, 0.95), rel=1e-9)  # sparse grid, extrapolated in density
    assert out[1] == pytest.approx(1e-9 * 0.5 * 300**2, rel=1e-9)  # the dense path
    # dense layers always take the dense path
    assert p.attention_times([300], 0.5)[0] == pytest.approx(3 * truth(300, 0.5) + 1e-9 * 0.5 * 300**2, rel=1e-9)
    q = ProfiledCostModel.from_dict(json.loads(json.dumps(p.to_dict())))
    np.testing.assert_allclose(q.layer_attention(L, [0.95, 1.0]), out)


def test_load_cost_model_falls_back_to_analytic(tmp_path):
    from transformers import LlamaConfig

    from sparsebalance_ft.cost import load_cost_model
    from sparsebalance_ft.recipe import recipe_from_dict

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      vocab_size=100)
    recipe = recipe_from_dict({"model": {"path": "m"}, "data": {"path": "d"}, "sparsity": {"dense_layers": [0]}})
    m = load_cost_model(recipe, model_config=cfg)
    assert isinstance(m, AnalyticCostModel) and m.num_layers == 2 and m.dense_layers == [0]
    path = tmp_path / "p.json"
    power_law_profile().save(path)
    recipe = recipe_from_dict({"model": {"path": "m"}, "data": {"path": "d"}, "balance": {"profile": str(path)}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProfileMismatchWarning)
        assert isinstance(load_cost_model(recipe, model_config=cfg), ProfiledCostModel)


def test_calibration_recovers_micro_batch_and_document_overheads():
    from sparsebalance_ft.profiling.profiler import calibrate_overheads

    p = power_law_profile(micro_batch_overhead=0.0)
    rng = np.random.default_rng(0)
    batches = [(list(rng.integers(64, 1024, rng.integers(1, 8))), 0.5) for _ in range(12)]
    measured = [(docs, d, p.micro_batch_time(np.array(docs), d) + 0.004 + 0.001 * len(docs)) for docs, d in batches]
    fit = calibrate_overheads(p, measured)
    assert p.micro_batch_overhead == pytest.approx(0.004, abs=1e-9)
    assert p.doc_overhead == pytest.approx(0.001, abs=1e-9)
    assert fit["median_ape_after"] < 1e-9 < fit["median_ape_before"]
    # doc_times carries the per-document term, micro_batch_time the fixed one too
    assert p.doc_times([100], 0.5)[0] == pytest.approx(2e-6 * 100 + 4 * truth(100, 0.5) + 0.001)


def test_disturbed_profiles_are_flagged():
    from sparsebalance_ft.profiling.profiler import profile_warnings

    calm = power_law_profile()
    calm.meta.update({"noise": {"median_relative_iqr": 0.05}, "calibration": {"median_ape_after": 0.04}})
    assert profile_warnings(calm) == []
    busy = power_law_profile()
    busy.meta.update({"noise": {"median_relative_iqr": 0.8}, "calibration": {"median_ape_after": 0.5},
                      "settings": {"clock": "wall"}})
    busy.meta["hardware"]["device"] = "cpu"
    problems = profile_warnings(busy)
    assert len(problems) == 3 and "--threads 1" in problems[-1]
