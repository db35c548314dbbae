"""Selection, budget mapping and reports."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from _reference import allowed_blocks, sampled_block_shares
from sparsebalance_ft.attention import (
    NO_CAP,
    SparseAttentionController,
    SparsityConfig,
    budget_params,
    make_layout,
    max_density,
    select_blocks,
)
from sparsebalance_ft.attention.register import sparse_attention_row
from sparsebalance_ft.attention.selection import (
    causal_counts,
    documents_from_positions,
    sample_positions,
    sampled_recall,
    select_block_sets,
)


def _qk(hq=4, hkv=2, length=1024, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, length, d, generator=g)
    k = torch.randn(hkv, length, d, generator=g)
    # make attention peaky: a few key blocks share a direction with the queries
    k[:, 300:364] += 2.0 * q[:1, :64].mean(1, keepdim=True)
    return q, k


def _select(cfg: SparsityConfig, budget: float, q, k, layout, **kw):
    threshold, k_max = budget_params(cfg, budget)
    rule = {"margin" if cfg.selection == "anchor" else "tau": threshold}
    return select_blocks(q, k, layout, **rule, k_max=k_max, k_min=cfg.k_min, sink_blocks=cfg.sink_blocks,
                         local_blocks=cfg.local_blocks, scale=q.shape[-1] ** -0.5, **kw)


def test_budget_params_monotone_and_endpoints():
    cfg = SparsityConfig(tau=0.9, k_max=64, k_min=4, budget=0.5)
    grid = np.linspace(0, 1, 41)
    params = [budget_params(cfg, b) for b in grid]
    taus, caps = zip(*params)
    assert all(a <= b for a, b in zip(taus, taus[1:])) and all(a <= b for a, b in zip(caps, caps[1:]))
    assert budget_params(cfg, 0.5) == (0.9, 64)
    assert budget_params(cfg, 1.0) == (1.0, NO_CAP)
    assert budget_params(cfg, 0.0)[1] == cfg.k_min
    with pytest.raises(ValueError):
        budget_params(cfg, 1.5)


def test_budget_params_anchor_margin():
    """The anchor rule's margin grows with budget to infinity at 1.0; its caps are the mass rule's (so
    `max_density` bounds both)."""
    mass = SparsityConfig(tau=0.9, k_max=64, k_min=4, budget=0.5)
    anchor = mass.model_copy(update={"selection": "anchor", "anchor_margin": 1.5})
    grid = np.linspace(0, 1, 41)
    margins, caps = zip(*(budget_params(anchor, b) for b in grid))
    assert all(a <= b for a, b in zip(margins, margins[1:]))
    assert list(caps) == [budget_params(mass, b)[1] for b in grid]
    assert budget_params(anchor, 0.5) == (1.5, 64) and budget_params(anchor, 0.0)[0] == 0.0
    assert budget_params(anchor, 1.0) == (math.inf, NO_CAP)


@pytest.mark.parametrize("selection", ["mass", "anchor"])
@pytest.mark.parametrize("bs", [64, 128])
def test_more_budget_keeps_more_blocks(bs, selection):
    cfg = SparsityConfig(block_size=bs, k_min=2, k_max=6, budget=0.5, selection=selection)
    q, k = _qk(length=16 * bs // 2 * 2)
    layout = make_layout([q.shape[1]], bs)
    prev = None
    for b in np.linspace(0, 1, 11):
        sel = _select(cfg, float(b), q, k, layout)
        kept = torch.zeros(sel.indices.shape[0], layout.num_blocks, layout.num_blocks, dtype=torch.bool)
        for h in range(kept.shape[0]):
            for i in range(kept.shape[1]):
                kept[h, i, sel.indices[h, i, : sel.counts[h, i]]] = True
        if prev is not None:
            assert bool((kept | ~prev).all()), f"budget {b} dropped blocks kept at a lower budget"
        prev = kept
        assert float(sel.counts.sum()) / float(sel.causal.sum() * 2) <= max_density(q.shape[1], cfg, float(b)) + 1e-9
    assert bool((sel.counts == sel.causal[None]).all())  # budget 1.0 keeps everything


@pytest.mark.parametrize("selection", ["mass", "anchor"])
def test_caps_anchors_and_documents(selection):
    cfg = SparsityConfig(block_size=64, sink_blocks=1, local_blocks=2, k_min=3, k_max=4, tau=0.99, anchor_margin=4.0,
                         selection=selection)
    q, k = _qk(length=1600)
    layout = make_layout([700, 900], 64)  # the second document starts at a block boundary in the layout
    from sparsebalance_ft.attention.selection import to_layout

    qp, kp = to_layout(q[None], layout)[0], to_layout(k[None], layout)[0]
    sel = _select(cfg, cfg.budget, qp, kp, layout)
    allowed = allowed_blocks(layout)
    start = layout.block_start
    for h in range(2):
        for i in range(layout.num_blocks):
            kept = sel.indices[h, i, : sel.counts[h, i]].tolist()
            assert len(set(kept)) == len(kept)
            assert all(bool(allowed[i, j]) for j in kept), "kept a block across documents or the causal edge"
            assert i in kept and int(start[i]) in kept  # diagonal and sink anchors
            if i - 1 >= int(start[i]):
                assert i - 1 in kept
            c = int(sel.causal[i])
            assert min(c, cfg.k_min) <= len(kept) <= max(cfg.k_max, 3)


def _planted(scores: list[float], bs: int = 16):
    """One query head whose every token is e0, and key blocks whose every key is score_j * e0: with scale 1
    the pooled score of block j is score_j + log(bs), so log-shares differ exactly as the scores do."""
    q = torch.zeros(1, len(scores) * bs, 4)
    q[..., 0] = 1.0
    k = torch.zeros_like(q)
    k[..., 0] = torch.tensor(scores).repeat_interleave(bs)
    return q, k, make_layout([q.shape[1]], bs)


@pytest.mark.parametrize("sink, margin, want", [
    (1, 1.0, [0, 2, 7]),  # reference: the sink (3.0); keeps scores >= 2.0
    (1, 2.0, [0, 2, 4, 7]),  # >= 1.0
    (0, 2.6, [0, 2, 7]),  # only the diagonal anchors: reference 5.0; keeps scores >= 2.4
])
def test_anchor_rule_keeps_the_planted_blocks(sink, margin, want):
    q, k, layout = _planted([3.0, 0.0, 2.5, 0.0, 1.2, 0.0, 0.0, 5.0])
    sel = select_blocks(q, k, layout, margin=margin, k_max=NO_CAP, k_min=1, sink_blocks=sink, local_blocks=1,
                        scale=1.0)
    assert sorted(sel.indices[0, 7, : sel.counts[0, 7]].tolist()) == want
    capped = select_blocks(q, k, layout, margin=margin, k_max=len(want) - 1, k_min=1, sink_blocks=sink,
                           local_blocks=1, scale=1.0)
    kept = set(capped.indices[0, 7, : capped.counts[0, 7]].tolist())
    assert len(kept) == len(want) - 1 and kept < set(want) and 7 in kept


def test_select_blocks_needs_one_rule():
    q, k, layout = _planted([1.0, 2.0])
    for rule in ({}, {"tau": 0.5, "margin": 1.0}):
        with pytest.raises(ValueError):
            select_blocks(q, k, layout, **rule, k_max=2, k_min=1, sink_blocks=1, local_blocks=1, scale=1.0)


def test_controller_runs_the_anchor_rule():
    """Through the attention entry point the anchor config selects with its margin (density as selected)."""
    q, k = _qk(length=1024)
    v = torch.randn(1, 2, 1024, 32)
    layout = make_layout([1024], 64)
    cfg = SparsityConfig(selection="anchor", anchor_margin=1.0, k_min=2, k_max=8, recall_samples=0)
    ctl = SparseAttentionController(cfg, 1)
    sparse_attention_row(ctl, 0, q[None], k[None], v, layout, 32**-0.5)
    sel = _select(cfg, cfg.budget, q, k, layout)
    assert ctl.pop_report().layer_density[0] == pytest.approx(float(sel.counts.sum()) / float(sel.causal.sum() * 2))
    assert float(sel.counts.sum()) < float(sel.causal.sum() * 2)


@pytest.mark.parametrize("tau,k_max", [(0.9, 4), (1.0, NO_CAP)])  # a forced density overrides even full budget
def test_force_density_counts(tau, k_max):
    q, k = _qk(length=2048)
    layout = make_layout([2048], 64)
    for d in (0.05, 0.3, 0.77):
        sel = select_blocks(q, k, layout, tau=tau, k_max=k_max, k_min=2, sink_blocks=1, local_blocks=2, scale=0.2,
                            force_density=d)
        want = torch.clamp(torch.round(d * sel.causal.double()).long(), min=1)
        assert torch.equal(sel.counts, torch.minimum(want, sel.causal)[None].expand_as(sel.counts))
        # anchors come first: the diagonal is always kept
        for i in range(layout.num_blocks):
            assert i in sel.indices[0, i, : sel.counts[0, i]].tolist()


def test_recall_full_is_one_and_partial_is_below():
    q, k = _qk(length=1024)
    layout = make_layout([1024], 64)
    full = select_blocks(q, k, layout, tau=1.0, k_max=NO_CAP, k_min=1, sink_blocks=1, local_blocks=1, scale=0.2)
    assert sampled_recall(q, k, layout, full, 4, 0.2) == 1.0
    full.full = False  # force the measured path: every kept block, exact mass
    assert sampled_recall(q, k, layout, full, 6, 0.2, seed=0) == pytest.approx(1.0, abs=1e-5)
    part = select_blocks(q, k, layout, tau=0.3, k_max=2, k_min=1, sink_blocks=1, local_blocks=1, scale=0.2)
    r = sampled_recall(q, k, layout, part, 6, 0.2, seed=0)
    assert 0.0 < r < 1.0


def test_layout_helpers():
    assert documents_from_positions(torch.tensor([0, 1, 2, 0, 1, 0])) == [3, 2, 1]
    layout = make_layout([100, 30], 64)
    assert layout.num_blocks == 3 and layout.block_tokens.tolist() == [64, 36, 30]
    assert causal_counts(layout).tolist() == allowed_blocks(layout).sum(-1).tolist() == [1, 2, 1]
    assert causal_counts(layout, 70).tolist() == allowed_blocks(layout, 70).sum(-1).tolist()


def test_controller_full_budget_exact_and_reports():
    """Through the attention entry point: budget 1.0 equals dense causal attention (output and grads), for
    the fused dense route and for the sparse kernel keeping every block; the report counts every block."""
    hq, hkv, length, d = 4, 2, 640, 32
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, length, d, generator=g).requires_grad_() for h in (hq, hkv, hkv))
    go = torch.randn(1, hq, length, d)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref_g = torch.autograd.grad(ref, (q, k, v), go)
    layout = make_layout([length], 64)
    for route in (True, False):
        ctl = SparseAttentionController(SparsityConfig(exact_dense_at_full_budget=route, recall_samples=3), 2)
        ctl.set_budget(1.0)
        out = sparse_attention_row(ctl, 1, q, k, v, layout, d**-0.5)
        grads = torch.autograd.grad(out, (q, k, v), go)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        for a, b in zip(grads, ref_g):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
        rep = ctl.pop_report()
        assert rep.layer_density == [None, 1.0] and rep.layer_recall[1] == 1.0
        assert rep.doc_densities == [(length, 1.0)] and rep.forwards == 1
        assert ctl.pop_report().forwards == 0  # popping resets


def test_controller_budget_validation_and_dense_layers():
    ctl = SparseAttentionController(SparsityConfig(dense_layers=[0, -1]), 4)
    assert ctl.dense_layers == {0, 3}
    with pytest.raises(ValueError):
        ctl.set_budget([0.5, 0.5])
    with pytest.raises(ValueError):
        ctl.set_budget(1.2)
    ctl.set_budget([0.1, 0.2, 0.3, 0.4])
    assert ctl.budgets == [0.1, 0.2, 0.3, 0.4]
    with pytest.raises(ValueError):
        SparseAttentionController(SparsityConfig(dense_layers=[7]), 4)


def test_max_density_bounds():
    cfg = SparsityConfig()
    assert max_density(1000, cfg, 1.0) == 1.0
    assert max_density(32768, cfg, 0.0) < max_density(32768, cfg, 0.5) < max_density(32768, cfg, 0.9) <= 1.0
    assert math.isclose(max_density(64, cfg, 0.2), 1.0)


def test_recall_of_several_micro_batches_is_weighted_by_their_tokens():
    ctl = SparseAttentionController(SparsityConfig(), 1)
    one = np.ones(1)
    ctl.record(0, 0, [8000], one, one, recall=0.3)  # a long micro-batch, then a short one in the same step
    ctl.record(0, 0, [40, 60], np.ones(2), np.ones(2), recall=1.0)
    assert ctl.pop_report().layer_recall[0] == pytest.approx((0.3 * 8000 + 1.0 * 100) / 8100)


def _kept_sets(sel) -> list[list[set[int]]]:
    return [[set(sel.indices[h, i, : int(sel.counts[h, i])].tolist()) for i in range(sel.counts.shape[1])]
            for h in range(sel.counts.shape[0])]


@pytest.mark.parametrize("rule", [{"tau": 0.7}, {"margin": 1.0}])
@pytest.mark.parametrize("docs,window", [([1024], None), ([300, 500, 64, 200], None), ([1500], 300)])
@pytest.mark.parametrize("score_queries", [0, 4])
def test_chunked_selection_equals_one_chunk(monkeypatch, rule, docs, window, score_queries):
    """Selecting query blocks in chunks (bounded memory) keeps exactly the blocks one chunk keeps."""
    from sparsebalance_ft.attention import selection

    q, k = _qk(hq=6, hkv=2, length=sum(docs))
    layout = make_layout(docs, 64)
    qp, kp = (selection.to_layout(x[None], layout)[0] for x in (q, k))
    kw = dict(rule, k_max=5, k_min=2, sink_blocks=1, local_blocks=2, scale=0.2, window=window,
              score_queries=score_queries)
    monkeypatch.setitem(selection._CHUNK_ELEMENTS, "cpu", 1 << 40)
    monkeypatch.setitem(selection._CHUNK_ROWS_MAX, "cpu", layout.num_blocks)  # every query block in one chunk
    whole = select_blocks(qp, kp, layout, **kw)
    monkeypatch.setitem(selection._CHUNK_ROWS_MAX, "cpu", 3)  # chunks of 3 query blocks, the last one shorter
    by_three = select_blocks(qp, kp, layout, **kw)
    monkeypatch.setitem(selection._CHUNK_ELEMENTS, "cpu", 1)  # one query block per chunk
    by_one = select_blocks(qp, kp, layout, **kw)
    for chunked in (by_three, by_one):
        assert torch.equal(whole.counts, chunked.counts)
        assert _kept_sets(whole) == _kept_sets(chunked)


@pytest.mark.parametrize("docs,window", [([200], None), ([100, 150, 64, 90], None), ([33, 200, 65], None), ([300], 70)])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_sampled_shares_equal_a_plain_softmax_per_token(docs, window, dtype, atol):
    """The sampled scores (logits softmaxed in place in one reused scratch buffer, masked only on the column
    spans that the chunk's ends bound) equal each sampled token's own float64 softmax summed per key block, in
    every chunking, on documents with short tails (one real token among the samples) and under a window;
    scored in bfloat16 they stay within its rounding."""
    from sparsebalance_ft.attention import selection

    q, k = _qk(hq=4, hkv=2, length=sum(docs), d=16)
    layout = make_layout(docs, 32)
    qp, kp = (selection.to_layout(x[None], layout)[0] for x in (q, k))
    nb = layout.num_blocks
    causal = causal_counts(layout, window)
    lo = torch.arange(nb) - causal + 1
    want = sampled_block_shares(qp, kp, layout, 3, 0.3, window)
    qpos = sample_positions(layout, 0, nb, 3)
    q_sampled = (qp[:, qpos] * 0.3).to(dtype)
    span = int(causal.max())
    first_allowed = layout.first_allowed_blocks(window)
    assert first_allowed == lo.tolist()
    # each chunk's keys from its first query block's first allowed block (as the selection scores them), or from
    # its longest span back
    for rows, first_key in itertools.product((nb, 2, 1), (lambda i0: first_allowed[i0], lambda i0: max(0, i0 - span + 1))):
        got = torch.zeros(2, nb, nb, dtype=torch.float64)
        scratch = selection._sampled_scratch(qp, kp, rows, span, nb, 32, 3, dtype)
        for i0 in range(0, nb, rows):
            i1, k0 = min(nb, i0 + rows), first_key(i0)
            got[:, i0:i1, k0:i1] = selection._sampled_shares(q_sampled, qpos, kp.to(dtype), layout, i0, i1, k0, lo,
                                                             first_allowed, window, 3, scratch).double()
        torch.testing.assert_close(got, want, atol=atol, rtol=0)


def test_scoring_precision_is_bfloat16_only_where_it_is_native_and_asked_for(monkeypatch):
    from sparsebalance_ft.attention import selection

    cpu = torch.device("cpu")
    for native in (False, True):
        monkeypatch.setattr(selection, "_cpu_multiplies_bfloat16", lambda: native)
        assert selection.scoring_dtype("auto", torch.float32, cpu) == (torch.bfloat16 if native else None)
        assert selection.scoring_dtype("float32", torch.float32, cpu) == torch.float32
        assert selection.scoring_dtype("auto", torch.bfloat16, cpu) is None  # already 16-bit: scored as is
        assert selection.scoring_dtype("auto", torch.float16, cpu) is None


@pytest.mark.parametrize("precision,dtype", [("float32", torch.float32), ("auto", torch.bfloat16)])
def test_controller_scores_in_its_configured_precision(monkeypatch, precision, dtype):
    """The recipe's `score_precision` reaches the selection as the dtype its scoring runs in."""
    from sparsebalance_ft.attention import budget, selection

    monkeypatch.setattr(selection, "_cpu_multiplies_bfloat16", lambda: True)
    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs["score_dtype"])
        return select_block_sets(*args, **kwargs)

    monkeypatch.setattr(budget, "select_block_sets", recording)
    q, k = _qk(hq=6, hkv=2, length=1024)
    SparseAttentionController(SparsityConfig(score_precision=precision)).select(q, k, make_layout([1024], 64), 0.5, 0.2)
    assert seen == [dtype]


