"""`evaluate(...)`: load a trained model and run one long-context task on it.

Checkpoints: a LoRA adapter folder (`adapter_config.json`, e.g. `<output_dir>/adapter`), a
training output folder (its `adapter/`, else its latest complete `checkpoint-N`), a training
checkpoint folder (`trainable_weights.pt`, loaded into a fresh adapter built from the recipe),
or a full Hugging Face model folder (`config.json`). No checkpoint evaluates the base model.

Attention: `dense` runs the model with SDPA (or the recipe's own dense backend); `sparse`
runs the recipe's `sparsebalance` attention at the recipe's budget (or `budget`) and adds the
attention's mean sampled recall and density to the result.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Literal, Sequence

import torch

from ..recipe import Recipe
from .engine import AttentionRecorder, EvalExample, Scored, rank_and_world, run_examples
from .errors import EvalOptionError

TASKS = ("passkey", "kv", "needle", "longbench")
Attention = Literal["dense", "sparse"]
_DENSE_FALLBACK = "sdpa"


def resolve_checkpoint(path: str | Path) -> tuple[str, Path]:
    """What a checkpoint path holds: ("adapter" | "trainable" | "full", folder to load)."""
    path = Path(path)
    if not path.exists():
        raise EvalOptionError(f"--checkpoint: path not found: {path}")
    if (path / "adapter_config.json").is_file():
        return "adapter", path
    if (path / "adapter" / "adapter_config.json").is_file():
        return "adapter", path / "adapter"
    if (path / "trainable_weights.pt").is_file():
        return "trainable", path
    from ..train.checkpoint import latest_checkpoint

    latest = latest_checkpoint(path)
    if latest is not None:
        return "trainable", latest
    if (path / "config.json").is_file():
        return "full", path
    raise EvalOptionError(
        f"--checkpoint: {path} holds no LoRA adapter (adapter_config.json), training checkpoint"
        " (trainable_weights.pt or checkpoint-N/) or model (config.json)"
    )


def eval_recipe(recipe: Recipe, attention: Attention, checkpoint_kind: str | None, checkpoint: Path | None) -> Recipe:
    """The recipe as evaluation loads it: the chosen attention, no gradient checkpointing."""
    data = recipe.model_dump()
    model = data["model"]
    if attention == "sparse":
        model["attn_implementation"] = "sparsebalance"
    elif model["attn_implementation"] == "sparsebalance":
        model["attn_implementation"] = _DENSE_FALLBACK
    model["gradient_checkpointing"] = False
    data["balance"]["tuning"] = "none"  # evaluation runs at one budget; nothing to balance
    if checkpoint_kind == "full":
        model["path"] = str(checkpoint)
        data["lora"]["enabled"] = False
    elif checkpoint_kind is None:
        data["lora"]["enabled"] = False  # the base model: an untrained adapter would change nothing anyway
    return Recipe.model_validate(data)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def load_for_eval(
    recipe: Recipe, checkpoint: str | Path | None = None, attention: Attention = "dense", budget: float | None = None
):
    """`(model, tokenizer, controller)` ready to generate; the controller is None for dense attention."""
    from ..train.checkpoint import ADAPTER_WEIGHTS, restore_trainable
    from ..train.model import load_model
    from ..train.rope import check_rope_record, recipe_rope

    kind, folder = resolve_checkpoint(checkpoint) if checkpoint is not None else (None, None)
    recipe = eval_recipe(recipe, attention, kind, folder)
    if kind == "adapter":
        model, tokenizer = load_model(recipe, adapter_dir=folder, trainable=False)
    else:
        model, tokenizer = load_model(recipe, trainable=False)
        if kind == "trainable":
            check_rope_record(folder, recipe_rope(recipe), "--checkpoint")
            restore_trainable(model, folder / ADAPTER_WEIGHTS)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()  # plain weights: faster generation, same outputs
    model.to(_device()).eval()
    controller = None
    if attention == "sparse":
        try:
            from ..attention import SparseAttentionController
        except ImportError as error:
            raise EvalOptionError(f"--attention sparse: the sparse attention is not available ({error})") from None
        controller = SparseAttentionController.attach(model, recipe.sparsity)
        controller.set_budget(recipe.sparsity.budget if budget is None else budget)
    return model, tokenizer, controller


def context_length(recipe: Recipe, model, max_length: int | None = None) -> int:
    """The longest prompt to test: `max_length`, else the recipe's max_seq_len capped by the model's positions."""
    if max_length is not None:
        return max_length
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None) or recipe.data.max_seq_len
    return min(recipe.data.max_seq_len, positions)


def build_examples(
    task: str,
    tokenizer,
    context: int,
    *,
    lengths: Sequence[int] | None = None,
    depths: Sequence[float] | None = None,
    samples: int | None = None,
    seed: int = 1234,
    max_new_tokens: int | None = None,
    haystack: Sequence[str | Path] | None = None,
    data: str | Path | None = None,
    datasets: Sequence[str] | None = None,
    limit: int | None = None,
    chat_template: bool = False,
) -> list[EvalExample]:
    if lengths:
        too_long = [n for n in lengths if n > context]
        if too_long:
            raise EvalOptionError(f"--lengths: {too_long[0]} exceeds the model's context of {context} tokens")
    if task in ("passkey", "kv"):
        from .passkey import RetrievalOptions, build_retrieval_examples, resolve_lengths

        options = RetrievalOptions(lengths=list(lengths) if lengths else None, seed=seed)
        _override(options, depths=depths and list(depths), samples=samples, max_new_tokens=max_new_tokens)
        resolve_lengths(options, context, minimum=96 if task == "passkey" else 128)
        return build_retrieval_examples(tokenizer, options, task=task)
    if task == "needle":
        from .needle import NeedleOptions, build_needle_examples
        from .passkey import default_lengths

        options = NeedleOptions(lengths=sorted(set(lengths)) if lengths else default_lengths(context), seed=seed)
        _override(options, depths=depths and list(depths), samples=samples, max_new_tokens=max_new_tokens)
        options.haystack = [Path(p) for p in haystack] if haystack else None
        return build_needle_examples(tokenizer, options)
    if task == "longbench":
        from .longbench import build_longbench_examples, read_longbench

        if data is None:
            raise EvalOptionError("--data: the longbench task needs a local LongBench-format .jsonl file or folder")
        raw = read_longbench(data, datasets=datasets, limit=limit)
        return build_longbench_examples(tokenizer, raw, context, chat_template=chat_template, max_new_tokens=max_new_tokens)
    raise EvalOptionError(f"--task: unknown task {task!r}; choose one of {', '.join(TASKS)}")


def _override(options: Any, **values: Any) -> None:
    """Set each option the caller gave; None keeps the task's default."""
    for name, value in values.items():
        if value is not None:
            setattr(options, name, value)


