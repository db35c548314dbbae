"""A stand-in block-sparse attention for cost-model tests (the real one lives in sparsebalance_ft.attention).

Per document (split where position_ids restart), each query block attends to its `w` most
recent key blocks, `w = max(1, round(d * (nb + 1) / 2))`, so the work is about `d` times that of
dense causal attention, and documents never attend across each other, like the real kernel.
`FakeController.force_density(d)` sets d for every layer.
"""
from __future__ import annotations

import math

import torch

NAME = "sbft_test_sparse"
BLOCK = 64


class FakeController:
    def __init__(self) -> None:
        self.density = 1.0
        self.reports = 0

    def force_density(self, density):
        self.density = 1.0 if density is None else float(density)

    def pop_report(self):
        self.reports = 0
        return None


CONTROLLER = FakeController()


def _doc_attention(q, k, v, density, scaling):
    _, h, n, dim = q.shape
    nb = math.ceil(n / BLOCK)
    w = max(1, min(nb, round(density * (nb + 1) / 2)))
    pad = nb * BLOCK - n
    if pad:
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    qb = q.view(1, h, nb, BLOCK, dim)

    def windows(t):
        tb = t.view(1, h, nb, BLOCK, dim)
        tb = torch.nn.functional.pad(tb, (0, 0, 0, 0, w - 1, 0))
        return tb.unfold(2, w, 1).permute(0, 1, 2, 5, 3, 4).reshape(1, h, nb, w * BLOCK, dim)

    kw, vw = windows(k), windows(v)
    scores = (qb @ kw.transpose(-1, -2)) * scaling
    qpos = (torch.arange(nb)[:, None] * BLOCK + torch.arange(BLOCK)[None, :])[:, :, None]
    kpos = ((torch.arange(nb)[:, None] - w + 1 + torch.arange(w)[None, :])[:, :, None] * BLOCK
            + torch.arange(BLOCK)[None, None, :]).reshape(nb, 1, w * BLOCK)
    mask = (kpos >= 0) & (kpos <= qpos)
    scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vw
    return out.reshape(1, h, nb * BLOCK, dim)[:, :, :n]


def fake_sparse_attention(module, query, key, value, attention_mask, scaling=None, position_ids=None, **kwargs):
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    total = query.shape[2]
    if position_ids is None:
        starts = [0]
    else:
        starts = (position_ids[0] == 0).nonzero().flatten().tolist() or [0]
    bounds = starts + [total]
    outs = [
        _doc_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], CONTROLLER.density, scaling)
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, fake_sparse_attention)
