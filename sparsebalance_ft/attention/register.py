"""Registration with transformers: the `sparsebalance` attention function and its mask function.

`register_sparse_attention()` adds the name to `AttentionInterface` (the attention) and to
`AttentionMaskInterface` (without a mask function transformers skips mask preparation for unknown names).
The mask function returns what the attention needs and nothing quadratic: ``None`` for plain causal
rows, or the 2D padding mask ``[B, kv_len]`` when some tokens are padding. Causality, documents (from
``position_ids`` or ``cu_seq_lens_q``), sliding windows and the block selection are handled inside the
attention function.
"""
from __future__ import annotations

import logging
import math
import time
import zlib
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

from .budget import SparseAttentionController, _in_backward, selection_kwargs
from .kernels import block_sparse_attention, make_plan, resolve_backend, warn_once
from .selection import (
    Layout,
    Selection,
    block_density_by_doc,
    causal_counts,
    documents_from_positions,
    from_layout,
    make_layout,
    sampled_recall,
    select_blocks,
    to_layout,
)

log = logging.getLogger(__name__)

NAME = "sparsebalance"
_ATTR = "_sparsebalance_controller"
_defaults: dict[int, SparseAttentionController] = {}


def sparsebalance_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                       mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """Mask interface entry: None, or the boolean 2D padding mask [B, kv_length] (True = real token)."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:].to(torch.bool)
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def register_sparse_attention() -> None:
    """Idempotently register "sparsebalance" with transformers' attention and mask interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, sparsebalance_attention_forward)
    AttentionMaskInterface.register(NAME, sparsebalance_mask)


def bind_controller(model: torch.nn.Module, controller: SparseAttentionController) -> int:
    """Point every attention module (a module with an int `layer_idx`) of `model` at `controller`."""
    n = 0
    for m in model.modules():
        if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "config"):
            object.__setattr__(m, _ATTR, controller)
            n += 1
    return n


def _controller_for(module: torch.nn.Module) -> SparseAttentionController:
    c = getattr(module, _ATTR, None)
    if c is not None:
        return c
    cfg = getattr(module, "config", None)
    key = id(cfg)
    c = _defaults.get(key)
    if c is None:
        layers = int(getattr(cfg, "num_hidden_layers", 1) or 1)
        c = _defaults[key] = SparseAttentionController(None, layers)
    object.__setattr__(module, _ATTR, c)
    return c


@contextmanager
def _single_thread():
    """Small ops (selection) run single-threaded: OpenMP regions on shared cores cost more than they save."""
    prev = torch.get_num_threads()
    if prev > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if prev > 1:
            torch.set_num_threads(prev)


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    if n == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def _fallback(query, key, value, attention_mask, scaling, sliding_window):
    """Exact dense attention for calls the block-sparse path does not cover (decoding with a cache,
    query shorter than keys): bottom-right aligned causal mask, padding and window."""
    b, hq, lq, d = query.shape
    lk = key.shape[2]
    g = hq // key.shape[1]
    qpos = torch.arange(lk - lq, lk, device=query.device)[:, None]
    kpos = torch.arange(lk, device=query.device)[None, :]
    ok = kpos <= qpos
    if sliding_window is not None:
        ok = ok & (kpos > qpos - sliding_window)
    mask = ok[None, None].expand(b, 1, lq, lk)
    if attention_mask is not None and attention_mask.dim() == 2:
        mask = mask & attention_mask[:, None, None, -lk:].bool()
    elif attention_mask is not None and attention_mask.dim() == 4:
        am = attention_mask[..., -lk:]
        mask = mask & (am if am.dtype == torch.bool else am == 0)
    out = F.scaled_dot_product_attention(query, _repeat_kv(key, g), _repeat_kv(value, g), attn_mask=mask, scale=scaling)
    return out


def _row_documents(b: int, length: int, position_ids, cu_seq_lens, padding: torch.Tensor | None):
    """(doc lengths, placed token indices or None) of batch row b."""
    if padding is not None:
        real = padding[b].nonzero().flatten()
        if position_ids is not None:
            docs = documents_from_positions(position_ids[min(b, position_ids.shape[0] - 1)][real])
        else:
            docs = [int(real.numel())]
        return docs, real
    if cu_seq_lens is not None and b == 0 and cu_seq_lens.numel() > 1:
        cu = cu_seq_lens.tolist()
        docs = [cu[i + 1] - cu[i] for i in range(len(cu) - 1) if cu[i + 1] > cu[i]]
        if sum(docs) == length:
            return docs, None
    if position_ids is not None:
        return documents_from_positions(position_ids[min(b, position_ids.shape[0] - 1)]), None
    return [length], None


