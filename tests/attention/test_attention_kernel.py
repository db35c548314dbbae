"""Exactness of the block-sparse kernels: full selection == dense causal attention; partial == masked dense."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _reference import full_selection, grads, masked_reference, qkv
from sparsebalance_ft.attention import block_sparse_attention, make_layout, select_blocks
from sparsebalance_ft.attention.kernels import torch_kernel
from sparsebalance_ft.attention.kernels.flex import FLEX_AVAILABLE


@pytest.mark.parametrize("bs", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_full_selection_equals_dense_causal(bs, hq, hkv):
    length, d = 4 * bs, 32
    q, k, v = qkv(hq, hkv, length, d)
    go = torch.randn(1, hq, length, d)
    idx, counts = full_selection(length, bs, hkv)
    sparse = grads(lambda a, b, c: block_sparse_attention(a, b, c, idx, counts, block_size=bs, chunk_blocks=5),
                   q, k, v, go)
    dense = grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=hq != hkv),
                  q, k, v, go)
    for s, r in zip(sparse, dense):
        torch.testing.assert_close(s, r, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("bs", [64, 128])
@pytest.mark.parametrize("window", [None, 150])
@pytest.mark.parametrize("flash", [True, False])
def test_partial_selection_equals_masked_reference(bs, window, flash, monkeypatch):
    if not flash:  # the plain-matmul engine (what non-CPU devices use)
        monkeypatch.setattr(torch_kernel, "_CPU_FLASH", None)
    hq, hkv, length, d = 4, 2, 6 * bs, 32
    q, k, v = qkv(hq, hkv, length, d, dtype=torch.float64, seed=1)
    go = torch.randn(1, hq, length, d, dtype=torch.float64)
    layout = make_layout([length], bs)
    sel = select_blocks(q[0].detach(), k[0].detach(), layout, tau=0.6, k_max=2, k_min=2, sink_blocks=1,
                        local_blocks=1, scale=d**-0.5, window=window)
    assert (sel.counts < sel.causal[None]).any()
    idx, counts = sel.indices[None], sel.counts[None]
    sparse = grads(lambda a, b, c: block_sparse_attention(a, b, c, idx, counts, block_size=bs, window=window,
                                                          chunk_blocks=4), q, k, v, go)
    ref = grads(lambda a, b, c: masked_reference(a, b, c, idx, counts, bs, window), q, k, v, go)
    for s, r in zip(sparse, ref):
        torch.testing.assert_close(s, r, atol=1e-10, rtol=1e-8)


def test_arbitrary_indices_without_diagonal_use_masked_path():
    bs, hq, hkv, length, d = 64, 2, 1, 256, 16
    q, k, v = qkv(hq, hkv, length, d, dtype=torch.float64, seed=2)
    go = torch.randn(1, hq, length, d, dtype=torch.float64)
    idx = torch.tensor([[[[0, 0], [0, 1], [0, 2], [1, 3]]]])
    counts = torch.tensor([[[1, 2, 1, 2]]])
    sparse = grads(lambda a, b, c: block_sparse_attention(a, b, c, idx, counts, block_size=bs), q, k, v, go)
    ref = grads(lambda a, b, c: masked_reference(a, b, c, idx, counts, bs), q, k, v, go)
    for s, r in zip(sparse, ref):
        torch.testing.assert_close(s, r, atol=1e-10, rtol=1e-8)


def test_bfloat16_runs_close_to_float32():
    bs, hq, hkv, length, d = 64, 4, 2, 256, 32
    q, k, v = qkv(hq, hkv, length, d, seed=3)
    idx, counts = full_selection(length, bs, hkv)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    qb, kb, vb = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    out = block_sparse_attention(qb, kb, vb, idx, counts, block_size=bs)
    out.float().sum().backward()
    assert kb.grad is not None and kb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not FLEX_AVAILABLE, reason="FlexAttention unavailable")
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [None, 100])
def test_flex_block_mask_matches_reference(window):
    bs, hq, hkv, length, d = 64, 4, 2, 384, 16
    q, k, v = (t.detach() for t in qkv(hq, hkv, length, d, seed=4))
    layout = make_layout([length], bs)
    sel = select_blocks(q[0].detach(), k[0].detach(), layout, tau=0.5, k_max=3, k_min=2, sink_blocks=1,
                        local_blocks=1, scale=d**-0.5, window=window)
    idx, counts = sel.indices[None], sel.counts[None]
    with torch.no_grad():  # FlexAttention has no CPU backward; eager forward only checks the block mask
        out = block_sparse_attention(q, k, v, idx, counts, block_size=bs, window=window, backend="flex")
        ref = masked_reference(q, k, v, idx, counts, bs, window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("flash", [True, False])
def test_query_block_without_kept_blocks_gives_zero_output_and_gradients(flash, monkeypatch):
    if not flash:  # the plain-matmul engine (what non-CPU devices use)
        monkeypatch.setattr(torch_kernel, "_CPU_FLASH", None)
    bs, hq, hkv, length, d = 64, 4, 2, 256, 16
    q, k, v = qkv(hq, hkv, length, d, dtype=torch.float64, seed=5)
    go = torch.randn(1, hq, length, d, dtype=torch.float64)
    idx, counts = full_selection(length, bs, hkv)
    counts = counts.clone()
    counts[0, 1, 2] = 0  # kv head 1, query block 2 keeps nothing
    empty = slice(2 * bs, 3 * bs)
    out, dq, dk, dv = grads(lambda a, b, c: block_sparse_attention(a, b, c, idx, counts, block_size=bs), q, k, v, go)
    assert torch.equal(out[0, 2:4, empty], torch.zeros_like(out[0, 2:4, empty]))  # query heads 2, 3 of kv head 1
    assert torch.equal(dq[0, 2:4, empty], torch.zeros_like(dq[0, 2:4, empty]))
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv))
    # reference: the same block kept its diagonal but receives no output gradient, so it adds nothing to dk, dv
    counts_ref = counts.clone()
    counts_ref[0, 1, 2] = 1
    idx_ref = idx.clone()
    idx_ref[0, 1, 2, 0] = 2
    go_ref = go.clone()
    go_ref[0, 2:4, empty] = 0
    ref = grads(lambda a, b, c: masked_reference(a, b, c, idx_ref, counts_ref, bs), q, k, v, go_ref)
    keep = torch.ones(length, dtype=torch.bool)
    keep[empty] = False
    torch.testing.assert_close(out[0, 2:4, keep], ref[0][0, 2:4, keep])
    torch.testing.assert_close(out[0, :2], ref[0][0, :2])
    torch.testing.assert_close(dk, ref[2])
    torch.testing.assert_close(dv, ref[3])


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("partial,window", [(False, None), (True, None), (True, 150)])
def test_attention_sinks_equal_the_eager_sink_softmax(flash, partial, window, monkeypatch):
    """GPT-OSS's sink logits: outputs and gradients (q, k, v and the sinks) against the dense reference."""
    if not flash:
        monkeypatch.setattr(torch_kernel, "_CPU_FLASH", None)
    bs, hq, hkv, length, d = 64, 4, 2, 384, 16
    q, k, v = qkv(hq, hkv, length, d, dtype=torch.float64, seed=6)
    sinks = torch.randn(hq, dtype=torch.float64, generator=torch.Generator().manual_seed(7)).mul(2).requires_grad_()
    go = torch.randn(1, hq, length, d, dtype=torch.float64)
    if partial:
        sel = select_blocks(q[0].detach(), k[0].detach(), make_layout([length], bs), tau=0.5, k_max=3, k_min=2,
                            sink_blocks=1, local_blocks=1, scale=d**-0.5, window=window)
        idx, counts = sel.indices[None], sel.counts[None]
    else:  # every causal block: the split (diagonal + off-diagonal) path of the flash engine
        idx, counts = full_selection(length, bs, hkv)
    sparse = block_sparse_attention(q, k, v, idx, counts, block_size=bs, window=window, sinks=sinks)
    ref = masked_reference(q, k, v, idx, counts, bs, window, sinks=sinks)
    torch.testing.assert_close(sparse, ref, atol=1e-10, rtol=1e-8)
    got = torch.autograd.grad(sparse, (q, k, v, sinks), go)
    want = torch.autograd.grad(ref, (q, k, v, sinks), go)
    for s, r in zip(got, want):
        torch.testing.assert_close(s, r, atol=1e-10, rtol=1e-8)


