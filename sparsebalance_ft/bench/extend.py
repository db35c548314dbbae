"""`sbft bench extend`: does a model read past its native length after fine-tuning, and what does sparse attention
save on the way? Three sections, each runnable alone, written into one `extend.json`:

- `before`: held-out loss by position bucket and passkey retrieval for the native model and for each scaling
  type untrained (linear, dynamic, yarn at the auto factor of the training length);
- `finetune`: two arms on the same data order and step count, dense SDPA and `sparsebalance` at the default
  budget, both through the training loop (`train()`) with the recipe's rope scaling, LoRA, embeddings and
  norms; wall time, tokens per second and loss against wall-clock;
- `after`: each arm's adapter evaluated with dense attention: loss by position bucket at each evaluation
  length, passkey grid, and short-context loss against the base model's.

The recipe (`recipes/extend-smollm2.yaml`) is the job; the plan sets sizes. The default plan is sized for one
H200 (16K training, ~150 steps, 8K/16K/32K evaluation, 5 trials per cell); `--quick` runs every section on the
tiny model (256 native positions, trained at 512) in well under a minute, to test the plumbing.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..errors import UserError
from ..recipe import Recipe, RopeScalingConfig, apply_overrides, recipe_from_dict

SECTIONS = ("before", "finetune", "after")
UNTRAINED = ("native", "linear", "dynamic", "yarn")
ARMS = {"dense": ["model.attn_implementation=sdpa"], "sparse": ["model.attn_implementation=sparsebalance"]}
# Both arms: the same documents in the same order (random batching is a seeded shuffle) and no tuning, so
# what differs is the attention alone.
SHARED = ["balance.batching=random", "balance.tuning=none"]


@dataclass
class ExtendPlan:
    """Sizes of the bench. Defaults: the real run on one GPU; `quick()`: the tiny model in seconds."""

    train_len: int = 16384
    steps: int = 150
    train_docs: int = 160
    eval_lengths: list[int] = field(default_factory=lambda: [8192, 16384, 32768])
    bucket: int = 4096
    heldout_docs: int = 2
    short_len: int = 2048
    passkey_lengths: list[int] = field(default_factory=lambda: [8192, 12288, 16384, 24576, 32768])
    passkey_depths: list[float] = field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9])
    passkey_trials: int = 5
    device: str = "cuda"
    quick: bool = False
    seed: int = 0

    @classmethod
    def cpu(cls) -> "ExtendPlan":
        """What two CPU cores allow: a few 16K steps, evaluation to 16K, fewer passkey trials."""
        return cls(steps=4, train_docs=8, eval_lengths=[8192, 16384], heldout_docs=1,
                   passkey_lengths=[8192, 16384], passkey_trials=1, device="cpu")

    @classmethod
    def make_quick(cls, device: str = "cpu") -> "ExtendPlan":
        return cls(train_len=512, steps=2, train_docs=4, eval_lengths=[256, 512], bucket=128, heldout_docs=1,
                   short_len=128, passkey_lengths=[256, 512], passkey_depths=[0.5], passkey_trials=1,
                   device=device, quick=True)


# ------------------------------------------------------------------ measuring one model


def _parts_on(model, device: str):
    from ..train.loss import split_causal_lm

    model.to(device).eval()
    return split_causal_lm(model)


def token_losses(model, ids: list[int], device: str) -> np.ndarray:
    """Per-position next-token loss of one document (position t predicts token t + 1), logits chunked."""
    from ..train.loss import hidden_states, token_loss

    parts = _parts_on(model, device)
    with torch.no_grad():
        tensor = torch.tensor(ids, dtype=torch.long, device=device)[None]
        hidden = hidden_states(parts, input_ids=tensor, position_ids=torch.arange(len(ids), device=device)[None])
        losses = token_loss(parts, hidden[0, :-1], tensor[0, 1:], mode="chunked", reduction="none")
    return losses.float().cpu().numpy()


def loss_by_position(model, docs: list[list[int]], bucket: int, device: str) -> dict[str, Any]:
    """Mean loss per position bucket (0-4K, 4-8K, ...) pooled over documents, and over the second half of the
    length (the positions past a 2x-extended model's native length: the summary's figure)."""
    losses = np.stack([token_losses(model, doc, device) for doc in docs])
    length = losses.shape[1] + 1
    buckets = {f"{lo}-{min(lo + bucket, length)}": float(losses[:, max(lo - 1, 0):lo + bucket - 1].mean())
               for lo in range(0, length - 1, bucket)}
    return {"tokens": length, "documents": len(docs), "by_position": buckets,
            "mean": float(losses.mean()), "second_half": float(losses[:, length // 2 - 1:].mean())}


def passkey_grid(model, tokenizer, lengths: list[int], depths: list[float], trials: int, device: str,
                 seed: int = 0) -> dict[str, Any]:
    """Exact-match passkey retrieval per length and depth (greedy, dense attention), `trials` prompts per cell."""
    from ..eval.engine import generate_greedy
    from ..eval.metrics import retrieval_exact
    from .real_passkey import MAX_NEW_TOKENS, passkey_prompt

    model.to(device).eval()
    rng = random.Random(seed)
    rows = {}
    for length in lengths:
        by_depth = {}
        for depth in depths:
            prompts = [passkey_prompt(tokenizer, length, depth, rng) for _ in range(trials)]
            answers = generate_greedy(model, tokenizer, [p["ids"] for p in prompts], MAX_NEW_TOKENS, batch_size=1)
            by_depth[f"{depth:g}"] = sum(retrieval_exact(a, p["key"]) == 1.0 for a, p in zip(answers, prompts))
        correct = sum(by_depth.values())
        rows[str(length)] = {"correct": correct, "total": trials * len(depths), "accuracy": correct / (trials * len(depths)),
                             "by_depth": by_depth}
    return {"depths": depths, "trials_per_depth": trials, "lengths": rows}


# ------------------------------------------------------------------ recipes


def dense(recipe: Recipe) -> Recipe:
    """The recipe evaluated with dense attention (nothing to balance), its rope setting untouched."""
    model = recipe.model.model_copy(update={"attn_implementation": "sdpa"})
    return recipe.model_copy(update={"model": model, "balance": recipe.balance.model_copy(update={"tuning": "none"})})


def variant(recipe: Recipe, rope_type: str) -> Recipe:
    """The dense recipe with another rope scaling at the auto factor (`native`: the checkpoint's positions)."""
    scaling = None if rope_type == "native" else RopeScalingConfig(type=rope_type)
    plain = dense(recipe)
    return plain.model_copy(update={"model": plain.model.model_copy(update={"rope_scaling": scaling})})


def bench_recipe(recipe_path: Path, overrides: list[str], plan: ExtendPlan, work: Path, model_dir: Path | None) -> Recipe:
    """The job's recipe at the plan's sizes, reading the training documents the bench writes under `work`;
    `model_dir` replaces its model (the quick plan's tiny one, in float32 without checkpointing)."""
    import yaml

    data = yaml.safe_load(Path(recipe_path).read_text())
    sized = [f"data.path={work / 'train.jsonl'}", f"data.max_seq_len={plan.train_len}",
             f"data.min_seq_len={plan.train_len // 2}", f"training.max_steps={plan.steps}",
             "training.checkpoint_every=null", "training.report_to=none", f"training.seed={plan.seed}",
             f"training.warmup_steps={max(1, plan.steps // 10)}", f"data.cache_dir={work / 'cache'}"]
    # `model_dir` (the quick plan's tiny model) wins over a --set model.path meant for the real plan
    forced = [f"model.path={model_dir}", "model.dtype=float32", "model.gradient_checkpointing=false"] if model_dir else []
    return recipe_from_dict(apply_overrides(data, [*sized, *overrides, *forced]), str(recipe_path))


def quick_model(work: Path) -> Path:
    """The tiny model with 256 native positions, so the quick plan's 512 tokens need scaling."""
    from ..modeling.tiny import init_tiny

    path = work / "tiny-256"
    if not (path / "config.json").is_file():
        init_tiny(path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}, indent=1))
    return path


