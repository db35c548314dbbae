"""Watch the `sparsebalance` attention of a real model from outside: which blocks each layer selected.

`probe_attention(model, on_layer)` routes every attention call through the registered sparse attention
and, for prefill calls (as many queries as keys), first hands the rotated query and key of batch row 0 to
`on_layer(layer, q [Hq, L, D], k [Hkv, L, D])`. The callback re-runs the selection itself (`selection_of`):
the selection is deterministic, so it sees exactly the blocks the kernel used, and what it derives from
them (exact recall, whether a needle's block was kept) does not go through the kernel.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from ..attention.budget import SparseAttentionController
from ..attention.register import sparsebalance_attention_forward, sparsebalance_mask
from ..attention.selection import Layout, Selection, make_layout, to_layout

_PROBE = "sbft_probe"
_HOOK = "_sbft_probe_hook"

LayerCallback = Callable[[int, torch.Tensor, torch.Tensor], None]


def _probe_forward(module, query, key, value, attention_mask, **kwargs):
    hook = getattr(module, _HOOK, None)
    if hook is not None and query.shape[2] == key.shape[2]:
        hook(int(getattr(module, "layer_idx", 0) or 0), query[0].detach(), key[0].detach())
    return sparsebalance_attention_forward(module, query, key, value, attention_mask, **kwargs)


@contextmanager
def probe_attention(model: torch.nn.Module, on_layer: LayerCallback) -> Iterator[None]:
    """Within the context every prefill attention call of `model` (already attached) reports to `on_layer`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(_PROBE, _probe_forward)
    AttentionMaskInterface.register(_PROBE, sparsebalance_mask)
    modules = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)]
    before = model.config._attn_implementation
    model.set_attn_implementation(_PROBE)
    for m in modules:
        object.__setattr__(m, _HOOK, on_layer)
    try:
        yield
    finally:
        for m in modules:
            object.__delattr__(m, _HOOK)
        model.set_attn_implementation(before)


def selection_of(controller: SparseAttentionController, layer: int, q: torch.Tensor, k: torch.Tensor
                 ) -> tuple[Selection, Layout] | None:
    """The selection the attention made for one single-document row (None: the layer ran dense)."""
    cfg = controller.config
    budget = controller.budget_for(layer)
    if layer in controller.dense_layers or budget >= 1.0:
        return None
    layout = make_layout([q.shape[1]], cfg.block_size, q.device)
    qp, kp = to_layout(q[None], layout)[0], to_layout(k[None], layout)[0]
    return controller.select(qp, kp, layout, budget, q.shape[-1] ** -0.5), layout
