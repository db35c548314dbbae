"""GPU path: FlexAttention over a `BlockMask` built with `BlockMask.from_kv_blocks` from the selection.

Kept blocks strictly below the diagonal (and fully inside a sliding window) go in as *full* blocks (no
mask evaluation); the diagonal block and window-straddling blocks go in as *partial* blocks with a
causal (and window) `mask_mod`. Compiled with `torch.compile` on CUDA; on CPU the eager (reference)
implementation runs, which is only meant for small correctness checks.
"""
from __future__ import annotations

import functools

import torch

try:  # import guard: FlexAttention needs torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    FLEX_AVAILABLE = True
except ImportError:  # pragma: no cover
    BlockMask = None  # type: ignore[assignment]
    flex_attention = None  # type: ignore[assignment]
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


def build_block_mask(block_indices: torch.Tensor, block_counts: torch.Tensor | None, block_size: int,
                     group: int, seq_len: int, window: int | None = None):
    """BlockMask for q [B, Hq, L, D] against k [B, Hkv, L, D] from kept blocks per (b, kv head, q block)."""
    b, hkv, nq, k = block_indices.shape
    dev = block_indices.device
    nkv = seq_len // block_size
    idx = block_indices.long()
    slot = torch.arange(k, device=dev)
    valid = slot < (block_counts[..., None] if block_counts is not None else k)
    if k < nkv:  # BlockMask wants the index lists as wide as the number of key blocks
        idx = torch.cat([idx, idx.new_zeros(b, hkv, nq, nkv - k)], dim=-1)
        valid = torch.cat([valid.expand(b, hkv, nq, k), valid.new_zeros(b, hkv, nq, nkv - k)], dim=-1)
        k = nkv
    qb = torch.arange(nq, device=dev)[None, None, :, None]
    full = valid & (idx < qb)
    if window is not None:
        # every (query, key) pair of the block pair inside the window: key_start > query_end - window
        full &= idx * block_size > (qb * block_size + block_size - 1) - window
    partial = valid & ~full
    n_full, i_full = _compact(full, idx)
    n_part, i_part = _compact(partial, idx)
    rep = lambda t: t.repeat_interleave(group, dim=1)  # noqa: E731  (GQA: heads of a group share the selection)

    # The mask_mod must describe the whole mask (the eager reference ignores block sparsity): a lookup
    # of the kept-block table, plus causality (and the window) at token level.
    table = torch.zeros(b, hkv, nq, nkv, dtype=torch.int32, device=dev).scatter_add_(-1, idx, valid.int()) > 0
    table = rep(table)

    def mask_mod(b_, h_, q_idx, kv_idx):
        ok = (kv_idx <= q_idx) & table[b_, h_, q_idx // block_size, kv_idx // block_size]
        if window is not None:
            ok = ok & (kv_idx > q_idx - window)
        return ok

    return BlockMask.from_kv_blocks(rep(n_part), rep(i_part), rep(n_full), rep(i_full), BLOCK_SIZE=block_size,
                                    mask_mod=mask_mod, seq_lengths=(seq_len, seq_len))


def flex_block_sparse_attention(q, k, v, block_indices, block_counts, block_size: int, scale: float,
                                window: int | None = None, compile: bool | None = None):
    if not FLEX_AVAILABLE:
        raise RuntimeError("FlexAttention is not available in this torch build")
    group = q.shape[1] // k.shape[1]
    bm = build_block_mask(block_indices, block_counts, block_size, group, q.shape[2], window)
    compile = q.device.type == "cuda" if compile is None else compile
    fn = _compiled_flex() if compile else flex_attention
    return fn(q, k, v, block_mask=bm, scale=scale, enable_gqa=group > 1)
