"""Block selection: document-aligned block layout, anchors, pooled scoring, mass threshold and caps.

The selection works on a *document-aligned layout*: every document of a packed row starts at a block
boundary (its tail is padded with zeros up to the next boundary), so no block ever holds tokens of two
documents. Selection then never crosses documents by construction, a kept block is either fully visible
to its query block or is the diagonal block (causal triangle), and densities per document are simply
kept blocks / causal blocks over that document's own block grid.

Scoring (per key-value head group, query block i, key block j of the same document, j <= i):
``s_ij = scale * mean_q(i) . mean_k(j) + log(n_j)`` where ``n_j`` is the number of real tokens of block
j. ``exp(s_ij)`` approximates the unnormalised softmax mass of the whole block (the block's key mean
stands for each of its keys), so a softmax over j gives an *estimated mass share* that is comparable
across blocks and sums to one per query block. Shares are averaged over the query heads of a GQA group,
which therefore share one selection. Anchors (the first ``sink_blocks`` blocks of the document and the
``local_blocks`` most recent blocks, the diagonal included) are always kept; the other blocks are ranked
by estimated share and added in rank order by one of two rules:

- mass (``tau``): until anchors plus added blocks hold ``tau`` of the estimated mass;
- anchor (``margin``): every block whose log-share is at least the anchors' reference minus ``margin``. The
  reference is the largest log-share among the non-diagonal anchors (the sink and the previous local
  blocks), or the diagonal's when it is the only anchor. The diagonal is left out because its pooled score
  counts its whole key block although the causal triangle hides about half of it. The maximum (not a mean)
  reads as "nearly as strong as the strongest anchor": a sink that takes most of the mass raises the bar,
  a flat row keeps much more.

Then the count is floored at ``k_min`` and capped at ``max(k_max, anchors)`` (never above the causal count).
Both rules keep a prefix of the same ranking, so a looser threshold or a higher cap only adds blocks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

_NEG_INF = float("-inf")


@dataclass
class Layout:
    """Where each real token of one batch row sits in the document-aligned, block-padded sequence."""

    block_size: int
    length: int  # tokens in the original row
    padded_length: int  # multiple of block_size
    doc_lengths: list[int]
    src: torch.Tensor | None  # original token index of each placed token (None: identity layout)
    dst: torch.Tensor | None  # padded position of each placed token
    block_doc: torch.Tensor  # [nb] document index of each block
    block_start: torch.Tensor  # [nb] first block of the block's document
    block_tokens: torch.Tensor  # [nb] real tokens in each block

    @property
    def num_blocks(self) -> int:
        return self.padded_length // self.block_size

    @property
    def identity(self) -> bool:
        return self.src is None


def documents_from_positions(position_ids: torch.Tensor) -> list[int]:
    """Document lengths of one row of position ids: a new document starts wherever the id does not step by 1."""
    pos = position_ids.reshape(-1)
    if pos.numel() == 0:
        return []
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = (pos[1:] - pos[:-1]) != 1
    where = torch.nonzero(starts).flatten().tolist() + [pos.numel()]
    return [b - a for a, b in zip(where[:-1], where[1:])]


def make_layout(doc_lengths: list[int], block_size: int, device: torch.device | str = "cpu",
                tokens: torch.Tensor | None = None, length: int | None = None) -> Layout:
    """Layout of a row holding `doc_lengths` documents back to back.

    `tokens` (optional) lists the original indices of the placed tokens (e.g. the non-padding tokens of a
    padded row), in order; by default the tokens are 0..sum(doc_lengths)-1.
    """
    bs = block_size
    n_tokens = int(sum(doc_lengths))
    length = n_tokens if length is None else length
    blocks_per_doc = [max(1, -(-d // bs)) for d in doc_lengths]
    nb = sum(blocks_per_doc)
    identity = tokens is None and len(doc_lengths) <= 1 and n_tokens == length and n_tokens % bs == 0 and n_tokens > 0
    block_doc = torch.repeat_interleave(torch.arange(len(doc_lengths)), torch.tensor(blocks_per_doc, dtype=torch.long))
    first = torch.tensor([0] + blocks_per_doc[:-1], dtype=torch.long).cumsum(0)
    block_start = first[block_doc]
    # real tokens per block
    block_tokens = torch.full((nb,), bs, dtype=torch.long)
    last = (first + torch.tensor(blocks_per_doc) - 1)
    tails = torch.tensor([d - (nbd - 1) * bs for d, nbd in zip(doc_lengths, blocks_per_doc)], dtype=torch.long)
    block_tokens[last] = tails
    src = dst = None
    if not identity:
        offsets = torch.repeat_interleave(first * bs - torch.tensor([0] + doc_lengths[:-1]).cumsum(0),
                                          torch.tensor(doc_lengths, dtype=torch.long))
        dst = (torch.arange(n_tokens) + offsets).to(device)
        src = (tokens.to(device) if tokens is not None else torch.arange(n_tokens, device=device))
    return Layout(bs, length, nb * bs, list(doc_lengths), src, dst, block_doc.to(device), block_start.to(device),
                  block_tokens.to(device))


def to_layout(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """[B, H, L, D] -> [B, H, padded, D] (differentiable; a view when the layout is the identity)."""
    if layout.identity:
        return x
    out = x.new_zeros(x.shape[0], x.shape[1], layout.padded_length, x.shape[3])
    return out.index_copy(2, layout.dst, x.index_select(2, layout.src))


def from_layout(y: torch.Tensor, layout: Layout, dim: int = 2) -> torch.Tensor:
    """Inverse of `to_layout` along `dim`; tokens not placed (padding) come back as zeros."""
    if layout.identity:
        return y
    picked = y.index_select(dim, layout.dst)
    if layout.src.numel() == layout.length and bool((layout.src == torch.arange(layout.length, device=y.device)).all()):
        return picked
    shape = list(y.shape)
    shape[dim] = layout.length
    return y.new_zeros(shape).index_copy(dim, layout.src, picked)


@dataclass
class Selection:
    """Kept key blocks per (key-value head, query block) of one row in its layout."""

    indices: torch.Tensor  # [Hkv, nb, K] kept key block indices; the first counts[h, i] entries are valid
    counts: torch.Tensor  # [Hkv, nb] kept blocks per query block
    causal: torch.Tensor  # [nb] causal (allowed) blocks per query block
    full: bool = False  # every causal block kept
    select_seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def allowed_blocks(layout: Layout, window: int | None = None) -> torch.Tensor:
    """[nb, nb] bool: key block j may be attended by query block i (same document, causal, in window)."""
    nb, bs = layout.num_blocks, layout.block_size
    dev = layout.block_start.device
    i = torch.arange(nb, device=dev)[:, None]
    j = torch.arange(nb, device=dev)[None, :]
    allowed = (j <= i) & (j >= layout.block_start[:, None])
    if window is not None:
        allowed &= (j * bs + bs - 1) > (i * bs - window)
    return allowed


def causal_counts(layout: Layout, window: int | None = None) -> torch.Tensor:
    """Allowed key blocks per query block, without building the [nb, nb] grid."""
    nb, bs = layout.num_blocks, layout.block_size
    i = torch.arange(nb, device=layout.block_start.device)
    lo = layout.block_start
    if window is not None:
        # smallest j with j*bs + bs - 1 > i*bs - window
        lo = torch.maximum(lo, torch.div(i * bs - window - bs + 1, bs, rounding_mode="floor") + 1)
    return i - lo + 1


def pooled(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Mean over the real tokens of each block: [H, padded, D] -> [H, nb, D] in float32."""
    h, _, d = x.shape
    s = x.reshape(h, layout.num_blocks, layout.block_size, d).sum(2, dtype=torch.float32)
    return s / layout.block_tokens.clamp(min=1).to(s.dtype)[None, :, None]


