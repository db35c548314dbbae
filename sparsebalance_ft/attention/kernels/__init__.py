"""Block-sparse attention kernels behind one functional API.

`block_sparse_attention(q, k, v, block_indices, block_counts=None, *, block_size, ...)` computes exact
softmax attention of each query block over exactly its kept key blocks (token-level causal inside them).
"""
from __future__ import annotations

import logging
import math

import torch

from .flex import FLEX_AVAILABLE, flex_block_sparse_attention
from .torch_kernel import Plan, make_plan, torch_block_sparse_attention
from .triton import TRITON_AVAILABLE

log = logging.getLogger(__name__)

__all__ = ["block_sparse_attention", "resolve_backend", "make_plan", "Plan", "FLEX_AVAILABLE", "TRITON_AVAILABLE"]


def resolve_backend(backend: str, device: torch.device) -> str:
    """`auto`: torch on CPU, flex on CUDA. `triton` resolves to flex (see kernels/triton.py)."""
    if backend == "auto":
        return "flex" if device.type == "cuda" and FLEX_AVAILABLE else "torch"
    if backend == "triton":
        return "flex" if device.type == "cuda" and FLEX_AVAILABLE else "torch"
    if backend == "flex" and not FLEX_AVAILABLE:
        log.warning("FlexAttention unavailable; using the torch kernel")
        return "torch"
    return backend


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    block_counts: torch.Tensor | None = None,
    *,
    block_size: int,
    scale: float | None = None,
    window: int | None = None,
    backend: str = "auto",
    chunk_blocks: int = 256,
    plan: Plan | None = None,
) -> torch.Tensor:
    """Exact block-sparse causal attention.

    q: [B, Hq, L, D]; k, v: [B, Hkv, L, D] with Hq a multiple of Hkv and L a multiple of `block_size`.
    block_indices: [B, Hkv, L // block_size, K] kept key-block indices per (batch, kv head, query block);
    the first `block_counts[b, h, i]` entries are valid (all K when `block_counts` is None), and must be
    distinct and causal (<= i). Returns [B, Hq, L, D]; differentiable in q, k, v.
    """
    if q.shape[2] % block_size or k.shape[2] % block_size:
        raise ValueError(f"sequence length must be a multiple of block_size={block_size}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    be = resolve_backend(backend, q.device)
    if be == "flex":
        return flex_block_sparse_attention(q, k, v, block_indices, block_counts, block_size, scale, window)
    if plan is None:
        plan = make_plan(block_indices, block_counts, k.shape[2] // block_size, chunk_blocks)
    return torch_block_sparse_attention(q, k, v, plan, block_size, scale, window)