# ------------------------------------------------------------------ sections


def _load(recipe: Recipe, adapter: Path | None = None):
    from ..train.model import apply_lora, load_base_model

    model = load_base_model(recipe)
    return (apply_lora(model, recipe, adapter, trainable=False) if adapter is not None else model).eval()


def _evaluate(model, tokenizer, heldout: dict[int, list[list[int]]], plan: ExtendPlan, say) -> dict[str, Any]:
    losses = {}
    for length, docs in heldout.items():
        losses[str(length)] = loss_by_position(model, docs, plan.bucket, plan.device)
        say(f"    {length} tokens: loss {losses[str(length)]['mean']:.3f}, second half {losses[str(length)]['second_half']:.3f}")
    passkey = passkey_grid(model, tokenizer, plan.passkey_lengths, plan.passkey_depths, plan.passkey_trials,
                           plan.device, plan.seed)
    say("    passkey " + ", ".join(f"{k}: {v['correct']}/{v['total']}" for k, v in passkey["lengths"].items()))
    return {"loss": losses, "passkey": passkey}


def before_section(recipe: Recipe, tokenizer, heldout, plan: ExtendPlan, say) -> dict[str, Any]:
    from ..train.rope import recipe_rope

    rows = {}
    for kind in UNTRAINED:
        setting = variant(recipe, kind)
        rope = recipe_rope(setting)
        say(f"  before: {kind} ({rope.describe() if rope else 'native positions'})")
        rows[kind] = _evaluate(_load(setting), tokenizer, heldout, plan, say)
    return {"untrained": rows}


