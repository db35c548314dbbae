"""Registration with transformers: the `sparsebalance` attention function and its mask function.

`register_sparse_attention()` adds the name to `AttentionInterface` (the attention) and to
`AttentionMaskInterface` (without a mask function transformers skips mask preparation for unknown names).
The mask function hands the attention what it needs and nothing quadratic: ``None`` for plain causal
rows, the 2D padding mask ``[B, kv_len]`` when some tokens are padding, or a `LocalMask` when the layer's
mask carries a sliding window or a chunk (PhiMoE, Qwen2-MoE, Llama4 keep those in the mask function
only). Causality, documents (from ``position_ids`` or ``cu_seq_lens_q``), windows, chunks, attention
sinks and the block selection are handled inside the attention function. Calls with a cache (decoding)
get transformers' own materialised mask and run dense.

Every family either computes exactly what its eager attention computes at full budget or refuses in one
line (tests/attention/test_attention_families.py): logit softcapping (Gemma2) and attention dropout are
refused; sinks (GPT-OSS) are folded into the softmax by the kernels; a chunk (Llama4) splits each
document into chunk-long pieces in the block layout (a chunk boundary is a document boundary for
attention), so selection and kernels need nothing new.

Host syncs per layer call on the sparse path: none with the flex or Triton kernels (the GPU backends),
unless layer-level tuning is on (its one all_gather of 3 floats per layer). The selection sizes itself from
the layout's document lengths (host values), sampled recall draws its blocks with Python's `random` and
builds its masks on the device, and recall and the per-document counts stay device tensors until
`pop_report` reads them all at once. What reads the device, and why: the torch kernel's `make_plan` reads
the kept counts 3 times to group rows into chunks (the CPU backend, where reads cost nothing), and the
documents are read once per forward (not per layer). `sbft bench step` counts them per step;
tests/attention/test_attention_training.py checks that more layers add no read.
"""
from __future__ import annotations

import logging
import math
import time
import zlib
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kernels import block_sparse_attention, make_plan, resolve_backend, warn_once
from .selection import (
    Layout,
    Selection,
    causal_counts,
    documents_from_positions,
    from_layout,
    make_layout,
    sampled_recall_tensor,
    to_layout,
)

log = logging.getLogger(__name__)

NAME = "sparsebalance"
CONTROLLER_ATTR = "_sparsebalance_controller"
_HOOK_ATTR = "_sparsebalance_position_hook"


@dataclass(frozen=True)
class LocalMask:
    """The mask interface's answer for a layer whose mask function carries a sliding window or a chunk.

    padding: [B, kv_len] bool (True = real token) or None; window: keys with ``q - k < window`` are seen;
    chunk: keys in the query's chunk of ``chunk`` positions (counted from the document's first token)."""

    padding: torch.Tensor | None
    window: int | None = None
    chunk: int | None = None


def _local_pattern(local_size: int | None, config, kv_length: int) -> tuple[int | None, int | None]:
    """(window, chunk) that transformers' mask builders meant by `local_size`: create_chunked_causal_mask
    passes the config's `attention_chunk_size`, create_sliding_window_causal_mask its `sliding_window`.
    A pattern at least as long as the row changes nothing and is dropped."""
    if not local_size or local_size >= kv_length:
        return None, None
    chunk = getattr(config, "attention_chunk_size", None)
    window = getattr(config, "sliding_window", None)
    if local_size == chunk and local_size != window:
        return None, local_size
    if local_size == window and local_size != chunk:
        return local_size, None
    raise ValueError(f"sparsebalance attention cannot tell whether local_size={local_size} is a sliding window "
                     f"(config.sliding_window={window}) or a chunk (config.attention_chunk_size={chunk})")


def sparsebalance_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                       mask_function=None, attention_mask: torch.Tensor | None = None, local_size: int | None = None,
                       config=None, **kwargs):
    """Mask interface entry: None, the 2D padding mask [B, kv_length], or a `LocalMask`; with a cache
    (queries shorter than keys, or offsets) transformers' own 4D boolean mask for the dense fallback."""
    if q_length != kv_length or q_offset or kv_offset:
        from transformers.masking_utils import sdpa_mask

        kwargs["allow_is_causal_skip"] = False  # the fallback wants the mask itself
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                         local_size=local_size, config=config, **kwargs)
    padding = None
    if attention_mask is not None:
        padding = attention_mask[:, -kv_length:].to(torch.bool)
        if padding.shape[1] == kv_length and bool(padding.all()):
            padding = None
    window, chunk = _local_pattern(local_size, config, kv_length)
    if window is None and chunk is None:
        return padding
    return LocalMask(padding, window, chunk)


