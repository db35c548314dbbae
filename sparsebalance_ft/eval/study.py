"""The accuracy study (`make bench-accuracy`): dense vs fixed-budget sparse vs SparseBalance training.

Design. One tiny model (same initialisation), one synthetic passkey training set at mixed
lengths, the same seed and number of optimizer steps for every *arm*; arms differ only in
their recipe overrides (attention, batching, tuning). Each arm is trained by a caller-supplied
`trainer` (the training loop is not this module's business), then its adapter is evaluated on
held-out passkey prompts (a different seed from the training data) at every training length and
one beyond, under dense attention and under the recipe's sparse attention at its default budget
(which also measures the attention's mean sampled recall on the trained model). Training-time
figures (mean recall, density, budget, step time, bubble) come from the arm's `metrics.jsonl`.
Everything lands in `<out>/accuracy_study.json` and a Markdown table `<out>/accuracy_study.md`
for the README, whatever the numbers show.

Sizing for this machine (2 shared CPU cores; calibrated with 5-step runs of every arm at the
default sizes, 2 gloo ranks x 4 documents of 256..2048 tokens, mean 960, per step): about 2.0 s
per dense step, 1.05 s fixed-budget sparse, 0.85 s SparseBalance, ~10 s start-up per arm, so
`StudyPlan()` defaults (240 steps, 2000 training records, 50 prompts x 2 attentions per arm with
answer NLL) come to about 20 minutes on an otherwise idle machine. Measured once with the two
cores shared (load average ~5): 31 minutes of training (2.2 / 2.0 / 1.7 s per step) and 8
minutes of evaluation. At this size the random-init tiny model learns the passkey format but not
the retrieval (all arms at chance: accuracy 0, digits ~0.09, answer NLL ~1.95 nats/token);
telling the arms apart needs more steps or a pretrained model. `--reuse` re-evaluates trained
arms without training again. `StudyPlan.quick()` is a one-minute smoke version for tests.

Wiring: `run_accuracy_study(base, arms, trainer, out)` with `trainer(recipe) -> summary` where
summary is `train()`'s dict (its `adapter_dir`), or just the adapter path. `launch_trainer(n)`
runs `sbft train` on n local ranks in fresh processes, one arm after the other; `main()` does
everything for `python -m sparsebalance_ft.eval.study --out bench_results/accuracy --work runs/accuracy`.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..recipe import Recipe, apply_overrides, dump_recipe, recipe_from_dict

Arm = tuple[str, list[str]]
Trainer = Callable[[Recipe], "Mapping[str, Any] | str | Path"]

DEFAULT_ARMS: list[Arm] = [
    ("dense", ["model.attn_implementation=sdpa", "balance.batching=random", "balance.tuning=none"]),
    ("sparse-fixed", ["model.attn_implementation=sparsebalance", "balance.batching=random", "balance.tuning=none"]),
    (
        "sparsebalance",
        ["model.attn_implementation=sparsebalance", "balance.batching=sparsebalance", "balance.tuning=bidirectional"],
    ),
]


@dataclass
class StudyPlan:
    """Sizes of the study; defaults fit about 20 minutes on this machine."""

    nproc: int = 2
    seed: int = 0
    model: dict[str, Any] = field(
        default_factory=lambda: {"hidden_size": 128, "layers": 4, "heads": 4, "kv_heads": 2, "max_position_embeddings": 8192}
    )
    train_task: str = "passkey"
    train_lengths: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048])
    train_records: int = 2000
    max_steps: int = 240
    docs_per_rank: int = 4
    learning_rate: float = 2e-3
    eval_lengths: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048, 4096])
    eval_depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    eval_samples: int = 2
    eval_seed: int = 4321
    eval_attentions: tuple[str, ...] = ("dense", "sparse")
    sparsity: dict[str, Any] = field(default_factory=lambda: {"block_size": 64, "budget": 0.5})
    balance: dict[str, Any] = field(  # pinned to the settings the published figures ran with; arms override three
        default_factory=lambda: {"batching": "random", "tuning": "none", "target": "mean", "min_budget": 0.2, "max_budget": 0.9})

    @classmethod
    def quick(cls) -> "StudyPlan":
        """A smoke-sized plan (about a minute): tiny model, short sequences, a few steps."""
        return cls(
            nproc=1,
            model={"hidden_size": 64, "layers": 2, "heads": 2, "kv_heads": 1, "max_position_embeddings": 1024},
            train_lengths=[128, 256],
            train_records=24,
            max_steps=2,
            docs_per_rank=2,
            eval_lengths=[128, 256],
            eval_depths=[0.0, 1.0],
            eval_samples=1,
        )


def prepare_study(out_dir: str | Path, plan: StudyPlan | None = None) -> Recipe:
    """The tiny model (kept if already there), the synthetic training data, and the base recipe."""
    from ..data.synthetic import generate, write_jsonl
    from ..modeling.tiny import init_tiny

    plan = plan or StudyPlan()
    out = Path(out_dir)
    model_dir = out / "tiny-model"
    if not (model_dir / "config.json").is_file():
        init_tiny(model_dir, seed=plan.seed, **plan.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = out / f"train_{plan.train_task}.jsonl"
    if not data.is_file():
        write_jsonl(generate(plan.train_task, plan.train_lengths, plan.train_records, seed=plan.seed, tokenizer=tokenizer), data)
    longest = max(plan.train_lengths)
    base = {
        "model": {"path": str(model_dir), "dtype": "float32", "attn_implementation": "sdpa", "gradient_checkpointing": False},
        "lora": {"r": 16, "alpha": 32, "modules_to_save": ["embed_tokens", "lm_head", "norm"]},
        "data": {
            "path": str(data),
            "format": "jsonl",
            "max_seq_len": longest + 64,
            "min_seq_len": 16,
            "cache_dir": str(out / "cache"),
        },
        "training": {
            "output_dir": str(out / "runs"),
            "max_steps": plan.max_steps,
            "docs_per_rank": plan.docs_per_rank,
            "learning_rate": plan.learning_rate,
            "lr_scheduler": "cosine",
            "warmup_steps": max(1, plan.max_steps // 20),
            "seed": plan.seed,
            "log_every": 5,
            "tensorboard": False,
        },
        "sparsity": dict(plan.sparsity),
        "balance": dict(plan.balance),
    }
    return recipe_from_dict(base, "accuracy study base recipe")


def arm_recipe(base: Recipe, name: str, overrides: Sequence[str], out_dir: str | Path) -> Recipe:
    """`base` with the arm's overrides and its own output folder; everything else (seed, data, steps) shared."""
    data = apply_overrides(base.model_dump(mode="json"), [*overrides, f"training.output_dir={Path(out_dir) / name}"])
    return recipe_from_dict(data, f"arm {name}")