@pytest.mark.parametrize("selection", ["mass", "anchor"])
@pytest.mark.parametrize("docs,window", [([1024], None), ([300, 500, 64, 200], None), ([1500], 300)])
def test_several_budgets_from_one_scoring_equal_one_selection_each(selection, docs, window):
    """`select_at` (layer tuning's rank, MIN and MAX budgets from one scoring) keeps, at each budget, exactly
    the blocks `select` keeps at that budget alone, full budget included."""
    from sparsebalance_ft.attention import selection as sel_mod

    q, k = _qk(hq=6, hkv=2, length=sum(docs))
    layout = make_layout(docs, 64)
    qp, kp = (sel_mod.to_layout(x[None], layout)[0] for x in (q, k))
    ctl = SparseAttentionController(SparsityConfig(selection=selection, k_max=6, k_min=2))
    budgets = [0.5, 0.15, 0.9, 1.0]
    together = ctl.select_at(qp, kp, layout, budgets, 0.2, window)
    for budget, got in zip(budgets, together):
        alone = ctl.select(qp, kp, layout, budget, 0.2, window)
        assert torch.equal(got.counts, alone.counts) and got.full == alone.full
        assert _kept_sets(got) == _kept_sets(alone)


def test_query_scoring_keeps_the_block_a_query_retrieves():
    """One key token that only the last query token looks for (a needle): block means cannot see it, the
    sampled query tokens' exact attention can. With them the last query block keeps the needle's block in
    every head; ranked by block means alone (`score_queries=0`) it does not."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, length, d = 4, 2, 1024, 32
    q = 0.3 * torch.randn(hq, length, d, generator=g)
    k = 0.3 * torch.randn(hkv, length, d, generator=g)
    needle, last = 300, length - 1
    for h in range(hkv):
        k[h, needle] = 6.0 * q[2 * h:2 * h + 2, last].mean(0) / q[2 * h:2 * h + 2, last].mean(0).norm()
        q[2 * h:2 * h + 2, last] = 6.0 * k[h, needle] / k[h, needle].norm()
    layout = make_layout([length], 64)
    kw = dict(tau=0.3, k_max=4, k_min=2, sink_blocks=1, local_blocks=1, scale=d**-0.5)
    needle_block, last_block = needle // 64, layout.num_blocks - 1
    sampled = _kept_sets(select_blocks(q, k, layout, score_queries=4, **kw))
    pooled_only = _kept_sets(select_blocks(q, k, layout, score_queries=0, **kw))
    assert all(needle_block in head[last_block] for head in sampled)
    assert not all(needle_block in head[last_block] for head in pooled_only)
