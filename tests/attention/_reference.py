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


def sampled_block_shares(q, k, layout, per_block, scale, window=None):
    """[Hkv, nb, nb] the selection's sampled scores, the plain way, one query token at a time: for each query
    block, `per_block` tokens evenly spaced and ending at its last real token; each one's softmax over every
    key token it may see (same document, not later, a real token, within `window`), summed per key block;
    averaged over the tokens and the group's query heads."""
    hq, hkv, bs, nb = q.shape[0], k.shape[0], layout.block_size, layout.num_blocks
    g = hq // hkv
    out = torch.zeros(hkv, nb, nb, dtype=torch.float64)
    for r in range(nb):
        real = max(1, int(layout.block_tokens[r]))
        for t in range(1, per_block + 1):
            i = r * bs + max(0, t * real // per_block - 1)
            keys = [j for j in range(i + 1) if layout.block_doc[j // bs] == layout.block_doc[r]
                    and j % bs < int(layout.block_tokens[j // bs]) and (window is None or j > i - window)]
            for h in range(hq):
                p = torch.softmax(scale * (k[h // g, keys].double() @ q[h, i].double()), 0)
                for j, pj in zip(keys, p):
                    out[h // g, r, j // bs] += pj / (g * per_block)
    return out
