"""Batched greedy generation over token-id prompts, sharded over ranks, with attention reports.

The engine knows nothing about tasks: it takes `EvalExample`s (prompt token ids, references,
the metric that scores them and free-form metadata), generates a continuation for each, scores
it, and returns one `Scored` record per example, in the input order, on every rank.

Batching: prompts are sorted by length; with dense attention, neighbours are left-padded into
batches of `batch_size`. With sparse attention only prompts of identical length share a batch
(no padding), because block selection must not see pad tokens. Retrieval grids (passkey,
needle) have identical lengths per cell, so they batch well either way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from ..train.loss import hidden_states, split_causal_lm, token_loss
from .metrics import best_score


@dataclass
class EvalExample:
    """One prompt to complete and the references to score the completion against."""

    id: str
    input_ids: list[int]
    answers: list[str]
    metric: str
    max_new_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)
    all_classes: list[str] | None = None
    postprocess: str | None = None  # "first_line": score only the first line of the prediction
    continuation: str | None = None  # the reference answer as the prompt's continuation (for `answer_nll`)


@dataclass
class Scored:
    id: str
    prediction: str
    score: float
    answers: list[str]
    meta: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "prediction": self.prediction, "score": self.score, "answers": self.answers, **self.meta}


def rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def gather_objects(items: list[Any]) -> list[Any]:
    """Concatenate every rank's list (on every rank); the identity on one process."""
    rank, world = rank_and_world()
    if world == 1:
        return list(items)
    parts: list[Any] = [None] * world
    torch.distributed.all_gather_object(parts, items)
    return [item for part in parts for item in part]


