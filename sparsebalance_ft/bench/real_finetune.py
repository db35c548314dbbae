"""The `finetune` section of `sbft bench real`: a short long-document LoRA fine-tune of the real model under
dense attention, fixed-budget sparse attention and SparseBalance (SAB + DST), from one initialisation.

Every arm trains the same number of steps on the same documents (long standard-library modules, truncated to
one length; same seed, so the same data order) on `nproc` gloo ranks with `sbft train`; the arms differ
only in their attention and balancing overrides (the accuracy study's arms). After training, each arm's
adapter is scored on held-out documents (`email/*.py`, never trained on) with dense and with sparse
attention, and on passkey prompts with the attention it trained with. Time per step is the mean
`step_time` of its metrics.jsonl. The figures are what these few steps measured, nothing more: a few
dozen steps say whether sparse training hurts the loss early on, not where a long run would end.
"""
from __future__ import annotations

import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..eval.study import DEFAULT_ARMS, arm_recipe, launch_trainer, training_summary
from ..recipe import Recipe, recipe_from_dict


@dataclass
class FinetunePlan:
    nproc: int = 2
    steps: int = 24
    tokens: int = 2048
    docs_per_rank: int = 1
    learning_rate: float = 1e-3
    heldout_glob: str = "email/*.py"
    heldout_docs: int = 4
    passkey_lengths: list[int] = field(default_factory=lambda: [1024, 2048])
    passkey_depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    passkey_samples: int = 2
    seed: int = 0

    @classmethod
    def make(cls, quick: bool) -> "FinetunePlan":
        if quick:
            return cls(steps=4, tokens=512, heldout_docs=2, passkey_lengths=[1024], passkey_depths=[0.5],
                       passkey_samples=2)
        return cls()


def base_recipe(model_dir: Path, work: Path, plan: FinetunePlan) -> Recipe:
    """The recipe every arm shares: long standard-library modules, LoRA on every linear layer."""
    return recipe_from_dict({
        # pinned to the settings the published figures ran with; each arm overrides attention, batching and tuning
        "model": {"path": str(model_dir), "dtype": "float32", "attn_implementation": "sdpa", "gradient_checkpointing": False},
        "lora": {"r": 16, "alpha": 32,
                 "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
        "data": {"path": sysconfig.get_paths()["stdlib"], "text_glob": "*.py", "max_seq_len": plan.tokens,
                 "min_seq_len": plan.tokens, "too_long": "truncate", "cache_dir": str(work / "cache")},
        "training": {"output_dir": str(work / "runs"), "max_steps": plan.steps, "docs_per_rank": plan.docs_per_rank,
                     "learning_rate": plan.learning_rate, "warmup_steps": max(1, plan.steps // 10),
                     "seed": plan.seed, "log_every": 1, "tensorboard": False},
        "sparsity": {"budget": 0.5},
        "balance": {"batching": "random", "tuning": "none", "target": "mean", "min_budget": 0.2, "max_budget": 0.9},
    }, "real fine-tune base recipe")


def _passkey(recipe: Recipe, adapter: Path, attention: str, plan: FinetunePlan, out: Path) -> dict[str, Any]:
    from ..eval.api import evaluate

    result = evaluate(recipe, "passkey", checkpoint=adapter, attention=attention, out_dir=out,  # type: ignore[arg-type]
                      lengths=plan.passkey_lengths, depths=plan.passkey_depths, samples=plan.passkey_samples,
                      max_length=max(plan.passkey_lengths) + 64, show_progress=False)
    return {key: result.get(key) for key in ("accuracy", "by_length", "by_depth", "mean_density", "mean_recall")}


def finetune_section(model_dir: Path, work: Path, plan: FinetunePlan,
                     progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Train every arm, then score held-out loss (dense and sparse) and passkey; one row per arm."""
    from ..train.model import load_tokenizer
    from .real_heldout import heldout_documents, heldout_losses

    base = base_recipe(model_dir, work, plan)
    heldout = heldout_documents(base, load_tokenizer(base), plan.heldout_glob, plan.heldout_docs, plan.tokens)
    trainer = launch_trainer(plan.nproc)
    arms = []
    for name, overrides in DEFAULT_ARMS:
        recipe = arm_recipe(base, name, overrides, work / "runs")
        progress(f"finetune: training {name} ({plan.steps} steps, {plan.nproc} ranks, {plan.tokens} tokens per document)")
        trained = trainer(recipe)
        adapter = Path(trained["adapter_dir"])
        summary = training_summary(recipe.training.output_dir)
        progress(f"finetune: {name}: {summary.get('mean_step_time', float('nan')):.1f}s per step; scoring")
        attention = "dense" if name == "dense" else "sparse"
        arms.append({
            "arm": name,
            "overrides": list(overrides),
            "train": {**summary, "wall_time": trained["wall_time"]},
            "heldout_loss": heldout_losses(recipe, adapter, heldout)["tuned"],
            "passkey": _passkey(recipe, adapter, attention, plan, work / "eval" / name),
        })
    before = heldout_losses(base, None, heldout)["base"]
    return {"plan": asdict(plan), "heldout_before": before, "arms": arms,
            "note": "as measured after this many steps; no claim beyond it"}
