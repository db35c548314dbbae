"""The `balance:` section of a recipe: how work is spread over ranks and budgets tuned."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

BatchingPolicyName = Literal["random", "tokens", "kk-length", "kk-flops", "sparsebalance"]


class BalanceConfig(BaseModel):
    """Sparsity-aware batching (SAB) and dynamic sparsity tuning (DST) settings."""

    model_config = ConfigDict(extra="forbid")

    batching: BatchingPolicyName = Field("random", description="How each step's documents are assigned to ranks.")
    tuning: Literal["none", "straggler-only", "bidirectional"] = Field(
        "none", description="Dynamic sparsity tuning: lower stragglers' budgets, and optionally raise the others'."
    )
    min_budget: float = Field(0.1, ge=0.0, le=1.0, description="No rank's budget goes below this.")
    max_budget: float = Field(0.9, ge=0.0, le=1.0, description="No rank's budget goes above this.")
    per_layer: bool = Field(False, description="Tune a budget per layer instead of one per rank.")
    profile: str | None = Field(None, description="Latency profile from `sbft profile`; an analytic model is used without one.")

    @model_validator(mode="after")
    def _bounds_ordered(self) -> "BalanceConfig":
        if self.min_budget > self.max_budget:
            raise ValueError(f"min_budget ({self.min_budget}) must not exceed max_budget ({self.max_budget})")
        return self