def _dense_docs(qp, kp, vp, layout: Layout, scale: float) -> torch.Tensor:
    """Exact dense causal attention per document (fused SDPA), in the layout."""
    g = qp.shape[1] // kp.shape[1]
    if len(layout.doc_lengths) == 1:
        n = layout.doc_lengths[0]
        if layout.identity or n == qp.shape[2]:
            return F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=g > 1)
    outs = []
    start = 0
    bs = layout.block_size
    for n in layout.doc_lengths:
        nb = max(1, -(-n // bs))
        sl = slice(start, start + nb * bs)
        outs.append(F.scaled_dot_product_attention(qp[:, :, sl], kp[:, :, sl], vp[:, :, sl], is_causal=True,
                                                   scale=scale, enable_gqa=g > 1))
        start += nb * bs
    return torch.cat(outs, dim=2)


def recall_seed(layer: int, doc_lengths: list[int]) -> int:
    """Seed of the query blocks drawn to sample recall: a function of the layer and the row's documents only.

    So runs that see the same documents (two configurations of a benchmark, a resumed run) draw the same
    query blocks, and their recalls differ by what their selections keep rather than by what was drawn.
    """
    return zlib.crc32(f"{layer}:{','.join(map(str, doc_lengths))}".encode())


def sparse_attention_row(
    controller: SparseAttentionController,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: Layout,
    scale: float,
    window: int | None = None,
    row: int = 0,
    report: bool = True,
) -> torch.Tensor:
    """One batch row ([1, H, L, D] tensors in the original token order) through selection and kernel."""
    cfg = controller.config
    bs = layout.block_size
    forced = controller.forced_density
    budget = controller.budget_for(layer)
    dense_layer = layer in controller.dense_layers
    full = dense_layer or (forced is not None and forced >= 1.0) or (forced is None and budget >= 1.0)
    qp, kp, vp = to_layout(q, layout), to_layout(k, layout), to_layout(v, layout)
    hkv = k.shape[1]
    ndocs = len(layout.doc_lengths)
    if full and window is None and cfg.exact_dense_at_full_budget:
        # every causal block is kept: fused dense SDPA per document is the same computation, exactly
        out = _dense_docs(qp, kp, vp, layout, scale)
        if report:
            caus = np.zeros(ndocs)
            np.add.at(caus, layout.block_doc.cpu().numpy(), causal_counts(layout, None).cpu().numpy() * hkv)
            controller.record(layer, row, layout.doc_lengths, caus, caus, None if cfg.recall_samples == 0 else 1.0)
        return from_layout(out, layout)
    t0 = time.perf_counter()
    with _single_thread():
        sel: Selection = select_blocks(
            qp[0].detach(), kp[0].detach(), layout, **selection_kwargs(cfg, 1.0 if full else budget), k_min=cfg.k_min,
            sink_blocks=cfg.sink_blocks, local_blocks=cfg.local_blocks, scale=scale,
            force_density=None if full else forced, window=window,
        )
        if getattr(controller, "layer_tuner", None) is not None and forced is None and not full:
            # layer-level DST (balancer/layer_tuning.py): move this rank's selection toward the layer's target
            sel = controller.layer_tuner.adjust(layer, sel, lambda b: select_blocks(
                qp[0].detach(), kp[0].detach(), layout, **selection_kwargs(cfg, b), k_min=cfg.k_min,
                sink_blocks=cfg.sink_blocks, local_blocks=cfg.local_blocks, scale=scale, window=window), _in_backward())
        backend = resolve_backend(cfg.backend, q.device)
        plan = make_plan(sel.indices[None], sel.counts[None], layout.num_blocks, cfg.chunk_blocks) if backend == "torch" else None
    t_sel = time.perf_counter() - t0
    out = block_sparse_attention(qp, kp, vp, sel.indices[None], sel.counts[None], block_size=bs, scale=scale,
                                 window=window, backend=backend, chunk_blocks=cfg.chunk_blocks, plan=plan)
    if report:
        recall = None
        if cfg.recall_samples > 0:
            gen = torch.Generator().manual_seed(recall_seed(layer, layout.doc_lengths))
            recall = sampled_recall(qp[0].detach(), kp[0].detach(), layout, sel, cfg.recall_samples, scale, gen, window)
        kept, caus = block_density_by_doc(layout, sel)
        controller.record(layer, row, layout.doc_lengths, kept.numpy(), caus.numpy(), recall, t_sel)
    return from_layout(out, layout)


def sparsebalance_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: q [B, Hq, L, D], k/v [B, Hkv, L, D] -> ([B, L, Hq, D], None)."""
    if dropout:
        warn_once(log, "sparsebalance attention ignores attention dropout")
    if kwargs.get("softcap") is not None:
        raise ValueError("sparsebalance attention does not support softcap")
    controller = _controller_for(module)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    b, hq, lq, d = query.shape
    lk = key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal:
        raise ValueError("sparsebalance attention is causal only")
    padding = attention_mask if (attention_mask is not None and attention_mask.dim() == 2) else None
    if lq != lk or (attention_mask is not None and attention_mask.dim() != 2) or lq < 2:
        out = _fallback(query, key, value, attention_mask, scale, sliding_window)
        return out.transpose(1, 2).contiguous(), None
    layer = int(getattr(module, "layer_idx", 0) or 0)
    position_ids = kwargs.get("position_ids")
    cu = kwargs.get("cu_seq_lens_q")
    outs = []
    bs = controller.config.block_size
    for row in range(b):
        docs, tokens = _row_documents(row, lq, position_ids, cu, padding)
        layout = make_layout(docs, bs, query.device, tokens=tokens, length=lq)
        window = sliding_window if (sliding_window is not None and sliding_window < max(docs)) else None
        outs.append(sparse_attention_row(controller, layer, query[row:row + 1], key[row:row + 1], value[row:row + 1],
                                         layout, scale, window, row=row))
    out = outs[0] if b == 1 else torch.cat(outs, dim=0)
    return out.transpose(1, 2).contiguous(), None
