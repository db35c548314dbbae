"""The `balance:` section of a recipe: how work is spread over ranks and budgets tuned."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import UserError

BatchingPolicyName = Literal["random", "tokens", "kk-length", "kk-flops", "length-grouped", "verl", "sparsebalance"]
TuningMode = Literal["none", "straggler-only", "bidirectional", "layer"]
TargetRule = Literal["mean", "fastest", "fill"]


class BalanceConfigError(UserError):
    """The `balance:` section disagrees with another section (one line, exit 2)."""


class BalanceConfig(BaseModel):
    """Sparsity-aware batching (SAB) and dynamic sparsity tuning (DST) settings.

    The defaults are the setup the project's measurements favour (docs/balancing.md): SAB over the
    look-ahead, layer-level DST, and target `fill`, which cuts nobody and spends waits on budget.
    """

    model_config = ConfigDict(extra="forbid")

    batching: BatchingPolicyName = Field(
        "sparsebalance",
        description="How each step's documents are assigned to ranks. length-grouped and verl are the fair peers"
        " (they see the same look-ahead as sparsebalance); random, tokens, kk-length and kk-flops see one step.",
    )
    lookahead_steps: int = Field(
        32,
        ge=1,
        le=4096,
        description="Steps whose documents length-grouped, verl and sparsebalance regroup together (1: none).",
    )
    tuning: TuningMode = Field(
        "layer",
        description="Dynamic sparsity tuning: lower stragglers' budgets, and optionally raise the others'. layer:"
        " per-step bidirectional tuning, then, inside the step, every layer's measured work is exchanged and each"
        " rank's selection moved toward the step's target (balancer/layer_tuning.py).",
    )
    min_budget: float = Field(0.1, ge=0.0, le=1.0, description="No rank's budget goes below this.")
    max_budget: float = Field(0.9, ge=0.0, le=1.0, description="No rank's budget goes above this.")
    per_layer: bool = Field(False, description="Tune a budget per layer instead of one per rank.")
    profile: str | None = Field(None, description="Latency profile from `sbft profile`; an analytic model is used without one.")
    target: TargetRule = Field(
        "fill",
        description=(
            "Target step time T* of the tuner. mean: the mean predicted time at the default budget over the ranks that"
            " can absorb work (idle and padding-only ranks do not count), raised to the slowest rank's time at"
            " min_budget when that is higher (no cut can go below it). fastest: that floor alone (fastest step, most"
            " sparsity). fill: the slowest rank's time at the default budget; nobody is cut and the others take"
            " budget up to it (same step time, more budget: free accuracy)."
        ),
    )
    headroom: float = Field(
        0.0,
        ge=0.0,
        lt=0.5,
        description="Bidirectional: ranks that wait are raised only to (1 - headroom) x T*, a margin for prediction error.",
    )
    tolerance: float = Field(
        0.05,
        ge=0.0,
        lt=1.0,
        description="A rank predicted slower than T* by less than this share is not cut: such a gap is within the"
        " cost model's error, and the cut would cost recall for nothing.",
    )
    grid_points: int = Field(
        17, ge=2, le=257, description="Budgets between min_budget and max_budget at which each rank's time is predicted."
    )

    @model_validator(mode="after")
    def _bounds_ordered(self) -> "BalanceConfig":
        if self.min_budget > self.max_budget:
            raise ValueError(f"min_budget ({self.min_budget}) must not exceed max_budget ({self.max_budget})")
        if self.tuning == "layer" and self.max_budget >= 1.0:
            chosen = "" if "tuning" in self.model_fields_set else " (the default; bidirectional tunes up to 1.0)"
            raise ValueError(f"tuning 'layer'{chosen} needs max_budget < 1.0 (at 1.0 a layer runs dense and has no blocks to move)")
        return self

    def check_default_budget(self, default_budget: float) -> None:
        """With tuning on, the default budget (`sparsity.budget`) must lie within [min_budget, max_budget].

        Raises `BalanceConfigError` naming both keys; call it when the recipe is loaded.
        """
        if self.tuning != "none" and not (self.min_budget <= default_budget <= self.max_budget):
            raise BalanceConfigError(
                f"sparsity.budget ({default_budget}) lies outside balance.min_budget..max_budget"
                f" ({self.min_budget}..{self.max_budget}); tuning '{self.tuning}' moves budgets within those bounds"
            )