def summarize(task: str, records: Sequence[Scored]) -> dict[str, Any]:
    if task == "longbench":
        from .longbench import longbench_summary

        return longbench_summary(records)
    from .report import retrieval_summary

    return retrieval_summary(records)


def evaluate(
    recipe: Recipe,
    task: str,
    checkpoint: str | Path | None = None,
    attention: Attention = "dense",
    out_dir: str | Path | None = None,
    *,
    lengths: Sequence[int] | None = None,
    depths: Sequence[float] | None = None,
    samples: int | None = None,
    seed: int = 1234,
    batch_size: int = 8,
    max_new_tokens: int | None = None,
    max_length: int | None = None,
    budget: float | None = None,
    haystack: Sequence[str | Path] | None = None,
    data: str | Path | None = None,
    datasets: Sequence[str] | None = None,
    limit: int | None = None,
    chat_template: bool = False,
    answer_nll: bool = False,
    show_progress: bool = True,
    loaded: tuple[Any, Any, Any] | None = None,
) -> dict[str, Any]:
    """Run `task` and return its result; rank 0 writes `<task>_<attention>.json` (+ predictions, heatmap) to `out_dir`.

    `answer_nll` (passkey, kv, needle) adds the teacher-forced NLL of the answer, a graded measure.
    `loaded` = (model, tokenizer, controller) skips loading (the study reuses one model for several tasks).
    """
    if task not in TASKS:
        raise EvalOptionError(f"--task: unknown task {task!r}; choose one of {', '.join(TASKS)}")
    if attention not in ("dense", "sparse"):
        raise EvalOptionError(f"--attention: expected dense or sparse, got {attention!r}")
    if task == "longbench":
        from .errors import EvalDataError

        if data is None:
            raise EvalOptionError("--data: the longbench task needs a local LongBench-format .jsonl file or folder")
        if not Path(data).exists():
            raise EvalDataError(f"{data}: LongBench data not found (give a .jsonl file or a folder of them)")
    started = time.perf_counter()
    model, tokenizer, controller = loaded or load_for_eval(recipe, checkpoint, attention, budget)
    context = context_length(recipe, model, max_length)
    examples = build_examples(
        task,
        tokenizer,
        context,
        lengths=lengths,
        depths=depths,
        samples=samples,
        seed=seed,
        max_new_tokens=max_new_tokens,
        haystack=haystack,
        data=data,
        datasets=datasets,
        limit=limit,
        chat_template=chat_template,
    )
    recorder = AttentionRecorder(controller)
    if controller is not None:
        controller.pop_report()  # drop anything recorded before evaluation started
    records = run_examples(
        model,
        tokenizer,
        examples,
        batch_size=batch_size,
        allow_padding=controller is None,
        recorder=recorder,
        description=f"{task} ({attention})",
        show_progress=show_progress,
        with_nll=answer_nll,
    )
    rank, world = rank_and_world()
    result: dict[str, Any] = {
        "task": task,
        "attention": attention,
        "budget": (recipe.sparsity.budget if budget is None else budget) if attention == "sparse" else None,
        "checkpoint": str(checkpoint) if checkpoint is not None else None,
        "model": recipe.model.path,
        "recipe_fingerprint": recipe.fingerprint(),
        "context": context,
        "world_size": world,
        **summarize(task, records),
        **recorder.summary(),
        "elapsed_s": time.perf_counter() - started,
    }
    if out_dir is not None and rank == 0:
        result["files"] = write_outputs(result, records, Path(out_dir))
    return result


def write_outputs(result: dict[str, Any], records: Sequence[Scored], out_dir: Path) -> dict[str, str]:
    """`<task>_<attention>.json`, `<task>_<attention>_predictions.jsonl` and, for grids, a heatmap PNG."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{result['task']}_{result['attention']}"
    files = {"result": str(out_dir / f"{stem}.json"), "predictions": str(out_dir / f"{stem}_predictions.jsonl")}
    with open(files["predictions"], "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record.to_json(), ensure_ascii=False) + "\n")
    if "grid" in result:
        from .report import heatmap

        title = f"{result['task']} accuracy ({result['attention']} attention)"
        files["heatmap"] = str(heatmap(result["grid"], out_dir / f"{stem}_heatmap.png", title))
    Path(files["result"]).write_text(json.dumps({**result, "files": files}, indent=2) + "\n")
    return files
