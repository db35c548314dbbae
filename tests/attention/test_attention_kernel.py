"""Exactness of the block-sparse kernels: full selection == dense causal attention; partial == masked dense."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sparsebalance_ft.attention import block_sparse_attention, make_layout, select_blocks
from sparsebalance_ft.attention.kernels import torch_kernel
from sparsebalance_ft.attention.kernels.flex import FLEX_AVAILABLE


def _qkv(hq, hkv, length, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(1, h, length, d, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv)


def _grads(fn, q, k, v, go):
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), go))


def _masked_reference(q, k, v, idx, counts, bs, window=None):
    """Dense softmax attention with the same block mask (and token-level causality)."""
    hq, hkv, length = q.shape[1], k.shape[1], q.shape[2]
    nb = length // bs
    bm = torch.zeros(hkv, nb, nb, dtype=torch.bool)
    for h in range(hkv):
        for i in range(nb):
            bm[h, i, idx[0, h, i, : counts[0, h, i]]] = True
    tm = bm.repeat_interleave(bs, 1).repeat_interleave(bs, 2) & torch.ones(length, length, dtype=torch.bool).tril()
    if window is not None:
        tm &= torch.arange(length)[None, :] > torch.arange(length)[:, None] - window
    tm = tm.repeat_interleave(hq // hkv, 0)
    kk, vv = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    s = (q @ kk.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.softmax(s.masked_fill(~tm[None], float("-inf")), -1) @ vv


def _full_selection(length, bs, hkv):
    nb = length // bs
    idx = torch.arange(nb).expand(nb, nb).clone()
    idx = torch.where(idx <= torch.arange(nb)[:, None], idx, torch.arange(nb)[:, None].expand(nb, nb))
    counts = torch.arange(1, nb + 1)
    return idx[None, None].expand(1, hkv, nb, nb).contiguous(), counts[None, None].expand(1, hkv, nb).contiguous()


@pytest.mark.parametrize("bs", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_full_selection_equals_dense_causal(bs, hq, hkv):
    length, d = 4 * bs, 32
    q, k, v = _qkv(hq, hkv, length, d)
    go = torch.randn(1, hq, length, d)
    idx, counts = _full_selection(length, bs, hkv)
    sparse = _grads(lambda a, b, c: block_sparse_attention(a, b, c, idx, counts, block_size=bs, chunk_blocks=5),
                    q, k, v, go)
    dense = _grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=hq != hkv),
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
    q, k, v = _qkv(hq, hkv, length, d, dtype=torch.float64, seed=1)
    go = torch.randn(1, hq, length, d, dtype=torch.float64)
    layout = make_layout([length], bs)
    sel = select_blocks(q[0].detach(), k[0].detach(), layout, tau=0.6, k_max=3, k_min=2, sink_blocks=1,
                        local_blocks=1, scale=d**-0.5, window=window)
    assert (sel.counts < sel.causal[None]).any()
    idx, counts = sel.indices[None], sel.counts[None]
    sparse = _grads(lambda a, b, c: block_sparse_attention(a, b, c, idx, counts, block_size=bs, window=window,
                                                           chunk_blocks=4), q, k, v, go)
    ref = _grads(lambda a, b, c: _masked_reference(a, b, c, idx, counts, bs, window), q, k, v, go)
    for s, r in zip(sparse, ref):
        torch.testing.assert_close(s, r, atol=1e-10, rtol=1e-8)


def test_arbitrary_indices_without_diagonal_use_masked_path():
    bs, hq, hkv, length, d = 64, 2, 1, 256, 16
    q, k, v = _qkv(hq, hkv, length, d, dtype=torch.float64, seed=2)
    go = torch.randn(1, hq, length, d, dtype=torch.float64)
    idx = torch.tensor([[[[0, 0], [0, 1], [0, 2], [1, 3]]]])
    counts = torch.tensor([[[1, 2, 1, 2]]])
    sparse = _grads(lambda a, b, c: block_sparse_attention(a, b, c, idx, counts, block_size=bs), q, k, v, go)
    ref = _grads(lambda a, b, c: _masked_reference(a, b, c, idx, counts, bs), q, k, v, go)
    for s, r in zip(sparse, ref):
        torch.testing.assert_close(s, r, atol=1e-10, rtol=1e-8)


def test_bfloat16_runs_close_to_float32():
    bs, hq, hkv, length, d = 64, 4, 2, 256, 32
    q, k, v = _qkv(hq, hkv, length, d, seed=3)
    idx, counts = _full_selection(length, bs, hkv)
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
    q, k, v = (t.detach() for t in _qkv(hq, hkv, length, d, seed=4))
    layout = make_layout([length], bs)
    sel = select_blocks(q[0].detach(), k[0].detach(), layout, tau=0.5, k_max=3, k_min=2, sink_blocks=1,
                        local_blocks=1, scale=d**-0.5, window=window)
    idx, counts = sel.indices[None], sel.counts[None]
    with torch.no_grad():  # FlexAttention has no CPU backward; eager forward only checks the block mask
        out = block_sparse_attention(q, k, v, idx, counts, block_size=bs, window=window, backend="flex")
        ref = _masked_reference(q, k, v, idx, counts, bs, window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