def _loss_curve(output_dir: Path) -> list[dict[str, float]]:
    """(wall-clock seconds, loss) after every step, from the run's metrics.jsonl."""
    from ..train.metrics import read_metrics

    wall, curve = 0.0, []
    for row in read_metrics(output_dir / "metrics.jsonl"):
        wall += row["step_time"]
        curve.append({"step": row["step"], "wall_s": wall, "loss": row["loss"], "tokens": row["tokens"]})
    return curve


def finetune_section(recipe: Recipe, plan: ExtendPlan, work: Path, say) -> dict[str, Any]:
    from ..eval.study import arm_recipe
    from ..train.loop import train

    arms = {}
    for name, overrides in ARMS.items():
        arm = arm_recipe(recipe, name, [*overrides, *SHARED], work / "runs")
        say(f"  finetune: {name} ({plan.steps} steps of {plan.train_len} tokens)")
        summary = train(arm, overwrite=True)
        curve = _loss_curve(Path(arm.training.output_dir))
        tokens = sum(row["tokens"] for row in curve)
        arms[name] = {"overrides": [*overrides, *SHARED], "steps": summary["steps"], "wall_s": summary["wall_time"],
                      "train_s": curve[-1]["wall_s"], "tokens": tokens, "tokens_per_s": tokens / curve[-1]["wall_s"],
                      "final_loss": summary["final_loss"], "curve": curve, "adapter": summary["adapter_dir"]}
        say(f"    {name}: {summary['wall_time']:.0f}s, {arms[name]['tokens_per_s']:.0f} tokens/s, "
            f"final loss {summary['final_loss']:.3f}")
    return {"arms": arms}


def after_section(recipe: Recipe, tokenizer, heldout, short, plan: ExtendPlan, finetune: dict, say) -> dict[str, Any]:
    base_short = loss_by_position(_load(variant(recipe, "native")), short, plan.short_len, plan.device)["mean"]
    rows = {"short_context": {"tokens": plan.short_len, "base": base_short}}
    for name, arm in finetune["arms"].items():
        say(f"  after: {name} arm, evaluated with dense attention")
        model = _load(dense(recipe), Path(arm["adapter"]))
        rows[name] = _evaluate(model, tokenizer, heldout, plan, say)
        rows["short_context"][name] = loss_by_position(model, short, plan.short_len, plan.device)["mean"]
    return rows


# ------------------------------------------------------------------ summary, figures, driver


def summary(result: dict[str, Any], plan: ExtendPlan) -> dict[str, Any]:
    """Headline figures at the training length (loss over its second half, the positions past native) and the
    issue's targets, each with the numbers it compares."""
    key = str(plan.train_len)
    out: dict[str, Any] = {"length": plan.train_len}
    untrained = {kind: row for kind, row in result.get("before", {}).get("untrained", {}).items() if key in row["loss"]}
    if untrained:  # empty when the training length was not among the evaluation lengths
        best = min(untrained, key=lambda kind: untrained[kind]["loss"][key]["second_half"])
        out.update(best_untrained=best, best_untrained_loss_16k=untrained[best]["loss"][key]["second_half"],
                   best_untrained_passkey_16k=max(untrained[k]["passkey"]["lengths"].get(key, {}).get("accuracy", 0.0)
                                                  for k in untrained))
    after, arms = result.get("after", {}), result.get("finetune", {}).get("arms", {})
    for name in ARMS:
        if name in after and key in after[name]["loss"]:
            out[f"{name}_arm_loss_16k"] = after[name]["loss"][key]["second_half"]
            out[f"{name}_arm_passkey_16k"] = after[name]["passkey"]["lengths"].get(key, {}).get("accuracy")
        if name in arms:
            out[f"{name}_arm_wall_s"] = arms[name]["train_s"]
    if "sparse_arm_loss_16k" in out:
        out["finetuned_loss_16k"] = out["sparse_arm_loss_16k"]  # the recipe's own arm
    checks = {}
    if "finetuned_loss_16k" in out and "best_untrained_loss_16k" in out:
        checks["finetuned_below_best_untrained"] = out["finetuned_loss_16k"] < out["best_untrained_loss_16k"]
        if out["sparse_arm_passkey_16k"] is not None:  # None: the passkey grid has no prompt at the training length
            checks["finetuned_passkey_at_least_untrained"] = out["sparse_arm_passkey_16k"] >= out["best_untrained_passkey_16k"]
    if "sparse_arm_loss_16k" in out and "dense_arm_loss_16k" in out:
        out["sparse_vs_dense_loss"] = out["sparse_arm_loss_16k"] / out["dense_arm_loss_16k"] - 1.0
        checks["sparse_loss_within_1pct"] = abs(out["sparse_vs_dense_loss"]) <= 0.01
        passkey = {length: abs(after["sparse"]["passkey"]["lengths"][length]["accuracy"]
                               - after["dense"]["passkey"]["lengths"][length]["accuracy"])
                   for length in after["dense"]["passkey"]["lengths"]}
        checks["sparse_passkey_within_1_in_10"] = all(gap <= 0.1 + 1e-9 for gap in passkey.values())
    if "sparse_arm_wall_s" in out and "dense_arm_wall_s" in out:
        out["sparse_over_dense_wall"] = out["sparse_arm_wall_s"] / out["dense_arm_wall_s"]
        checks["sparse_faster"] = out["sparse_over_dense_wall"] < 1.0
    out["targets"] = checks
    return out


