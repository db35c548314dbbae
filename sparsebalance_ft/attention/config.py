"""The `sparsity:` section of a recipe: how the dynamic block-sparse attention selects blocks."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SparsityConfig(BaseModel):
    """Selection and kernel settings of the `sparsebalance` attention.

    `budget` is the knob the balancer turns: a scalar in [0, 1] that maps monotonically onto the
    selection rule's threshold (the mass share `tau`, or the log-share margin `anchor_margin`) and
    the per-query-block cap `k_max` (see `attention/budget.py`). 1.0 keeps every causal block, so
    the attention then equals dense attention exactly.
    """

    model_config = ConfigDict(extra="forbid")

    block_size: int = Field(64, description="Query and key block size in tokens (64 or 128 are typical).")
    sink_blocks: int = Field(1, ge=0, description="Leading key blocks always kept (the attention sink).")
    local_blocks: int = Field(2, ge=1, description="Most recent key blocks always kept, the diagonal block included.")
    selection: Literal["mass", "anchor"] = Field(
        "mass",
        description="Which blocks beyond the anchors are kept. mass: the highest-ranked ones until they hold `tau` "
        "of the estimated mass the anchors leave; anchor: every one whose estimated log-share is within `anchor_margin` of the best "
        "non-diagonal anchor block's (the diagonal's when it is the only anchor).",
    )
    tau: float = Field(
        0.8, gt=0.0, le=1.0, description="selection mass: share of the estimated mass outside the anchors that the "
        "kept blocks hold at the default budget (0.8, docs/benchmarks/step.md has the loss it gives on SmolLM2-135M).",
    )
    anchor_margin: float = Field(
        2.0, gt=0.0, description="selection anchor: log-share margin below the anchor reference at the default budget."
    )
    score_queries: int = Field(
        8, ge=0, description="Query tokens per block whose exact attention also ranks the key blocks (the larger of "
        "their mass share and the block-mean estimate counts): what lets a query keep the one block it retrieves "
        "from. 8 instead of 4 cut the default budget's loss gap at 4K from +1.37% to +0.82% at the same density, "
        "for twice the scoring (docs/benchmarks/step.md). 0 ranks by block means alone.",
    )
    score_precision: Literal["auto", "float32"] = Field(
        "auto", description="Precision of the sampled queries' logits. auto: bfloat16 where the hardware multiplies "
        "it natively (a CUDA GPU, a CPU with AVX512-BF16 or AMX), else the query's own; float32: always float32. "
        "`sbft bench score-precision` compares the two on a real model.",
    )
    k_min: int = Field(4, ge=1, description="Fewest key blocks any query block keeps (anchors included).")
    k_max: int = Field(64, ge=1, description="Most key blocks a query block keeps at the default budget.")
    budget: float = Field(0.5, ge=0.0, le=1.0, description="Default budget; 1.0 means dense.")
    dense_layers: list[int] = Field(
        default_factory=list,
        description="Layer indices that always run dense attention (negative indices count from the last layer).",
    )
    backend: Literal["auto", "torch", "flex", "triton"] = Field(
        "auto",
        description="auto: torch on CPU, flex (compiled FlexAttention) on CUDA when available. triton: the Triton"
        " kernel on CUDA (checked under triton's interpreter, not yet timed on a GPU). Except under torch, the"
        " selection scores its sampled queries on CUDA with a Triton kernel where triton is installed.",
    )
    recall_samples: int = Field(4, ge=0, description="Query blocks per layer sampled each forward to measure recall.")
    chunk_blocks: int = Field(
        256, ge=1, description="Gathered key blocks per kernel call (bounds the working memory of the torch kernel)."
    )
    exact_dense_at_full_budget: bool = Field(
        True,
        description="At budget 1.0 (every causal block kept) compute with fused dense SDPA; the result is exact either way.",
    )

    @model_validator(mode="after")
    def _caps_ordered(self) -> "SparsityConfig":
        if self.k_min > self.k_max:
            raise ValueError(f"k_min ({self.k_min}) must not exceed k_max ({self.k_max})")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {self.block_size}")
        return self
