"""Block selection: document-aligned block layout, anchors, block scoring, mass threshold and caps.

The selection works on a *document-aligned layout*: every document of a packed row starts at a block
boundary (its tail is padded with zeros up to the next boundary), so no block ever holds tokens of two
documents. Selection then never crosses documents by construction, a kept block is either fully visible
to its query block or is the diagonal block (causal triangle), and densities per document are simply
kept blocks / causal blocks over that document's own block grid.

Scoring (per key-value head group, query block i, key block j of the same document, j <= i) takes the
larger of two estimates of the share of i's softmax mass that falls in j, renormalised to sum to one:

- block means: ``s_ij = scale * mean_q(i) . mean_k(j) + log(n_j)`` (``n_j`` real tokens in j); ``exp(s_ij)``
  approximates the block's unnormalised mass when its key mean stands for each key. Smooth, it tracks what
  most queries of the block read, but one key that one query needs drowns in its block's mean;
- sampled queries: the exact softmax of ``score_queries`` tokens of block i (evenly spaced, the last real
  token included) over every visible key, summed per key block. Sharp where the mean is blind: on
  SmolLM2-135M a passkey's block is found by the question's tokens, not by the mean of their block. In
  torch ops over chunks of query blocks (`_sampled_shares`), or on a GPU with triton in one kernel that
  never writes the logits (kernels/sampled_mass.py).

Shares are averaged over the query heads of a GQA group, which therefore share one selection. Anchors (the
first ``sink_blocks`` blocks of the document and the ``local_blocks`` most recent blocks, the diagonal
included) are always kept; the other blocks are ranked by share and added in rank order by one of two rules:

- mass (``tau``): until the added blocks hold ``tau`` of the share the anchors leave (see `_within_mass`);
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

import functools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .config import SparsityConfig
from .kernels.sampled_mass import fused_sampling_available, sampled_block_mass

_NEG_INF = float("-inf")
# The recipe's default, so that a caller without a recipe (a bench, a test) selects as training does.
_DEFAULT_SCORE_QUERIES: int = SparsityConfig.model_fields["score_queries"].default


@dataclass
class Layout:
    """Where each real token of one batch row sits in the document-aligned, block-padded sequence."""

    block_size: int
    length: int  # tokens in the original row
    padded_length: int  # multiple of block_size
    doc_lengths: list[int]
    src: torch.Tensor | None  # original token index of each placed token, ascending (None: identity layout)
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

    def host_blocks(self) -> tuple[list[int], list[int]]:
        """(first block of each block's document, real tokens of each block) as host lists, from
        `doc_lengths` alone: what the attention needs on the host without reading the device."""
        if getattr(self, "_host_blocks", None) is None:
            starts, tokens, first = [], [], 0
            for n in self.doc_lengths:
                blocks = max(1, -(-n // self.block_size))
                starts += [first] * blocks
                tokens += [self.block_size] * (blocks - 1) + [n - (blocks - 1) * self.block_size]
                first += blocks
            self._host_blocks = (starts, tokens)
        return self._host_blocks

    def first_allowed_blocks(self, window: int | None = None) -> list[int]:
        """Each query block's first allowed key block, its document's first or its window's (`arange -
        causal_counts + 1`), as a host list from `doc_lengths` alone: never a read of the device."""
        starts, _ = self.host_blocks()
        if window is None:
            return starts
        return [max(start, _window_first_block(i, self.block_size, window)) for i, start in enumerate(starts)]

    def longest_span(self, window: int | None = None) -> int:
        """The most allowed key blocks of any query block (`causal_counts(...).max()`, known on the host):
        the longest document's blocks, or fewer under a sliding window."""
        span = max(max(1, -(-n // self.block_size)) for n in self.doc_lengths)
        if window is not None:
            span = min(span, -(-(window + self.block_size - 1) // self.block_size))
        return span


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
    if layout.src.numel() == layout.length:  # ascending and distinct: every token of the row, in order
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

    @property
    def density(self) -> float:
        """Kept / causal blocks over every key-value head (a read of the counts: off the hot path)."""
        return float(self.counts.sum()) / float(self.causal.sum() * self.counts.shape[0])


def causal_counts(layout: Layout, window: int | None = None) -> torch.Tensor:
    """Allowed key blocks per query block (same document, causal, in window), without an [nb, nb] grid."""
    nb, bs = layout.num_blocks, layout.block_size
    i = torch.arange(nb, device=layout.block_start.device)
    lo = layout.block_start
    if window is not None:
        lo = torch.maximum(lo, _window_first_block(i, bs, window))
    return i - lo + 1


def _window_first_block(i, block_size: int, window: int):
    """The first key block that query block `i`'s last token still sees through a sliding `window`: the
    smallest j with j*bs + bs - 1 > i*bs - window. Floor division on ints (`Layout.first_allowed_blocks`, on
    the host) and on tensors (`causal_counts`, on the device) alike, so the two keep one rule."""
    return (i * block_size - window - block_size + 1) // block_size + 1


def pooled(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Mean over the real tokens of each block: [H, padded, D] -> [H, nb, D] in float32."""
    h, _, d = x.shape
    s = x.reshape(h, layout.num_blocks, layout.block_size, d).sum(2, dtype=torch.float32)
    return s / layout.block_tokens.clamp(min=1).to(s.dtype)[None, :, None]


# Elements of one chunk's sampled logits (softmaxed in place): 32 MiB in bfloat16 on CPU, where 4x fewer
# elements (so more chunks, each a few dozen small ops) made the selection 1.4x slower at 32K tokens, and half
# or twice as many were no faster with 8 sampled tokens; a GPU takes bigger chunks, because each chunk is a
# few dozen kernel launches.
_CHUNK_ELEMENTS = {"cpu": 1 << 24, "cuda": 1 << 26}
# Most query blocks per chunk on CPU: 8 was the fastest measured at 1K-32K tokens. Fewer pay a few dozen
# small ops per block (a third of the selection's time at 32K with one block per chunk); more leave the
# cache and, at short lengths, score keys past the chunk's first rows' causal span.
_CHUNK_ROWS_MAX = {"cpu": 8}


def scoring_dtype(precision: str, dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
    """The dtype of the sampled queries' logits for q of `dtype` on `device` (None: q's own) under a config's
    `score_precision`. The logits only rank key blocks, and a GPU run already scores in the model's bfloat16:
    a float32 CPU run that has native bfloat16 dot products scores as the GPU does, and faster (the same
    blocks to 99.9%: `bench/score_precision.py`)."""
    if precision == "float32":
        return torch.float32
    if dtype in (torch.bfloat16, torch.float16):
        return None
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    if device.type == "cpu" and _cpu_multiplies_bfloat16():
        return torch.bfloat16
    return None


@functools.cache
def _cpu_multiplies_bfloat16() -> bool:
    """AVX512-BF16 or AMX (torch's private probes, absent in some builds: then no)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def _chunk_elements(device: torch.device) -> int:
    return _CHUNK_ELEMENTS.get(device.type, _CHUNK_ELEMENTS["cuda"])


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
    score_queries: int = _DEFAULT_SCORE_QUERIES,
) -> Selection:
    """Select key blocks for one row. q: [Hq, padded, D], k: [Hkv, padded, D] in the layout. Exactly one of
    `tau` (the mass rule) and `margin` (the anchor rule) is given; see `select_block_sets`."""
    if (tau is None) == (margin is None):
        raise ValueError("select_blocks: give exactly one of tau (mass rule) and margin (anchor rule)")
    rule = "mass" if margin is None else "anchor"
    return select_block_sets(q, k, layout, rule, [(tau if margin is None else margin, k_max)], k_min=k_min,
                             sink_blocks=sink_blocks, local_blocks=local_blocks, scale=scale,
                             force_density=force_density, window=window, score_queries=score_queries)[0]


@torch.no_grad()
def select_block_sets(
    q: torch.Tensor,
    k: torch.Tensor,
    layout: Layout,
    rule: str,
    limits: Sequence[tuple[float, int]],
    *,
    k_min: int,
    sink_blocks: int,
    local_blocks: int,
    scale: float,
    force_density: float | None = None,
    window: int | None = None,
    score_queries: int = _DEFAULT_SCORE_QUERIES,
    score_dtype: torch.dtype | None = None,
    sampling_kernel: bool = True,
) -> list[Selection]:
    """One selection per (threshold, k_max) in `limits`, all from one scoring of the blocks: under `rule`
    "mass" the threshold is `tau`, under "anchor" the margin. Every selection keeps a prefix of the same
    ranking, so asking for several budgets (layer-level tuning wants the rank's, MIN's and MAX's) costs
    one scoring, which is most of a selection's time, instead of one each.

    Query blocks are scored and selected in chunks, so no temporary grows with (query blocks x key blocks):
    the largest is one chunk's sampled logits (with the kernel, which writes none, its pooled scores),
    `_CHUNK_ELEMENTS` elements. No host sync on a GPU: the longest causal span (sizing the chunks), each
    chunk's first allowed key block and the key columns its sampled queries may not see come from the
    layout's document lengths, and every selection is as wide as its cap, so nothing is read back from the
    device. `sampling_kernel`: score the sampled queries with the Triton
    kernel where it runs (`fused_sampling_available`); False keeps torch ops everywhere."""
    if rule not in ("mass", "anchor") or not limits:
        raise ValueError(f"select_block_sets: rule must be 'mass' or 'anchor' with at least one limit, got {rule!r}")
    hq, hkv = q.shape[0], k.shape[0]
    nb, dev = layout.num_blocks, q.device
    ar = torch.arange(nb, device=dev)
    causal = causal_counts(layout, window)
    lo = ar - causal + 1  # first allowed key block of each query block
    # a limit that keeps every allowed block, unless a forced density decides the counts instead
    loosest = [force_density is None and (thr >= 1.0 if rule == "mass" else thr == math.inf) and k_max >= nb
               for thr, k_max in limits]
    if (force_density is None and all(loosest)) or (force_density is not None and force_density >= 1.0):
        return [_every_allowed_block(causal, hkv, layout.longest_span(window))] * len(limits)

    span = layout.longest_span(window)
    fused = score_queries > 0 and sampling_kernel and fused_sampling_available(dev, q.shape[-1], layout.block_size)
    # the largest temporary per query block: its sampled logits, or without them (fused) its pooled scores
    per_block = hq * span * (1 if fused else max(1, score_queries) * layout.block_size)
    chunk = max(1, min(_chunk_elements(dev) // per_block, _CHUNK_ROWS_MAX.get(dev.type, nb)))
    if force_density is None:
        cap = min(span, max(max(k_max for _, k_max in limits), sink_blocks + local_blocks, k_min))
    else:
        cap = min(max(1, round(force_density * span)), span)  # forced_count at the longest span
    qb, kb = pooled(q, layout), pooled(k, layout)
    first_allowed = layout.first_allowed_blocks(window)
    if score_queries > 0:
        k_scored = k.to(score_dtype or k.dtype)  # once per row (a no-op in q's precision)
        if fused:
            q, k_scored = q.contiguous(), k_scored.contiguous()
        else:
            scratch = _sampled_scratch(q, k, chunk, span, nb, layout.block_size, score_queries, k_scored.dtype)
            # every sampled token of the row gathered and scaled once, not per chunk (q is strided from the model)
            qpos = sample_positions(layout, 0, nb, score_queries)
            q_sampled = q[:, qpos].mul_(scale).to(k_scored.dtype)  # in place: one float32 copy, not two
    picks, counts = [], [[] for _ in limits]
    for i0 in range(0, nb, chunk):
        i1 = min(nb, i0 + chunk)
        k0 = first_allowed[i0]  # key blocks k0..i1-1 hold every one the chunk's rows may see (lo ascends)
        rows = ar[i0:i1]
        j = ar[k0:i1]
        allowed = (j[None, :] >= lo[rows, None]) & (j[None, :] <= rows[:, None])  # [C, nk]
        p = _pooled_shares(qb[:, i0:i1], kb[:, k0:i1], layout.block_tokens[k0:i1], allowed, scale)
        if score_queries > 0:
            if fused:
                sampled = sampled_block_mass(q, k_scored, sample_positions(layout, i0, i1, score_queries), lo,
                                             layout.block_tokens, layout.block_size, i0, i1, k0, window, scale,
                                             score_queries)
            else:
                sampled = _sampled_shares(q_sampled, qpos, k_scored, layout, i0, i1, k0, lo, first_allowed, window,
                                          score_queries, scratch)
            p = torch.maximum(p, sampled)
            p = p / p.sum(-1, keepdim=True).clamp(min=1e-30)
        anchor = allowed & (((j[None, :] - layout.block_start[rows, None]) < sink_blocks)
                            | ((rows[:, None] - j[None, :]) < local_blocks))
        n_anchor = anchor.sum(-1)  # [C]
        prio = torch.where(anchor, 2.0 + (rows[:, None] == j[None, :]).float(), p).masked_fill(~allowed, -1.0)
        order = prio.topk(min(cap, j.numel()), dim=-1, sorted=True).indices  # [Hkv, C, cap]
        picks.append(F.pad(order + k0, (0, cap - order.shape[-1]), value=0))
        if force_density is not None:
            forced = forced_count(causal[i0:i1], force_density)[None].expand(hkv, -1)
            for out in counts:
                out.append(forced)
            continue
        rest = allowed & ~anchor  # shared by every limit
        logp = p.log() if rule == "anchor" else None
        for (threshold, k_max), out in zip(limits, counts):
            if rule == "mass":
                n_thr = n_anchor[None] + _within_mass(p, prio, order, rest, threshold)
            else:
                n_thr = n_anchor[None] + _within_margin(logp, anchor, allowed, rows - k0, threshold).sum(-1)
            n = torch.maximum(n_thr, n_anchor[None]).clamp(min=k_min)
            n = torch.minimum(n, torch.clamp(n_anchor, min=k_max)[None])
            out.append(torch.minimum(n, causal[None, i0:i1]))
    ranked = torch.cat(picks, 1)
    sets = []
    for full, out in zip(loosest, counts):
        if full:  # exactly every allowed block, as when every limit is the loosest
            sets.append(_every_allowed_block(causal, hkv, span))
            continue
        n = torch.cat(out, 1)  # never above cap: as wide as the cap, the selection needs no read of its counts
        slot = torch.arange(cap, device=dev)
        idx = torch.where(slot[None, None, :] < n[..., None], ranked, ar[None, :, None])
        sets.append(Selection(idx.contiguous(), n.contiguous(), causal, full=False))
    return sets


def _every_allowed_block(causal: torch.Tensor, hkv: int, span: int) -> Selection:
    """Every allowed key block of each query block, ascending; slots past a row's count hold its diagonal.
    `span`: causal.max()."""
    nb = causal.numel()
    ar = torch.arange(nb, device=causal.device)
    slot = torch.arange(span, device=causal.device)
    idx = torch.where(slot[None, :] < causal[:, None], ar[:, None] - causal[:, None] + 1 + slot[None, :], ar[:, None])
    return Selection(idx[None].expand(hkv, -1, -1), causal[None].expand(hkv, nb).clone(), causal, full=True)


def _within_mass(p: torch.Tensor, prio: torch.Tensor, order: torch.Tensor, rest: torch.Tensor,
                 tau: float) -> torch.Tensor:
    """[Hkv, C] non-anchor blocks to keep so that, taken in rank order, they hold `tau` of the estimated mass
    outside the anchors (`rest`). A share of what the anchors leave, not of the total: sink and local blocks
    often hold most of the mass, and a total share below theirs would keep nothing more at any budget."""
    ps = p.gather(-1, order)
    ps = ps.masked_fill(prio.gather(-1, order) >= 2.0, 0.0)  # anchors come first in the order; skip them
    outside = (p * rest).sum(-1, keepdim=True)
    before = ps.cumsum(-1) - ps
    return ((before < tau * outside) & (ps > 0)).sum(-1)


def _pooled_shares(qb: torch.Tensor, kb: torch.Tensor, block_tokens: torch.Tensor, allowed: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """[Hkv, C, nk] estimated mass share of each key block from block means: ``exp(scale * mean_q . mean_k)``
    times the block's real tokens stands for the block's unnormalised softmax mass. Smooth over the whole
    query block, but blind to a few keys that one query needs (their mean drowns in the block's)."""
    hq, c, d = qb.shape
    hkv = kb.shape[0]
    s = torch.matmul(qb.reshape(hkv, hq // hkv, c, d), kb[:, None].transpose(-1, -2)).mul_(scale)
    s.add_(block_tokens.clamp(min=1).to(s.dtype).log())
    s.masked_fill_(~allowed, _NEG_INF)
    return torch.softmax(s, dim=-1).mean(1).masked_fill_(~allowed, 0.0)


def _sampled_scratch(q: torch.Tensor, k: torch.Tensor, chunk: int, span: int, nb: int, block_size: int,
                     per_block: int, dtype: torch.dtype) -> torch.Tensor:
    """One flat buffer for the sampled logits, softmaxed in place, sized for the largest chunk and reused by
    every chunk: a fresh multi-MiB tensor per chunk is, on CPU, a fresh mmap and its page faults (that doubled
    the selection's time at 32K tokens). `dtype`: the scoring precision."""
    hq, hkv = q.shape[0], k.shape[0]
    rows, keys = chunk * per_block, min(nb, span + chunk - 1) * block_size
    # every head at once within the chunk budget; one key-value head's group at a time past it
    size = max(min(hq * rows * keys, _chunk_elements(q.device)), hq // hkv * rows * keys)
    return torch.empty(size, dtype=dtype, device=q.device)


def sample_positions(layout: Layout, i0: int, i1: int, per_block: int) -> torch.Tensor:
    """[(i1 - i0) * per_block] the sampled query tokens of query blocks i0..i1-1: `per_block` evenly spaced
    in each, the last on its last real token (a block's real tokens may be fewer than the block size)."""
    rows = torch.arange(i0, i1, device=layout.block_tokens.device)
    real = layout.block_tokens[rows].clamp(min=1)
    t = torch.arange(1, per_block + 1, device=rows.device)
    return (rows[:, None] * layout.block_size + _sampled_offset(t[None, :], real[:, None], per_block)).reshape(-1)


def _sampled_offset(t, real, per_block: int):
    """Offset in its block of a block's `t`-th sampled token (1-based) when it holds `real` real tokens:
    ints on the host (`_spans_maybe_hidden`) or tensors on the device (`sample_positions`), one formula."""
    offset = (t * real) // per_block - 1
    return offset.clamp(min=0) if isinstance(offset, torch.Tensor) else max(0, offset)


def _visible(layout: Layout, qpos: torch.Tensor, kpos: torch.Tensor, lo: torch.Tensor,
             window: int | None) -> torch.Tensor:
    """[nq, nk] whether each sampled query token (position `qpos`) may see each key position `kpos`: a real
    token, not later, in or after the query block's first allowed key block `lo`, within the window."""
    bs = layout.block_size
    kblock = kpos // bs
    ok = ((kpos - kblock * bs) < layout.block_tokens[kblock])[None, :] & (kpos[None, :] <= qpos[:, None])
    ok &= kblock[None, :] >= lo[qpos // bs, None]
    if window is not None:
        ok &= kpos[None, :] > qpos[:, None] - window
    return ok


def _spans_maybe_hidden(layout: Layout, i0: int, i1: int, k0: int, first_allowed: list[int], window: int | None,
                        per_block: int) -> list[tuple[int, int]]:
    """Column ranges (counted from key block `k0`'s first token) holding every key that some sampled query of
    query blocks i0..i1-1 may not see, bounded on the host from the chunk's ends and the layout (no read of
    the device): masking only these, in place, skips building and applying a mask over the chunk's whole span
    (a fifth of the selection's time at 32K tokens on CPU).

    - a suffix, after the chunk's first sampled token (`sample_positions`' first of block i0): the causal
      triangle, and the padding of a document's partly filled last block, never before the chunk's rows;
    - a prefix, before the last row's first allowed block (`first_allowed` ascends) or out of its last
      token's window: earlier documents and their padding."""
    bs = layout.block_size
    start, width = k0 * bs, (i1 - k0) * bs
    before = first_allowed[i1 - 1] * bs - start
    if window is not None:
        before = max(before, i1 * bs - window - start)
    real = max(1, layout.host_blocks()[1][i0])
    after = i0 * bs + _sampled_offset(1, real, per_block) + 1 - start
    if before >= after:
        return [(0, width)]
    return [(0, before), (after, width)] if before > 0 else [(after, width)]


def _sampled_shares(q_sampled: torch.Tensor, qpos: torch.Tensor, k: torch.Tensor, layout: Layout, i0: int,
                    i1: int, k0: int, lo: torch.Tensor, first_allowed: list[int], window: int | None,
                    per_block: int, scratch: torch.Tensor) -> torch.Tensor:
    """[Hkv, C, nk] exact softmax mass per key block of `per_block` query tokens of each query block (evenly
    spaced, ending at its last real token), averaged over them and the group's query heads. Sharp where the
    pooled estimate is blind: the block holding a retrieved fact gets the mass its reader gives it.
    `q_sampled` [Hq, nb * per_block, D]: the row's sampled tokens (`sample_positions`, at `qpos`), scaled
    and in the scoring precision, which `k` and the logits take; the logits, then their softmax, live in
    `scratch` (`_sampled_scratch`). `lo` and `first_allowed`: each query block's first allowed key block, on
    the device and on the host."""
    hq, hkv, bs = q_sampled.shape[0], k.shape[0], layout.block_size
    g, d, nk = hq // hkv, q_sampled.shape[-1], (i1 - k0) * bs
    rows = slice(i0 * per_block, i1 * per_block)
    qpos, nq = qpos[rows], (i1 - i0) * per_block
    spans = _spans_maybe_hidden(layout, i0, i1, k0, first_allowed, window, per_block)
    hidden = [~_visible(layout, qpos, torch.arange(k0 * bs + a, k0 * bs + b, device=qpos.device), lo, window)
              for a, b in spans]
    qs = q_sampled[:, rows].reshape(hkv, g * nq, d)
    ks = k[:, k0 * bs:i1 * bs]
    # one key-value head at a time when even one query block's logits pass the chunk budget (very long rows)
    step = 1 if hq * nq * nk > _chunk_elements(qs.device) else hkv
    shares = []
    for h in range(0, hkv, step):
        heads = min(step, hkv - h)
        logits = scratch[:heads * g * nq * nk].view(heads, g * nq, nk)
        for head in range(heads):  # a batched product of these key slices copies them first in bfloat16 on CPU
            torch.mm(qs[h + head], ks[h + head].T, out=logits[head])
        logits = logits.view(heads, g, nq, nk)
        for (a, b), mask in zip(spans, hidden):
            logits[..., a:b].masked_fill_(mask, _NEG_INF)
        # one fused op (max, exp, sum, scale: half the time of the same steps op by op), in place (faster than into
        # a second buffer, and half the memory); every sampled token sees itself, so no row is all -inf
        torch.ops.aten._softmax.out(logits, -1, False, out=logits)
        mass = logits.view(heads, g, i1 - i0, per_block, i1 - k0, bs).sum(-1).float()
        shares.append(mass.mean((1, 3)))  # each sampled token's softmax share of each block, averaged
    return torch.cat(shares, 0)


def _within_margin(logp: torch.Tensor, anchor: torch.Tensor, allowed: torch.Tensor, diag: torch.Tensor,
                   margin: float) -> torch.Tensor:
    """[Hkv, C, nk] non-anchor allowed blocks whose log-share is within `margin` of the anchors' reference.
    `diag`: each row's diagonal key block (column index)."""
    on_diag = torch.zeros_like(anchor)
    on_diag[torch.arange(anchor.shape[0], device=anchor.device), diag] = True
    side = anchor & ~on_diag
    ref = logp.masked_fill(~side, _NEG_INF).amax(-1)
    ref = torch.where(side.any(-1), ref, logp.gather(-1, diag[None, :, None].expand(logp.shape[0], -1, 1))[..., 0])
    return allowed & ~anchor & (logp >= ref[..., None] - margin)


def forced_count(causal: torch.Tensor, density: float) -> torch.Tensor:
    return torch.minimum(torch.round(density * causal.double()).long().clamp(min=1), causal)


def sampled_recall(
    q: torch.Tensor, k: torch.Tensor, layout: Layout, sel: Selection, samples: int, scale: float,
    seed: int | None = None, window: int | None = None,
) -> float | None:
    """Share of the exact dense softmax mass held by the kept blocks, averaged over `samples` random
    (key-value head, query block) pairs (drawn with `seed`), their query heads and real query tokens."""
    recall = sampled_recall_tensor(q, k, layout, sel, samples, scale, seed, window)
    return recall if recall is None or isinstance(recall, float) else float(recall)


@torch.no_grad()
def sampled_recall_tensor(
    q: torch.Tensor, k: torch.Tensor, layout: Layout, sel: Selection, samples: int, scale: float,
    seed: int | None = None, window: int | None = None,
) -> torch.Tensor | float | None:
    """`sampled_recall` left on q's device (a 0-dim tensor; 1.0 for a full selection): nothing is read back,
    so the attention can sample recall on every layer without a host synchronisation. The drawn pairs come
    from Python's `random` (no tensor to read) and the block geometry from `Layout.host_blocks`."""
    if samples <= 0:
        return None
    if sel.full:
        return 1.0
    hq, hkv = q.shape[0], k.shape[0]
    g = hq // hkv
    nb, bs = layout.num_blocks, layout.block_size
    starts, tokens = layout.host_blocks()
    total = torch.zeros((), dtype=torch.float32, device=q.device)
    draw = random.Random(seed)
    picks = [draw.randrange(hkv * nb) for _ in range(samples)]
    for pick in picks:
        h, i = divmod(pick, nb)
        start, real = starts[i], tokens[i]
        qi = q[h * g:(h + 1) * g, i * bs:i * bs + real].float()  # [G, real, D]
        ks = k[h, start * bs:(i + 1) * bs].float()  # [nk, D]
        logits = torch.matmul(qi, ks.T) * scale
        # positions made on the device: a mask copied from the host is a synchronisation per sample on a GPU
        qpos = torch.arange(i * bs, i * bs + real, device=q.device)[:, None]
        kpos = torch.arange(start * bs, (i + 1) * bs, device=q.device)[None, :]
        ok = kpos <= qpos
        if window is not None:
            ok &= kpos > qpos - window
        logits.masked_fill_(~ok, _NEG_INF)
        prob = torch.softmax(logits, -1)
        # slots past the row's count hold its diagonal block: they add 0 to its tally, never a block
        slots = sel.indices[h, i].long() - start
        valid = (torch.arange(slots.numel(), device=slots.device) < sel.counts[h, i]).int()
        kept = torch.zeros(i - start + 1, dtype=torch.int32, device=q.device).index_add_(0, slots, valid) > 0
        total += (prob * kept[:, None].expand(-1, bs).reshape(-1).to(prob.dtype)).sum(-1).mean()
    return total / len(picks)