def launch_trainer(nproc: int = 2) -> Trainer:
    """A trainer that runs `sbft train RECIPE --nproc n` semantics in fresh processes (one per rank)."""

    def trainer(recipe: Recipe) -> dict[str, Any]:
        out = Path(recipe.training.output_dir)
        out.parent.mkdir(parents=True, exist_ok=True)
        path = out.with_name(f"{out.name}.study_recipe.yaml")  # beside the run: train refuses a non-empty output dir
        dump_recipe(recipe, path)
        started = time.perf_counter()
        if nproc > 1:
            from ..train.launch import launch_ranks

            launch_ranks(nproc, ["train", str(path), "--overwrite"])
        else:
            from ..train.loop import train

            train(recipe, overwrite=True)
        return {"adapter_dir": str(out / "adapter"), "wall_time": time.perf_counter() - started}

    return trainer


def training_summary(output_dir: str | Path) -> dict[str, Any]:
    """Means over the steps of `metrics.jsonl`: step time, bubble, and the ranks' budget, density and recall."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        return {}
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not steps:
        return {}

    def avg(values: list[Any]) -> float | None:
        values = [v for v in values if isinstance(v, (int, float))]
        return sum(values) / len(values) if values else None

    ranks = [r for s in steps for r in s.get("ranks", [])]
    return {
        "steps": len(steps),
        "final_loss": steps[-1].get("loss"),
        "mean_step_time": avg([s.get("step_time") for s in steps]),
        "mean_bubble": avg([s.get("bubble") for s in steps]),
        "mean_imbalance": avg([s.get("imbalance") for s in steps]),
        "mean_budget": avg([r.get("budget") for r in ranks]),
        "mean_density": avg([r.get("density") for r in ranks]),
        "mean_recall": avg([r.get("recall") for r in ranks]),
    }


def _adapter_of(summary: Mapping[str, Any] | str | Path, recipe: Recipe) -> tuple[Path, dict[str, Any]]:
    if isinstance(summary, (str, Path)):
        return Path(summary), {}
    adapter = summary.get("adapter_dir") or Path(recipe.training.output_dir) / "adapter"
    return Path(adapter), {k: v for k, v in summary.items() if isinstance(v, (int, float, str, type(None)))}


def run_accuracy_study(
    base: Recipe,
    arms: Sequence[Arm],
    trainer: Trainer,
    out_dir: str | Path,
    *,
    plan: StudyPlan | None = None,
    work_dir: str | Path | None = None,
    reuse: bool = False,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Train every arm with `trainer`, evaluate passkey (dense and sparse inference), write JSON and Markdown.

    Training runs (adapters, checkpoints, metrics) go under `work_dir/runs` (default `out_dir`);
    the small results (study JSON and table, per-arm evaluation JSON and heatmaps) under `out_dir`.
    `reuse` skips training an arm whose run already holds a final adapter (re-evaluation only).
    """
    from .api import evaluate
    from .errors import EvalError

    plan = plan or StudyPlan()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, overrides in arms:
        recipe = arm_recipe(base, name, overrides, Path(work_dir or out) / "runs")
        started = time.perf_counter()
        existing = Path(recipe.training.output_dir) / "adapter"
        if reuse and (existing / "adapter_config.json").is_file():
            adapter, train_info = existing, {"reused": True}
        else:
            adapter, train_info = _adapter_of(trainer(recipe), recipe)
        row: dict[str, Any] = {
            "arm": name,
            "overrides": list(overrides),
            "train": {**train_info, **training_summary(recipe.training.output_dir), "wall_time": time.perf_counter() - started},
            "eval": {},
        }
        context = max(plan.eval_lengths)
        for attention in plan.eval_attentions:
            try:
                result = evaluate(
                    recipe,
                    "passkey",
                    checkpoint=adapter,
                    attention=attention,  # type: ignore[arg-type]
                    out_dir=out / "eval" / name,
                    lengths=plan.eval_lengths,
                    depths=plan.eval_depths,
                    samples=plan.eval_samples,
                    seed=plan.eval_seed,
                    max_length=context,
                    answer_nll=True,
                    show_progress=show_progress,
                )
            except (EvalError, ImportError) as error:  # e.g. sparse attention not built yet: record, go on
                row["eval"][attention] = {"error": str(error)}
                continue
            row["eval"][attention] = {
                key: result.get(key)
                for key in (
                    "accuracy", "position_accuracy", "answer_nll", "answer_nll_by_length", "by_length", "by_depth",
                    "mean_recall", "mean_density", "elapsed_s",
                )
            }
        rows.append(row)
        _write(out, plan, rows)  # partial results survive an interrupted study
    return _write(out, plan, rows)