@torch.no_grad()
def select_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    layout: Layout,
    *,
    tau: float | None = None,
    margin: float | None = None,
    k_max: int,
    k_min: int,
    sink_blocks: int,
    local_blocks: int,
    scale: float,
    force_density: float | None = None,
    window: int | None = None,
) -> Selection:
    """Select key blocks for one row. q: [Hq, padded, D], k: [Hkv, padded, D] in the layout.

    Exactly one of `tau` (the mass rule) and `margin` (the anchor rule) is given."""
    if (tau is None) == (margin is None):
        raise ValueError("select_blocks: give exactly one of tau (mass rule) and margin (anchor rule)")
    hq, hkv = q.shape[0], k.shape[0]
    g = hq // hkv
    nb = layout.num_blocks
    dev = q.device
    allowed = allowed_blocks(layout, window)
    causal = allowed.sum(-1)
    ar = torch.arange(nb, device=dev)
    loosest = tau >= 1.0 if margin is None else margin == math.inf
    full_budget = force_density is None and loosest and k_max >= nb
    if force_density is not None and force_density >= 1.0:
        full_budget = True
    if full_budget:
        # every allowed block, ascending; rows padded with their own diagonal (masked by counts)
        key = torch.where(allowed, ar[None, :].expand(nb, nb), ar[:, None].expand(nb, nb) + nb)
        K = int(causal.max())
        idx = key.topk(K, dim=-1, largest=False, sorted=True).values
        idx = torch.where(idx >= nb, idx - nb, idx)
        idx = idx[None].expand(hkv, nb, K)
        return Selection(idx, causal[None].expand(hkv, nb).clone(), causal, full=True)

    qb = pooled(q, layout).view(hkv, g, nb, -1)
    kb = pooled(k, layout).view(hkv, 1, nb, -1)
    s = torch.matmul(qb, kb.transpose(-1, -2)).mul_(scale)
    s.add_(layout.block_tokens.clamp(min=1).to(s.dtype).log()[None, None, None, :])
    s.masked_fill_(~allowed, _NEG_INF)
    p = torch.softmax(s, dim=-1).mean(1)  # [Hkv, nb, nb] estimated mass share
    p.masked_fill_(~allowed, 0.0)
    rel = ar[None, :] - layout.block_start[:, None]
    anchor = allowed & ((rel < sink_blocks) | ((ar[:, None] - ar[None, :]) < local_blocks))
    n_anchor = anchor.sum(-1)  # [nb]
    prio = torch.where(anchor, 2.0 + (ar[:, None] == ar[None, :]).float(), p)
    prio = prio.masked_fill(~allowed, -1.0)
    if force_density is not None:
        n = torch.round(force_density * causal.double()).long().clamp(min=1)
        n = torch.minimum(n, causal)[None].expand(hkv, nb)
        cap = int(n.max())
        order = prio.topk(cap, dim=-1, sorted=True).indices
    else:
        cap = int(min(nb, max(k_max, int(n_anchor.max()))))
        order = prio.topk(cap, dim=-1, sorted=True).indices if cap < nb else prio.argsort(-1, descending=True)
        if margin is None:
            ps = p.gather(-1, order)
            excl = ps.cumsum(-1) - ps
            n_thr = (excl < tau).sum(-1)
        else:
            n_thr = n_anchor[None] + _within_margin(p.log(), anchor, allowed, margin).sum(-1)
        n = torch.maximum(n_thr, n_anchor[None])
        n = n.clamp(min=k_min)
        n = torch.minimum(n, torch.clamp(n_anchor, min=k_max)[None])
        n = torch.minimum(n, causal[None])
    K = int(n.max())
    idx = order[..., :K].contiguous()
    # pad invalid slots with the diagonal block (masked out by counts)
    slot = torch.arange(K, device=dev)
    idx = torch.where(slot[None, None, :] < n[..., None], idx, ar[None, :, None].expand_as(idx))
    return Selection(idx, n.contiguous(), causal, full=False)