def test_documents_in_one_fused_call_equal_sdpa_per_document():
    """The full-budget route over packed documents: one kernel call, the same output as SDPA per document."""
    from sparsebalance_ft.attention.register import _dense_docs

    bs, hq, hkv, d = 16, 4, 2, 16
    layout = make_layout([40, 16, 75, 3], bs)
    q, k, v = qkv(hq, hkv, layout.padded_length, d, dtype=torch.float64, seed=8)
    go = torch.randn(1, hq, layout.padded_length, d, dtype=torch.float64)
    fused = grads(lambda a, b, c: _dense_docs(a, b, c, layout, d**-0.5, "torch", 256), q, k, v, go)

    def per_document(a, b, c):
        outs, start = [], 0
        for n in layout.doc_lengths:
            sl = slice(start, start + -(-n // bs) * bs)
            outs.append(F.scaled_dot_product_attention(a[:, :, sl], b[:, :, sl], c[:, :, sl], is_causal=True,
                                                       enable_gqa=True))
            start = sl.stop
        return torch.cat(outs, dim=2)

    for s, r in zip(fused, grads(per_document, q, k, v, go)):
        torch.testing.assert_close(s, r, atol=1e-12, rtol=1e-10)


def _dense_blocks(num, idx, cols):
    """[..., rows] counts and [..., rows, W] indices -> [..., rows, cols] bool (a test-side densifier)."""
    valid = torch.arange(idx.shape[-1]) < num[..., None].long()
    out = torch.zeros(*idx.shape[:-1], cols + 1, dtype=torch.bool)
    return out.scatter_(-1, torch.where(valid, idx.long(), cols), True)[..., :cols]


@pytest.mark.skipif(not FLEX_AVAILABLE, reason="FlexAttention unavailable")
@pytest.mark.parametrize("window", [None, 100])
def test_flex_block_mask_is_the_torch_kernels_block_set(window):
    """The BlockMask built from compact indices holds exactly the kept blocks (per query head of each GQA
    group), full blocks only where no mask is needed, and query-side lists that transpose the key side."""
    from sparsebalance_ft.attention.kernels.flex import build_block_mask

    bs, hq, hkv, length, d = 64, 6, 2, 640, 16
    q, k, _ = (t.detach() for t in qkv(hq, hkv, length, d, seed=9))
    sel = select_blocks(q[0], k[0], make_layout([length], bs), tau=0.5, k_max=3, k_min=2, sink_blocks=1,
                        local_blocks=1, scale=d**-0.5, window=window)
    idx, counts = sel.indices[None], sel.counts[None]
    nb = length // bs
    bm = build_block_mask(idx, counts, bs, hq // hkv, length, window, eager_table=False)
    assert bm.kv_indices.shape[-1] == idx.shape[-1] < nb  # as wide as the selection, not the sequence
    kept = _dense_blocks(counts, idx, nb).repeat_interleave(hq // hkv, dim=1)  # the torch kernel's block set
    partial = _dense_blocks(bm.kv_num_blocks, bm.kv_indices, nb)
    full = _dense_blocks(bm.full_kv_num_blocks, bm.full_kv_indices, nb)
    assert torch.equal(partial | full, kept) and not (partial & full).any()
    i, j = torch.arange(nb)[:, None], torch.arange(nb)[None, :]
    no_mask_needed = j < i
    if window is not None:
        no_mask_needed &= j * bs > i * bs + bs - 1 - window
    assert torch.equal(full, kept & no_mask_needed)
    assert torch.equal(_dense_blocks(bm.q_num_blocks, bm.q_indices, nb), partial.transpose(-1, -2))
    assert torch.equal(_dense_blocks(bm.full_q_num_blocks, bm.full_q_indices, nb), full.transpose(-1, -2))


@pytest.mark.skipif(not FLEX_AVAILABLE, reason="FlexAttention unavailable")
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_sinks_match_reference():
    bs, hq, hkv, length, d = 64, 4, 2, 256, 16
    q, k, v = (t.detach() for t in qkv(hq, hkv, length, d, seed=10))
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(11))
    idx, counts = full_selection(length, bs, hkv)
    with torch.no_grad():
        out = block_sparse_attention(q, k, v, idx, counts, block_size=bs, backend="flex", sinks=sinks)
        ref = masked_reference(q, k, v, idx, counts, bs, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
