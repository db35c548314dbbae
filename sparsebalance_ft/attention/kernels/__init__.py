"""Block-sparse attention kernels behind one functional API.

`block_sparse_attention(q, k, v, block_indices, block_counts=None, *, block_size, ...)` computes exact
softmax attention of each query block over exactly its kept key blocks (token-level causal inside them).
Backends: `torch` (kernels/torch_kernel.py, any device), `flex` (FlexAttention, compiled on CUDA) and
`triton` (kernels/triton.py, CUDA, or CPU under ``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import functools
import logging
import math

import torch

from .flex import FLEX_AVAILABLE, flex_block_sparse_attention
from .torch_kernel import Plan, make_plan, torch_block_sparse_attention
from .triton import TRITON_AVAILABLE, interpreting, triton_block_sparse_attention

log = logging.getLogger(__name__)

__all__ = ["block_sparse_attention", "resolve_backend", "make_plan", "Plan", "warn_once", "FLEX_AVAILABLE",
           "TRITON_AVAILABLE"]


@functools.cache
def warn_once(logger: logging.Logger, message: str) -> None:
    """Attention code runs on every layer call; one warning per distinct message is enough."""
    logger.warning(message)


def resolve_backend(backend: str, device: torch.device) -> str:
    """`auto`: torch on CPU, flex on CUDA (the Triton kernel has not been timed against flex on a GPU,
    so it is not the default). `triton`: the Triton kernel where triton is installed and the tensors are
    on CUDA (or the interpreter is on); otherwise flex on CUDA, torch elsewhere, with a warning."""
    fallback = "flex" if device.type == "cuda" and FLEX_AVAILABLE else "torch"
    if backend == "auto":
        return fallback
    if backend == "triton":
        if TRITON_AVAILABLE and (device.type == "cuda" or interpreting()):
            return "triton"
        why = "triton is not installed" if not TRITON_AVAILABLE else f"tensors on {device.type}, not CUDA"
        warn_once(log, f"triton backend unavailable ({why}); using the {fallback} kernel")
        return fallback
    if backend == "flex" and not FLEX_AVAILABLE:
        warn_once(log, "FlexAttention unavailable; using the torch kernel")
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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact block-sparse causal attention.

    q: [B, Hq, L, D]; k, v: [B, Hkv, L, D] with Hq a multiple of Hkv and L a multiple of `block_size`.
    block_indices: [B, Hkv, L // block_size, K] kept key-block indices per (batch, kv head, query block);
    the first `block_counts[b, h, i]` entries are valid (all K when `block_counts` is None), and must be
    distinct and causal (<= i). `sinks` [Hq] (optional): per-query-head attention-sink logits that join
    every softmax denominator (GPT-OSS); the torch and flex backends take them, the Triton kernel refuses.
    Returns [B, Hq, L, D]; differentiable in q, k, v (and the sinks).
    """
    if q.shape[2] % block_size or k.shape[2] % block_size:
        raise ValueError(f"sequence length must be a multiple of block_size={block_size}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    be = resolve_backend(backend, q.device)
    if be == "triton":
        if sinks is not None:
            raise ValueError("the triton backend has no attention sinks (GPT-OSS): use sparsity.backend torch or flex")
        return triton_block_sparse_attention(q, k, v, block_indices, block_counts, block_size, scale, window)
    if be == "flex":
        return flex_block_sparse_attention(q, k, v, block_indices, block_counts, block_size, scale, window, sinks)
    if plan is None:
        plan = make_plan(block_indices, block_counts, k.shape[2] // block_size, chunk_blocks)
    return torch_block_sparse_attention(q, k, v, plan, block_size, scale, window, sinks)
