"""GPU path: FlexAttention over a `BlockMask` built directly from the selection's compact indices.

Kept blocks strictly below the diagonal (and fully inside a sliding window) go in as *full* blocks (no
mask evaluation); the diagonal block and window-straddling blocks go in as *partial* blocks with a
causal (and window) `mask_mod`. Compiled with `torch.compile` on CUDA; on CPU the eager (reference)
implementation runs, which is only meant for small correctness checks.

Memory: the key side of the mask stays as wide as the selection (``K`` kept blocks per query block, not
the ``nkv`` key blocks of the sequence), and its transpose (the query blocks that kept each key block,
which the backward walks) is built by one sort of the kept entries instead of through a dense
``[nq, nkv]`` grid. The transposed *full* lists are padded to ``nq`` per key block because BlockMask
stores them padded and the sink block is kept by every query block; the *partial* lists need at most 3
entries per key block (the diagonal and two window edges). FlexAttention indexes the mask's head
dimension as ``query_head % H``, which is not the GQA group of a query head, so the lists are expanded
to the query heads at the end (int32, as wide as the selection); the ``[nq, nkv]`` kept-block table
that the eager reference's ``mask_mod`` needs (it ignores block sparsity) is only built eagerly.
"""
from __future__ import annotations

import functools

import torch

try:  # import guard: FlexAttention needs torch >= 2.5
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

    FLEX_AVAILABLE = True
except ImportError:  # pragma: no cover
    AuxRequest = BlockMask = flex_attention = None  # type: ignore[assignment,misc]
    FLEX_AVAILABLE = False


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    # default (automatic) dynamic shapes: packed layouts change length every step; recompiling per
    # length would exhaust the cache and drop to the unfused eager path
    return torch.compile(flex_attention)