def _write(out: Path, plan: StudyPlan, rows: list[dict[str, Any]]) -> dict[str, Any]:
    result = {"plan": asdict(plan), "arms": rows}
    (out / "accuracy_study.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "accuracy_study.md").write_text(study_table(result) + "\n")
    return result


def study_table(result: Mapping[str, Any]) -> str:
    """Markdown: one row per arm and inference attention; passkey accuracy per length, recall, train time."""
    rows = result["arms"]
    lengths = [str(n) for n in result["plan"]["eval_lengths"]]
    header = [
        "arm", "eval attention", *[f"passkey@{n}" for n in lengths], "overall", "digits", "answer NLL",
        "eval recall", "train recall", "train budget", "step time (s)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def f(value: Any, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    for row in rows:
        train = row["train"]
        for attention, ev in row["eval"].items():
            if "error" in ev:
                cells = [row["arm"], attention, *["-"] * len(lengths), "n/a", "-", "-", "-"]
            else:
                cells = [
                    row["arm"],
                    attention,
                    *[f(ev["by_length"].get(n)) for n in lengths],
                    f(ev["accuracy"]),
                    f(ev.get("position_accuracy")),
                    f(ev.get("answer_nll")),
                    f(ev.get("mean_recall"), 3),
                ]
            cells += [f(train.get("mean_recall"), 3), f(train.get("mean_budget")), f(train.get("mean_step_time"))]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
