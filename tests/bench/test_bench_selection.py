"""The selection-rule comparison: exact block mass, planted q/k, matched-density recall."""
from __future__ import annotations

import json

import pytest
import torch

from sparsebalance_ft.attention import make_layout, select_blocks
from sparsebalance_ft.bench.selection import (
    block_mass,
    compare_selection_rules,
    kept_mask,
    matched_recall,
    planted_qk,
)


def test_block_mass_rows_sum_to_one_and_planted_blocks_are_heavy():
    q, k, planted = planted_qk(length=1024, block_size=64, head_dim=32, seed=1)
    layout = make_layout([1024], 64)
    mass = block_mass(q, k, layout, 32**-0.5)
    torch.testing.assert_close(mass.sum(-1), torch.ones(2, 16))
    causal = torch.ones(16, 16, dtype=torch.bool).tril()  # one document: every earlier block is allowed
    assert float(mass[~causal.expand_as(mass)].abs().max()) == 0.0
    noise = causal & ~planted & ~torch.eye(16, dtype=torch.bool)
    assert float(mass[planted].mean()) > 5 * float(mass[noise].mean())


def test_kept_mask_matches_the_selection():
    q, k, _ = planted_qk(length=512, block_size=64, head_dim=16)
    layout = make_layout([512], 64)
    sel = select_blocks(q, k, layout, margin=1.0, k_max=3, k_min=2, sink_blocks=1, local_blocks=1, scale=0.25)
    kept = kept_mask(sel)
    assert torch.equal(kept.sum(-1), sel.counts)


def test_matched_recall_skips_density_jumps():
    curves = {"mass": [{"density": 0.1, "recall": 0.2}, {"density": 0.3, "recall": 0.5}],
              "anchor": [{"density": 0.1, "recall": 0.3}, {"density": 0.15, "recall": 0.4},
                         {"density": 0.2, "recall": 0.5}, {"density": 0.9, "recall": 0.95}]}
    rows = matched_recall(curves, [0.15, 0.25, 0.5], max_gap=0.2)
    assert rows[0] == {"density": 0.15, "mass": pytest.approx(0.275), "anchor": 0.4}
    assert rows[1]["anchor"] is None and len(rows) == 2  # 0.2 -> 0.9 is a jump; 0.5 is past the mass curve


def test_compare_on_planted_is_monotone(tmp_path):
    out = tmp_path / "sel.json"
    result = compare_selection_rules(length=1024, budgets=[0.0, 0.1, 0.3, 0.5, 0.7, 0.9], out=out,
                                     sources=("planted",))
    assert json.loads(out.read_text()) == result
    for points in result["sources"]["planted"]["curves"].values():
        for key in ("density", "recall", "planted_kept"):
            values = [p[key] for p in points]
            assert values == sorted(values), key