def plan_batches(lengths: Sequence[int], batch_size: int, allow_padding: bool) -> list[list[int]]:
    """Indices grouped into batches: longest first; equal lengths only unless padding is allowed."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) >= batch_size or (not allow_padding and lengths[current[0]] != lengths[i])):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


class AttentionRecorder:
    """Collects `pop_report()` after each batch from a sparse attention controller (if any)."""

    def __init__(self, controller: Any | None):
        self.controller = controller
        self.recalls: list[float] = []
        self.densities: list[float] = []

    def collect(self) -> None:
        if self.controller is None:
            return
        report = self.controller.pop_report()
        recall = report_value(report, ("mean_recall", "recall"))
        density = report_value(report, ("mean_density", "density"))
        if recall is not None:
            self.recalls.append(recall)
        if density is not None:
            self.densities.append(density)

    def summary(self) -> dict[str, float | None]:
        recalls = gather_objects(self.recalls)
        densities = gather_objects(self.densities)
        return {
            "mean_recall": sum(recalls) / len(recalls) if recalls else None,
            "mean_density": sum(densities) / len(densities) if densities else None,
        }


def report_value(report: Any, names: Iterable[str]) -> float | None:
    """A scalar from an attention report: the first named attribute or key, averaged if a sequence."""
    if report is None:
        return None
    for name in names:
        value = report.get(name) if isinstance(report, dict) else getattr(report, name, None)
        if value is None:
            continue
        if callable(value):
            value = value()
        if isinstance(value, torch.Tensor):
            value = value.detach().float()
            value = value[~torch.isnan(value)]
            if value.numel() == 0:
                continue
            return float(value.mean())
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, (list, tuple)):
            flat = [float(v) for v in value if v is not None and not (isinstance(v, float) and math.isnan(v))]
            if not flat:
                continue
            return sum(flat) / len(flat)
        value = float(value)
        if not math.isnan(value):
            return value
    return None


def _postprocess(prediction: str, rule: str | None) -> str:
    if rule == "first_line":
        return prediction.lstrip("\n").split("\n")[0]
    return prediction


@torch.no_grad()
def generate_greedy(
    model,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int] | int,
    batch_size: int = 8,
    allow_padding: bool = True,
    on_batch: Callable[[int], None] | None = None,
) -> list[str]:
    """Greedy continuations of `prompts` (token ids), decoded without special tokens, in input order."""
    n = len(prompts)
    budgets = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_id = tokenizer.eos_token_id
    outputs: list[str] = [""] * n
    for batch in plan_batches([len(p) for p in prompts], batch_size, allow_padding):
        width = max(len(prompts[i]) for i in batch)
        ids = torch.full((len(batch), width), pad_id if pad_id is not None else 0, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            prompt = torch.as_tensor(list(prompts[i]), dtype=torch.long)
            ids[row, width - len(prompt) :] = prompt  # left padding: every prompt ends at the same column
            mask[row, width - len(prompt) :] = 1
        new_tokens = max(budgets[i] for i in batch)
        generated = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new_tokens,
            do_sample=False,
            num_beams=1,
            pad_token_id=pad_id,
            eos_token_id=eos_id,
        )
        for row, i in enumerate(batch):
            tokens = generated[row, width : width + budgets[i]].tolist()
            outputs[i] = tokenizer.decode(tokens, skip_special_tokens=True)
        if on_batch is not None:
            on_batch(len(batch))
    return outputs


@torch.no_grad()
def answer_nll(
    model,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[str],
    batch_size: int = 8,
    allow_padding: bool = True,
    on_batch: Callable[[int], None] | None = None,
) -> list[float]:
    """Mean negative log-likelihood (nats per token) of each continuation after its prompt, teacher-forced.

    A graded retrieval measure: a model that does not find the answer pays about ln(alphabet) per
    answer token; one that does pays close to nothing, well before greedy decoding is exactly right.
    """
    device = next(model.parameters()).device
    parts = split_causal_lm(model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    answers = [list(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in continuations]
    full = [list(p) + a for p, a in zip(prompts, answers)]
    result = [math.nan] * len(full)
    for batch in plan_batches([len(f) for f in full], batch_size, allow_padding):
        width = max(len(full[i]) for i in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : len(full[i])] = torch.as_tensor(full[i])  # right padding: positions stay 0..n-1
            mask[row, : len(full[i])] = 1
        # the training's loss over hidden states: only the answer positions go through the LM head
        hidden = hidden_states(parts, input_ids=ids.to(device), attention_mask=mask.to(device))
        scored = [(row, i) for row, i in enumerate(batch) if answers[i]]
        if scored:
            rows = torch.cat([hidden[row, len(full[i]) - len(answers[i]) - 1 : len(full[i]) - 1] for row, i in scored])
            targets = torch.as_tensor([t for _, i in scored for t in answers[i]], device=rows.device)
            nll = token_loss(parts, rows, targets, "chunked", reduction="none")
            for (_, i), piece in zip(scored, nll.split([len(answers[i]) for _, i in scored])):
                result[i] = float(piece.mean())
        if on_batch is not None:
            on_batch(len(batch))
    return result


def run_examples(
    model,
    tokenizer,
    examples: Sequence[EvalExample],
    batch_size: int = 8,
    allow_padding: bool = True,
    recorder: AttentionRecorder | None = None,
    description: str = "eval",
    show_progress: bool = True,
    with_nll: bool = False,
) -> list[Scored]:
    """Generate and score every example; this rank takes examples rank, rank+world, ...; all ranks get all results.

    `with_nll` also records `meta["answer_nll"]` for examples that have a `continuation`.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    rank, world = rank_and_world()
    mine = list(range(rank, len(examples), world))
    local: list[tuple[int, Scored]] = []
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        disable=not show_progress or rank != 0,
        transient=False,
    )
    with progress:
        task = progress.add_task(description, total=len(mine))
        # Generate in groups by token budget so that a 512-token summary does not slow a 32-token answer.
        by_budget: dict[int, list[int]] = {}
        for i in mine:
            by_budget.setdefault(examples[i].max_new_tokens, []).append(i)
        for budget, indices in sorted(by_budget.items()):
            def step(done: int) -> None:
                if recorder is not None:
                    recorder.collect()
                progress.advance(task, done)

            predictions = generate_greedy(
                model,
                tokenizer,
                [examples[i].input_ids for i in indices],
                budget,
                batch_size=batch_size,
                allow_padding=allow_padding,
                on_batch=step,
            )
            for i, prediction in zip(indices, predictions):
                ex = examples[i]
                text = _postprocess(prediction, ex.postprocess)
                score = best_score(ex.metric, text, ex.answers, ex.all_classes)
                local.append((i, Scored(ex.id, prediction, score, ex.answers, dict(ex.meta))))
        scored_nll = [i for i in mine if with_nll and examples[i].continuation is not None]
        if scored_nll:
            nll_task = progress.add_task(f"{description} answer NLL", total=len(scored_nll))
            values = answer_nll(
                model,
                tokenizer,
                [examples[i].input_ids for i in scored_nll],
                [examples[i].continuation for i in scored_nll],  # type: ignore[misc]
                batch_size=batch_size,
                allow_padding=allow_padding,
                on_batch=lambda done: progress.advance(nll_task, done),
            )
            if recorder is not None:
                recorder.collect()
            position = {i: n for n, (i, _) in enumerate(local)}
            for i, value in zip(scored_nll, values):
                local[position[i]][1].meta["answer_nll"] = value
    gathered = gather_objects(local)
    gathered.sort(key=lambda pair: pair[0])
    return [scored for _, scored in gathered]
