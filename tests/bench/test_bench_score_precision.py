"""bfloat16 against float32 scoring: the comparison reads agreement, density, recall and time per layer."""
from __future__ import annotations

import json

import pytest

from sparsebalance_ft.attention import selection
from sparsebalance_ft.bench.score_precision import compare_score_precision


@pytest.mark.parametrize("native_bf16", [False, True])
def test_comparison_agrees_fully_only_when_both_score_alike(monkeypatch, tiny_model_dir, tmp_path, native_bf16):
    """Without native bfloat16, `auto` scores in float32: every decision agrees and the figures are equal.
    With it, a few near-tie decisions may flip, and the JSON records which dtype `auto` meant."""
    monkeypatch.setattr(selection, "_cpu_multiplies_bfloat16", lambda: native_bf16)
    out = tmp_path / "precision.json"
    result = compare_score_precision(tiny_model_dir, length=1024, repeats=1, out=out)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    summary = result["summary"]
    assert len(result["layers"]) == result["setup"]["layers"]
    assert result["setup"]["auto_dtype"] == ("bfloat16" if native_bf16 else "float32")
    if native_bf16:
        assert 0.98 < summary["agreement"] <= 1.0
        assert summary["auto"]["recall"] == pytest.approx(summary["float32"]["recall"], abs=0.01)
    else:
        assert summary["agreement"] == 1.0
        assert summary["auto"]["density"] == summary["float32"]["density"]
        assert summary["auto"]["recall"] == summary["float32"]["recall"]
    assert summary["auto_speedup"] > 0