def _within_margin(logp: torch.Tensor, anchor: torch.Tensor, allowed: torch.Tensor, margin: float) -> torch.Tensor:
    """[Hkv, nb, nb] non-anchor allowed blocks whose log-share is within `margin` of the anchors' reference."""
    nb = anchor.shape[0]
    diag = torch.eye(nb, dtype=torch.bool, device=anchor.device)
    side = anchor & ~diag
    ref = logp.masked_fill(~side, _NEG_INF).amax(-1)
    ref = torch.where(side.any(-1), ref, logp.diagonal(dim1=-2, dim2=-1))
    return allowed & ~anchor & (logp >= ref[..., None] - margin)


def forced_count(causal: torch.Tensor, density: float) -> torch.Tensor:
    return torch.minimum(torch.round(density * causal.double()).long().clamp(min=1), causal)


@torch.no_grad()
def sampled_recall(
    q: torch.Tensor, k: torch.Tensor, layout: Layout, sel: Selection, samples: int, scale: float,
    generator: torch.Generator | None = None, window: int | None = None,
) -> float | None:
    """Share of the exact dense softmax mass held by the kept blocks, averaged over `samples` random
    (key-value head, query block) pairs, their query heads and real query tokens."""
    if samples <= 0:
        return None
    if sel.full:
        return 1.0
    hq, hkv = q.shape[0], k.shape[0]
    g = hq // hkv
    nb, bs = layout.num_blocks, layout.block_size
    total = 0.0
    picks = torch.randint(0, hkv * nb, (samples,), generator=generator).tolist()
    for pick in picks:
        h, i = divmod(pick, nb)
        start = int(layout.block_start[i])
        real = int(layout.block_tokens[i])
        qi = q[h * g:(h + 1) * g, i * bs:i * bs + real].float()  # [G, real, D]
        ks = k[h, start * bs:(i + 1) * bs].float()  # [nk, D]
        logits = torch.matmul(qi, ks.T) * scale
        qpos = torch.arange(i * bs, i * bs + real)[:, None]
        kpos = torch.arange(start * bs, (i + 1) * bs)[None, :]
        ok = kpos <= qpos
        if window is not None:
            ok &= kpos > qpos - window
        logits.masked_fill_(~ok.to(logits.device), _NEG_INF)
        prob = torch.softmax(logits, -1)
        kept_blocks = sel.indices[h, i, : int(sel.counts[h, i])] - start
        kept = torch.zeros(i - start + 1, dtype=torch.bool, device=q.device)
        kept[kept_blocks] = True
        kept_tok = kept.repeat_interleave(bs)
        total += float(prob[..., kept_tok].sum(-1).mean())
    return total / len(picks)


def block_density_by_doc(layout: Layout, sel: Selection) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept, causal) block counts per document, summed over key-value heads."""
    ndoc = len(layout.doc_lengths)
    kept = torch.zeros(ndoc, dtype=torch.float64)
    caus = torch.zeros(ndoc, dtype=torch.float64)
    bd = layout.block_doc.cpu()
    hkv = sel.counts.shape[0]
    kept.index_add_(0, bd, sel.counts.sum(0).cpu().double())
    caus.index_add_(0, bd, sel.causal.cpu().double() * hkv)
    return kept, caus


def causal_blocks(length: int, block_size: int) -> int:
    nb = max(1, math.ceil(length / block_size))
    return nb * (nb + 1) // 2