def save_figures(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Loss by position (each untrained scaling and each arm, at the longest evaluation) and loss against
    wall-clock per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    curves = {**{f"untrained {k}": v for k, v in result.get("before", {}).get("untrained", {}).items()},
              **{f"{k} arm": v for k, v in result.get("after", {}).items() if k in ARMS}}
    if curves:
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, row in curves.items():
            longest = row["loss"][max(row["loss"], key=int)]
            ax.plot(range(len(longest["by_position"])), list(longest["by_position"].values()), marker="o", label=label)
            ax.set_xticks(range(len(longest["by_position"])), list(longest["by_position"]), rotation=30)
        ax.set(xlabel="token positions", ylabel="held-out loss (nats/token)", title="loss by position")
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(out_dir / "loss_by_position.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    arms = result.get("finetune", {}).get("arms", {})
    if arms:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, arm in arms.items():
            ax.plot([p["wall_s"] for p in arm["curve"]], [p["loss"] for p in arm["curve"]], marker=".", label=name)
        ax.set(xlabel="training wall-clock (s)", ylabel="training loss", title="loss against wall-clock")
        ax.legend()
        fig.tight_layout()
        written.append(out_dir / "loss_vs_wall.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


def run_extend_bench(recipe_path: Path, out_dir: Path, work: Path, sections: list[str], plan: ExtendPlan,
                     overrides: list[str] | None = None, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the chosen sections; `extend.json` is rewritten after each (an interrupted run keeps what it finished,
    a subset replaces only its sections). `after` reads the adapters `finetune` trained (this or an earlier run)."""
    from ..train.model import load_tokenizer
    from .extend_data import heldout_ids, write_training_jsonl

    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        raise UserError(f"--sections: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(SECTIONS)}")
    if plan.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU here; use --device cpu")
    work.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    recipe = bench_recipe(recipe_path, overrides or [], plan, work, quick_model(work) if plan.quick else None)
    tokenizer = load_tokenizer(recipe)
    path = out_dir / "extend.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    if "after" in sections and "finetune" not in sections and "finetune" not in result:
        raise UserError(f"--sections after: no finetune section in {path}; run finetune first")
    longest = max(plan.eval_lengths)
    pool = heldout_ids(tokenizer, longest, plan.heldout_docs)
    if len(pool) < plan.heldout_docs:
        raise UserError(f"held-out text: only {len(pool)} of {plan.heldout_docs} documents of {longest} tokens")
    heldout = {length: [doc[:length] for doc in pool] for length in plan.eval_lengths}
    short = [doc[:plan.short_len] for doc in pool]
    result["plan"] = {**asdict(plan), "recipe": str(recipe_path), "model": recipe.model.path}
    for name in SECTIONS:
        if name not in sections:
            continue
        started = time.perf_counter()
        if name == "before":
            section = before_section(recipe, tokenizer, heldout, plan, say)
        elif name == "finetune":
            write_training_jsonl(tokenizer, plan.train_len, plan.train_docs, work / "train.jsonl")
            section = finetune_section(recipe, plan, work, say)
        else:
            section = after_section(recipe, tokenizer, heldout, short, plan, result["finetune"], say)
        section["elapsed_s"] = time.perf_counter() - started
        result[name] = section
        result["summary"] = summary(result, plan)
        path.write_text(json.dumps(result, indent=2) + "\n")
        say(f"{name}: done in {section['elapsed_s']:.0f}s")
    save_figures(result, out_dir)
    return result