def register_sparse_attention() -> None:
    """Idempotently register "sparsebalance" with transformers' attention and mask interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, sparsebalance_attention_forward)
    AttentionMaskInterface.register(NAME, sparsebalance_mask)


def bind_controller(model: torch.nn.Module, controller) -> int:
    """Point every attention module (a module with an int `layer_idx`) of `model` at `controller`, and
    remember each call's `position_ids` on the controller (a forward pre-hook on `model`): some decoder
    layers (Llama4's) do not pass them down to the attention, which needs them to keep packed documents
    apart."""
    n = 0
    for m in model.modules():
        if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "config"):
            object.__setattr__(m, CONTROLLER_ATTR, controller)
            n += 1
    previous = getattr(model, _HOOK_ATTR, None)
    if previous is not None:
        previous.remove()

    def remember_positions(_module, args, kwargs):
        controller.call_position_ids = kwargs.get("position_ids")

    object.__setattr__(model, _HOOK_ATTR, model.register_forward_pre_hook(remember_positions, with_kwargs=True))
    return n


def bound_attention_modules(model: torch.nn.Module, controller) -> list[torch.nn.Module]:
    """The attention modules of `model` that `bind_controller` pointed at `controller`, in layer order."""
    return [m for m in model.modules() if getattr(m, CONTROLLER_ATTR, None) is controller]


def in_backward() -> bool:
    """True while autograd runs a backward (e.g. gradient-checkpoint recomputation): not a new forward."""
    try:
        return torch._C._current_graph_task_id() != -1
    except AttributeError:  # pragma: no cover
        return False


@dataclass
class CachedRoute:
    """What one layer call of one batch row did in the forward, for a checkpoint recompute to repeat.

    `signature` identifies the row's layout (documents, length, window, sinks); `selection` and `plan`
    are None when the call ran dense (full budget or a dense layer)."""

    signature: tuple
    selection: Selection | None = None
    plan: object = None


def _controller_for(module: torch.nn.Module):
    controller = getattr(module, CONTROLLER_ATTR, None)
    if controller is None:
        raise ValueError("this model runs attn_implementation 'sparsebalance' without a controller: call "
                         "SparseAttentionController.attach(model, sparsity_config) first")
    return controller


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    if n == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def _fallback(query, key, value, attention_mask, scale, sliding_window, sinks):
    """Exact dense attention for calls the block-sparse path does not cover (decoding with a cache, where
    the mask interface gave transformers' own 4D mask, or a one-token row): bottom-right aligned causal
    mask, padding, window, and sinks."""
    b, hq, lq, d = query.shape
    lk = key.shape[2]
    g = hq // key.shape[1]
    qpos = torch.arange(lk - lq, lk, device=query.device)[:, None]
    kpos = torch.arange(lk, device=query.device)[None, :]
    ok = kpos <= qpos
    if isinstance(attention_mask, LocalMask):
        sliding_window = sliding_window or attention_mask.window
        attention_mask = attention_mask.padding
    if sliding_window is not None:
        ok = ok & (kpos > qpos - sliding_window)
    mask = ok[None, None].expand(b, 1, lq, lk)
    if attention_mask is not None and attention_mask.dim() == 2:
        mask = mask & attention_mask[:, None, None, -lk:].bool()
    elif attention_mask is not None and attention_mask.dim() == 4:
        am = attention_mask[..., -lk:]
        mask = mask & (am if am.dtype == torch.bool else am == 0)
    kk, vv = _repeat_kv(key, g), _repeat_kv(value, g)
    if sinks is None:
        return F.scaled_dot_product_attention(query, kk, vv, attn_mask=mask, scale=scale)
    logits = torch.matmul(query, kk.transpose(-1, -2)).mul(scale).masked_fill(~mask, -math.inf)
    with_sink = torch.cat([logits, sinks.to(logits.dtype).view(1, hq, 1, 1).expand(b, hq, lq, 1)], dim=-1)
    return torch.matmul(torch.softmax(with_sink, dim=-1)[..., :-1], vv)


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


def split_into_chunks(docs: list[int], chunk: int) -> tuple[list[int], list[int]]:
    """Chunked attention as documents: each document cut into `chunk`-long pieces (the last one shorter).

    Returns (piece lengths, index of the document each piece belongs to)."""
    pieces, owner = [], []
    for d, n in enumerate(docs):
        for start in range(0, n, chunk):
            pieces.append(min(chunk, n - start))
            owner.append(d)
    return pieces, owner


@dataclass
class RowLayout:
    """One batch row's block layout and the real document of each of its layout documents."""

    layout: Layout
    doc_lengths: list[int]  # the row's real documents (what reports count)
    owner: torch.Tensor | None  # layout document -> real document (None: the same documents)


class _ForwardLayouts:
    """The rows' layouts of the current forward, built by its first layer and reused by the others.

    Keyed by the identity of the tensors the layers share (position ids, cu_seq_lens, padding), so the
    documents are read from the device once per forward, not once per layer."""

    def __init__(self):
        self._key: tuple | None = None
        self._held: tuple = ()
        self._rows: list[RowLayout] = []

    def get(self, batch: int, length: int, position_ids, cu, padding, block_size: int, chunk: int | None,
            device) -> list[RowLayout]:
        held = (position_ids, cu, padding)
        key = (batch, length, block_size, chunk, str(device),
               tuple(None if t is None else (id(t), t._version) for t in held))
        if key == self._key and all(a is b for a, b in zip(held, self._held)):
            return self._rows
        rows = []
        for row in range(batch):
            docs, tokens = _row_documents(row, length, position_ids, cu, padding)
            pieces, owner = (docs, None) if chunk is None else split_into_chunks(docs, chunk)
            rows.append(RowLayout(make_layout(pieces, block_size, device, tokens=tokens, length=length), docs,
                                  None if owner is None else torch.tensor(owner, device=device)))
        self._key, self._held, self._rows = key, held, rows
        return rows


_LAYOUTS = _ForwardLayouts()


def document_blocks(layout: Layout, hkv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every causal block of every document, as kernel indices: ([1, Hkv, nb, K], [1, Hkv, nb]) with K the
    longest document's blocks (no [nb, nb] grid); unused slots repeat the diagonal block."""
    nb, bs = layout.num_blocks, layout.block_size
    widest = max(max(1, -(-n // bs)) for n in layout.doc_lengths)
    i = torch.arange(nb, device=layout.block_start.device)
    idx = (layout.block_start[:, None] + torch.arange(widest, device=i.device)).minimum(i[:, None])
    counts = i - layout.block_start + 1
    return idx[None, None].expand(1, hkv, nb, widest), counts[None, None].expand(1, hkv, nb)


def _dense_docs(qp, kp, vp, layout: Layout, scale: float, backend: str, chunk_blocks: int) -> torch.Tensor:
    """Exact dense causal attention of every document, in the layout: one fused SDPA call for a single
    document, one block-sparse kernel call keeping every causal block of each document for several
    (on CPU as fast as SDPA per document with a few long documents and 1.15-1.4x faster with 16 short ones,
    bench_results/dense_docs.json; FlexAttention with the document block mask on CUDA)."""
    if len(layout.doc_lengths) == 1 and (layout.identity or layout.doc_lengths[0] == qp.shape[2]):
        return F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                              enable_gqa=qp.shape[1] != kp.shape[1])
    idx, counts = document_blocks(layout, kp.shape[1])
    return block_sparse_attention(qp, kp, vp, idx, counts, block_size=layout.block_size, scale=scale,
                                  backend=backend, chunk_blocks=chunk_blocks)


def recall_seed(layer: int, doc_lengths: list[int]) -> int:
    """Seed of the query blocks drawn to sample recall: a function of the layer and the row's documents only.

    So runs that see the same documents (two configurations of a benchmark, a resumed run) draw the same
    query blocks, and their recalls differ by what their selections keep rather than by what was drawn.
    """
    return zlib.crc32(f"{layer}:{','.join(map(str, doc_lengths))}".encode())


def _per_document(layout: Layout, per_block: torch.Tensor, owner: torch.Tensor | None, ndocs: int) -> torch.Tensor:
    """Sum a per-block count [nb] over each (real) document, on the device."""
    counts = torch.zeros(len(layout.doc_lengths), dtype=torch.float64, device=per_block.device)
    counts.index_add_(0, layout.block_doc, per_block.double())
    if owner is None:
        return counts
    return torch.zeros(ndocs, dtype=torch.float64, device=counts.device).index_add_(0, owner, counts)


def _route_signature(layout: Layout, window: int | None, sinks: bool) -> tuple:
    return (tuple(layout.doc_lengths), layout.length, layout.block_size, window, sinks)


def _choose_route(controller, layer: int, qp, kp, layout: Layout, scale: float, window: int | None,
                  sinks: bool, recompute: bool = False):
    """The block selection of this layer call (None: run dense), the torch kernel's plan, and the kept
    counts at the rank's own budget (before a layer tuner moved them: what the documents' density is at
    that budget, for the density knowledge; the same tensor when nothing moved them).

    Hook point for layer-level dynamic sparsity: a change of the selection (for example dropping the
    lowest-ranked blocks or adding the next-ranked ones after ranks exchange one number per layer) goes at
    the end of this function, before the plan is made. The caller caches whatever this returns, so a
    gradient-checkpoint recompute reuses the adjusted selection without calling this again (and without
    any collective)."""
    cfg = controller.config
    forced = controller.forced_density
    budget = controller.budget_for(layer)
    full = (layer in controller.dense_layers or (forced is not None and forced >= 1.0)
            or (forced is None and budget >= 1.0))
    if full and window is None and not sinks and cfg.exact_dense_at_full_budget:
        return None, None, None  # every causal block kept: fused dense SDPA per document is the same computation
    tuner = getattr(controller, "layer_tuner", None)
    tuning = tuner is not None and forced is None and not full
    budgets = [1.0 if full else budget] + ([tuner.min_budget, tuner.max_budget] if tuning else [])
    sel, *bounds = controller.select_at(qp[0].detach(), kp[0].detach(), layout, budgets, scale, window,
                                        force_density=None if full else forced)
    at_budget = sel.counts
    if tuning:
        # layer-level DST (balancer/layer_tuning.py): move this rank's selection toward the layer's target
        sel = tuner.adjust(layer, sel, *bounds, recompute)
    plan = None
    if resolve_backend(cfg.backend, qp.device) == "torch":
        plan = make_plan(sel.indices[None], sel.counts[None], layout.num_blocks, cfg.chunk_blocks)
    return sel, plan, at_budget


def sparse_attention_row(
    controller,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: Layout,
    scale: float,
    window: int | None = None,
    row: int = 0,
    report: bool = True,
    sinks: torch.Tensor | None = None,
    doc_lengths: list[int] | None = None,
    owner: torch.Tensor | None = None,
    remember: bool = False,
) -> torch.Tensor:
    """One batch row ([1, H, L, D] tensors in the original token order) through selection and kernel.

    `doc_lengths`/`owner`: the row's real documents when the layout splits them (chunked attention).
    `remember`: keep the route for a gradient-checkpoint recompute (training forwards). A call made
    during a backward is such a recompute: it reuses the kept route and samples and reports nothing."""
    cfg = controller.config
    hkv = k.shape[1]
    docs = list(layout.doc_lengths) if doc_lengths is None else doc_lengths
    qp, kp, vp = to_layout(q, layout), to_layout(k, layout), to_layout(v, layout)
    recompute = in_backward()
    signature = _route_signature(layout, window, sinks is not None)
    cached = controller.kept_route(layer, row, signature) if recompute else None
    t0 = time.perf_counter()
    if cached is not None:
        sel, plan, at_budget = cached.selection, cached.plan, None  # a recompute reports nothing
    else:
        if recompute:
            warn_once(log, "checkpoint recompute found no selection from its forward; selecting again")
        sel, plan, at_budget = _choose_route(controller, layer, qp, kp, layout, scale, window, sinks is not None,
                                             recompute)
        if remember and not recompute:
            controller.keep_route(layer, row, CachedRoute(signature, sel, plan))
    t_sel = time.perf_counter() - t0
    if sel is None:
        out = _dense_docs(qp, kp, vp, layout, scale, cfg.backend, cfg.chunk_blocks)
        if report and not recompute:
            caus = _per_document(layout, causal_counts(layout, None) * hkv, owner, len(docs))
            controller.record(layer, row, docs, caus, caus, None if cfg.recall_samples == 0 else 1.0)
        return from_layout(out, layout)
    out = block_sparse_attention(qp, kp, vp, sel.indices[None], sel.counts[None], block_size=layout.block_size,
                                 scale=scale, window=window, backend=cfg.backend, chunk_blocks=cfg.chunk_blocks,
                                 plan=plan, sinks=sinks)
    if report and not recompute:
        recall = None
        if cfg.recall_samples > 0:
            recall = sampled_recall_tensor(qp[0].detach(), kp[0].detach(), layout, sel, cfg.recall_samples, scale,
                                           recall_seed(layer, layout.doc_lengths), window)
        kept = _per_document(layout, sel.counts.sum(0), owner, len(docs))
        moved = at_budget is not sel.counts  # a layer tuner changed the selection
        kept_at_budget = _per_document(layout, at_budget.sum(0), owner, len(docs)) if moved else None
        caus = _per_document(layout, sel.causal * hkv, owner, len(docs))
        controller.record(layer, row, docs, kept, caus, recall, t_sel, doc_kept_at_budget=kept_at_budget)
    return from_layout(out, layout)


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast would compute attention in on `device`, or None when autocast is off."""
    if device.type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


def sparsebalance_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | LocalMask | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: q [B, Hq, L, D], k/v [B, Hkv, L, D] -> ([B, L, Hq, D], None).

    `s_aux` [Hq]: GPT-OSS's attention-sink logits. Under autocast the attention runs in autocast's dtype
    (bf16 on CPU), with autocast itself switched off inside so the kernels keep the dtypes they chose."""
    if softcap is not None:
        raise ValueError(f"sparsebalance attention has no attention logit softcapping (softcap={softcap}); "
                         "use model.attn_implementation eager for this model")
    if dropout:
        # a replayable dropout mask per kept block in three kernels' backward, for a regulariser LoRA
        # fine-tuning does not use (lora_dropout is its own): refused rather than silently skipped
        raise ValueError(f"sparsebalance attention has no attention dropout (got {dropout} in training): "
                         "set the model config's attention_dropout to 0")
    controller = _controller_for(module)
    cast = _autocast_dtype(query.device)
    if cast is not None:
        query, key, value = query.to(cast), key.to(cast), value.to(cast)
    with torch.autocast(query.device.type, enabled=False) if cast is not None else nullcontext():
        out = _attention(controller, module, query, key, value, attention_mask, scaling, is_causal, sliding_window,
                         s_aux, kwargs)
    return out.transpose(1, 2).contiguous(), None


def _attention(controller, module, query, key, value, attention_mask, scaling, is_causal, sliding_window, sinks,
               kwargs) -> torch.Tensor:
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    b, hq, lq, d = query.shape
    lk = key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal:
        raise ValueError("sparsebalance attention is causal only")
    local = attention_mask if isinstance(attention_mask, LocalMask) else None
    padding = local.padding if local is not None else attention_mask
    if lq != lk or lq < 2 or (padding is not None and padding.dim() != 2):
        return _fallback(query, key, value, attention_mask, scale, sliding_window, sinks)
    window = sliding_window if sliding_window is not None else (local.window if local is not None else None)
    chunk = local.chunk if local is not None else None
    layer = int(getattr(module, "layer_idx", 0) or 0)
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        position_ids = getattr(controller, "call_position_ids", None)
        if position_ids is not None and position_ids.shape[-1] != lq:
            position_ids = None
    rows = _LAYOUTS.get(b, lq, position_ids, kwargs.get("cu_seq_lens_q"), padding,
                        controller.config.block_size, chunk, query.device)
    outs = []
    for row, rl in enumerate(rows):
        w = window if (window is not None and window < max(rl.layout.doc_lengths)) else None
        outs.append(sparse_attention_row(controller, layer, query[row:row + 1], key[row:row + 1],
                                         value[row:row + 1], rl.layout, scale, w, row=row, sinks=sinks,
                                         doc_lengths=rl.doc_lengths, owner=rl.owner, remember=module.training))
    return outs[0] if b == 1 else torch.cat(outs, dim=0)