def _compact(mask: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move the entries of `idx` where `mask` holds to the front of the last dim; return (counts, indices)."""
    k = idx.shape[-1]
    slot = torch.arange(k, device=idx.device).expand_as(idx)
    key = torch.where(mask, slot, slot + k)
    order = key.argsort(dim=-1, stable=True)
    return mask.sum(-1).to(torch.int32), idx.gather(-1, order).to(torch.int32)


def _transpose(num: torch.Tensor, idx: torch.Tensor, nkv: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept key blocks per query block -> query blocks per key block, ascending, padded to `width`.

    num [B, H, nq], idx [B, H, nq, K] -> (counts [B, H, nkv], indices [B, H, nkv, width]), by one stable sort
    of the kept entries (query-block-major, so each key block's query blocks come out ascending)."""
    b, h, nq, k = idx.shape
    dev = idx.device
    valid = torch.arange(k, device=dev) < num[..., None].long()
    key = torch.where(valid, idx.long(), nkv).view(b * h, nq * k)  # key block, or nkv for empty slots
    order = key.argsort(dim=-1, stable=True)
    kv_sorted = key.gather(-1, order)
    counts = torch.zeros(b * h, nkv + 1, dtype=torch.long, device=dev).scatter_add_(-1, key, torch.ones_like(key))
    start = counts.cumsum(-1) - counts
    rank = torch.arange(nq * k, device=dev) - start.gather(-1, kv_sorted)
    real = kv_sorted < nkv
    slot = torch.where(real, kv_sorted * width + rank, nkv * width)  # empty slots land in a dropped row
    out = torch.zeros(b * h, (nkv + 1) * width, dtype=torch.int32, device=dev)
    out.scatter_(-1, slot, (order // k).to(torch.int32))
    return (counts[:, :nkv].to(torch.int32).view(b, h, nkv),
            out.view(b * h, nkv + 1, width)[:, :nkv].reshape(b, h, nkv, width))


def _kept_table(block_indices: torch.Tensor, block_counts: torch.Tensor | None, nkv: int) -> torch.Tensor:
    """[B, Hkv, nq, nkv] bool kept-block table (only for the eager reference, which ignores block sparsity)."""
    k = block_indices.shape[-1]
    valid = torch.arange(k, device=block_indices.device) < (block_counts[..., None] if block_counts is not None else k)
    table = torch.zeros(*block_indices.shape[:3], nkv, dtype=torch.int32, device=block_indices.device)
    return table.scatter_add_(-1, block_indices.long(), valid.expand(block_indices.shape).int()) > 0


def build_block_mask(block_indices: torch.Tensor, block_counts: torch.Tensor | None, block_size: int,
                     group: int, seq_len: int, window: int | None = None, eager_table: bool = True):
    """BlockMask for q [B, Hq, L, D] against k [B, Hkv, L, D] from kept blocks per (b, kv head, q block).

    `eager_table`: make `mask_mod` look the kept blocks up (needed by the eager reference, which evaluates
    `mask_mod` on every pair); the compiled kernel visits only the mask's blocks and needs causality only."""
    b, hkv, nq, k = block_indices.shape
    dev = block_indices.device
    nkv = seq_len // block_size
    idx = block_indices.long()
    valid = torch.arange(k, device=dev) < (block_counts[..., None] if block_counts is not None else k)
    qb = torch.arange(nq, device=dev)[None, None, :, None]
    full = valid & (idx < qb)
    if window is not None:
        # every (query, key) pair of the block pair inside the window: key_start > query_end - window
        full &= idx * block_size > (qb * block_size + block_size - 1) - window
    partial = valid & ~full
    n_full, i_full = _compact(full, idx)
    n_part, i_part = _compact(partial, idx)
    # a key block is partial for its own query block and, with a window, for at most two window edges
    qn_part, qi_part = _transpose(n_part, i_part, nkv, min(nq, 1 if window is None else 3))
    qn_full, qi_full = _transpose(n_full, i_full, nkv, nq)
    rep = lambda t: t.repeat_interleave(group, dim=1) if group > 1 else t  # noqa: E731

    table = rep(_kept_table(block_indices, block_counts, nkv)) if eager_table else None

    def mask_mod(b_, h_, q_idx, kv_idx):
        ok = kv_idx <= q_idx
        if table is not None:
            ok = ok & table[b_, h_, q_idx // block_size, kv_idx // block_size]
        if window is not None:
            ok = ok & (kv_idx > q_idx - window)
        return ok

    return BlockMask((seq_len, seq_len), rep(n_part), rep(i_part), rep(n_full), rep(i_full), rep(qn_part),
                     rep(qi_part), rep(qn_full), rep(qi_full), BLOCK_SIZE=(block_size, block_size), mask_mod=mask_mod)


def _tile_options(block_size: int) -> dict[str, int]:
    """Triton tiles that divide the selection's blocks. The compiled kernel refuses a BlockMask whose block
    size its tile does not divide, and on Hopper its default forward tile is 128 x 128 (seen on an H200:
    "Q and KV block size must be divisible by BLOCK_M and BLOCK_N" at block size 64). Backward tiles are
    flash-attention-2's shapes, halved where the block is smaller than them."""
    half = max(16, block_size // 2)
    return {"fwd_BLOCK_M": block_size, "fwd_BLOCK_N": block_size, "bwd_BLOCK_M1": half,
            "bwd_BLOCK_N1": block_size, "bwd_BLOCK_M2": block_size, "bwd_BLOCK_N2": half}


def flex_block_sparse_attention(q, k, v, block_indices, block_counts, block_size: int, scale: float,
                                window: int | None = None, sinks: torch.Tensor | None = None,
                                compile: bool | None = None):
    """Block-sparse attention by FlexAttention. `sinks` [Hq]: per-head sink logits folded in through the
    returned log-sum-exp (O * sigmoid(lse - s)), which FlexAttention differentiates."""
    if not FLEX_AVAILABLE:
        raise RuntimeError("FlexAttention is not available in this torch build")
    group = q.shape[1] // k.shape[1]
    compile = q.device.type == "cuda" if compile is None else compile
    bm = build_block_mask(block_indices, block_counts, block_size, group, q.shape[2], window, eager_table=not compile)
    fn = _compiled_flex() if compile else flex_attention
    options = _tile_options(block_size) if compile and block_size < 128 else None
    if sinks is None:
        return fn(q, k, v, block_mask=bm, scale=scale, enable_gqa=group > 1, kernel_options=options)
    out, aux = fn(q, k, v, block_mask=bm, scale=scale, enable_gqa=group > 1, kernel_options=options,
                  return_aux=AuxRequest(lse=True))
    keep = torch.sigmoid(aux.lse.float() - sinks.float()[None, :, None])  # exp(lse) / (exp(lse) + exp(s))
    return out * keep.unsqueeze(-1).to(out.dtype)
