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
    sel = select_blocks(q[0].detach(), k[0].detach(), layout, tau=0.6, k_max=3, k_min=2, sink_blocks=1,
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
