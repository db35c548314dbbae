"""Dense references for the block-sparse kernels' tests (torch kernel, Triton kernel)."""
from __future__ import annotations

import math

import torch


def qkv(hq, hkv, length, d, dtype=torch.float32, seed=0, batch=1):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(batch, h, length, d, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv)


def grads(fn, q, k, v, go):
    """(output, dq, dk, dv) of fn(q, k, v) for the output gradient `go`."""
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), go))


def masked_reference(q, k, v, idx, counts, bs, window=None, sinks=None):
    """Dense softmax attention with the same block mask (and token-level causality); `sinks` [Hq]: one extra
    logit per head in every softmax denominator, without a value (GPT-OSS's eager attention)."""
    b, hq, length = q.shape[:3]
    hkv = k.shape[1]
    nb = length // bs
    bm = torch.zeros(b, hkv, nb, nb, dtype=torch.bool)
    for n in range(b):
        for h in range(hkv):
            for i in range(nb):
                bm[n, h, i, idx[n, h, i, : counts[n, h, i]]] = True
    tm = bm.repeat_interleave(bs, 2).repeat_interleave(bs, 3) & torch.ones(length, length, dtype=torch.bool).tril()
    if window is not None:
        tm &= torch.arange(length)[None, :] > torch.arange(length)[:, None] - window
    tm = tm.repeat_interleave(hq // hkv, 1)
    kk, vv = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    s = (q @ kk.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~tm, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, hq, 1, 1).expand(b, hq, length, 1).to(s.dtype)], dim=-1)
        return torch.softmax(s, -1)[..., :-1] @ vv
    return torch.softmax(s, -1) @ vv


def full_selection(length, bs, hkv, batch=1):
    """Every causal block kept: (indices [batch, hkv, nb, nb], counts [batch, hkv, nb])."""
    nb = length // bs
    idx = torch.arange(nb).expand(nb, nb).clone()
    idx = torch.where(idx <= torch.arange(nb)[:, None], idx, torch.arange(nb)[:, None].expand(nb, nb))
    counts = torch.arange(1, nb + 1)
    return (idx[None, None].expand(batch, hkv, nb, nb).contiguous(),
            counts[None, None].expand(batch, hkv, nb).contiguous())


def allowed_blocks(layout, window=None):
    """[nb, nb] bool grid, built the obvious way: key block j may be attended by query block i (same document,
    causal, some token within `window`). The library counts these without the grid (`causal_counts`)."""
    nb, bs = layout.num_blocks, layout.block_size
    allowed = torch.zeros(nb, nb, dtype=torch.bool)
    for i in range(nb):
        for j in range(int(layout.block_start[i]), i + 1):
            allowed[i, j] = window is None or j * bs + bs - 1 > i * bs - window
    return allowed
