"""Dynamic block-sparse attention for Hugging Face decoders (the `sparsebalance` attention implementation).

Public API:
- `register_sparse_attention()`: register "sparsebalance" with transformers' attention and mask interfaces.
- `SparseAttentionController.attach(model, config)`: switch a (peft-wrapped) model to it and get the budget API.
- `budget_params(config, b)`, `max_density(length, config, b)`: the budget mapping (for the cost model).
- `block_sparse_attention(q, k, v, block_indices, block_counts, block_size=...)`: the functional kernel.
"""
from .budget import NO_CAP, AttentionReport, SparseAttentionController, budget_params, max_density
from .config import SparsityConfig
from .kernels import block_sparse_attention
from .register import register_sparse_attention, sparsebalance_attention_forward
from .selection import Layout, Selection, make_layout, select_blocks

__all__ = [
    "AttentionReport",
    "Layout",
    "NO_CAP",
    "Selection",
    "SparseAttentionController",
    "SparsityConfig",
    "block_sparse_attention",
    "budget_params",
    "make_layout",
    "max_density",
    "register_sparse_attention",
    "select_blocks",
    "sparsebalance_attention_forward",
]
