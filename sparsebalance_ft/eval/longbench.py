"""LongBench-format tasks read from local JSONL files (no download).

Each line is one example with at least `context` (str), `input` (str), `answers` (list of str),
`length` (number) and `dataset` (str); `all_classes` (list or null) and `_id` are optional.
A path is one `.jsonl` file or a folder of them. The dataset name picks the task family and
its metric (QA F1, ROUGE-L, classification, retrieval, count, code edit similarity); a
LongBench-E name (`hotpotqa_e`) scores like its base dataset, and an unknown one is scored with
QA F1 (the result says so). Prompts longer than the context limit lose their middle tokens.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..data.sources import DataError, jsonl_rows
from .engine import EvalExample, Scored
from .errors import EvalDataError
from .passkey import encode
from .report import mean

REQUIRED_FIELDS = {"context": str, "input": str, "answers": list, "length": (int, float), "dataset": str}

# dataset -> (family, metric, max new tokens); families choose the prompt.
DATASETS: dict[str, tuple[str, str, int]] = {
    "narrativeqa": ("single_doc_qa", "qa_f1", 128),
    "qasper": ("single_doc_qa", "qa_f1", 128),
    "multifieldqa_en": ("single_doc_qa", "qa_f1", 64),
    "multifieldqa_zh": ("single_doc_qa", "qa_f1_zh", 64),
    "hotpotqa": ("multi_doc_qa", "qa_f1", 32),
    "2wikimqa": ("multi_doc_qa", "qa_f1", 32),
    "musique": ("multi_doc_qa", "qa_f1", 32),
    "dureader": ("multi_doc_qa", "rouge_l_zh", 128),
    "gov_report": ("summarization", "rouge_l", 512),
    "qmsum": ("summarization", "rouge_l", 512),
    "multi_news": ("summarization", "rouge_l", 512),
    "vcsum": ("summarization", "rouge_l_zh", 512),
    "trec": ("few_shot", "classification", 64),
    "triviaqa": ("few_shot", "qa_f1", 32),
    "samsum": ("few_shot", "rouge_l", 128),
    "lsht": ("few_shot", "classification", 64),
    "passage_count": ("synthetic", "count", 32),
    "passage_retrieval_en": ("synthetic", "retrieval", 32),
    "passage_retrieval_zh": ("synthetic", "retrieval_zh", 32),
    "lcc": ("code", "code_sim", 64),
    "repobench-p": ("code", "code_sim", 64),
    # Our synthetic tasks written in LongBench format score by exact retrieval.
    "passkey": ("synthetic", "retrieval_exact", 12),
    "kv": ("synthetic", "retrieval_exact", 16),
}
DEFAULT_TASK = ("single_doc_qa", "qa_f1", 64)

PROMPTS: dict[str, str] = {
    "single_doc_qa": (
        "Read the text below and answer the question as briefly as you can.\n\n{context}\n\n"
        "Question: {input}\nAnswer:"
    ),
    "multi_doc_qa": (
        "Answer the question from the passages below. Give only the answer, no other words.\n\n{context}\n\n"
        "Question: {input}\nAnswer:"
    ),
    "summarization": "Summarise the text below.\n\n{context}\n\n{input}\nSummary:",
    "few_shot": "{context}\n\n{input}",
    "synthetic": "{context}\n\n{input}\nAnswer:",
    "code": "Complete the next line of the code below.\n{context}{input}",
}
FIRST_LINE_DATASETS = {"trec", "triviaqa", "samsum", "lsht"}
LENGTH_BUCKETS = ((0, 4000, "0-4k"), (4000, 8000, "4-8k"), (8000, float("inf"), "8k+"))


@dataclass
class LongBenchExample:
    id: str
    dataset: str
    context: str
    input: str
    answers: list[str]
    length: float
    all_classes: list[str] | None
    source: str  # "file:line"


def task_of(dataset: str) -> tuple[str, str, int, bool]:
    """(family, metric, max new tokens, known) for a dataset name; `_e` suffixes score like the base."""
    base = dataset[:-2] if dataset.endswith("_e") else dataset
    if base in DATASETS:
        return (*DATASETS[base], True)
    return (*DEFAULT_TASK, False)


def _files(path: Path) -> list[Path]:
    if not path.exists():
        raise EvalDataError(f"{path}: LongBench data not found (give a .jsonl file or a folder of them)")
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.jsonl"))
    if not files:
        raise EvalDataError(f"{path}: no .jsonl files in this folder")
    return files


def read_longbench(path: str | Path, datasets: Sequence[str] | None = None, limit: int | None = None) -> list[LongBenchExample]:
    """Read and validate LongBench-format JSONL; `datasets` keeps only those names, `limit` caps each dataset."""
    wanted = set(datasets) if datasets else None
    per_dataset: dict[str, int] = defaultdict(int)
    examples: list[LongBenchExample] = []
    for file in _files(Path(path)):
        try:
            for data, where in jsonl_rows(file):
                example = _parse_row(data, file, where)
                if wanted is not None and example.dataset not in wanted:
                    continue
                if limit is not None and per_dataset[example.dataset] >= limit:
                    continue
                per_dataset[example.dataset] += 1
                examples.append(example)
        except DataError as error:
            raise EvalDataError(str(error)) from None
    if not examples:
        which = f" of datasets {', '.join(sorted(wanted))}" if wanted else ""
        raise EvalDataError(f"{path}: no examples{which}")
    return examples


def _parse_row(data: dict, file: Path, where: str) -> LongBenchExample:
    for name, kind in REQUIRED_FIELDS.items():
        if name not in data:
            raise EvalDataError(f"{where}: missing field '{name}'")
        if not isinstance(data[name], kind) or isinstance(data[name], bool):
            expected = "number" if name == "length" else kind.__name__  # type: ignore[union-attr]
            raise EvalDataError(f"{where}: field '{name}' must be a {expected}, got {type(data[name]).__name__}")
    answers = data["answers"]
    if not answers or not all(isinstance(a, str) for a in answers):
        raise EvalDataError(f"{where}: field 'answers' must be a non-empty list of strings")
    classes = data.get("all_classes")
    if classes is not None and (not isinstance(classes, list) or not all(isinstance(c, str) for c in classes)):
        raise EvalDataError(f"{where}: field 'all_classes' must be a list of strings or null")
    return LongBenchExample(
        id=str(data.get("_id") or f"{file.stem}-{where.rpartition(':')[2]}"),  # else file and line
        dataset=data["dataset"],
        context=data["context"],
        input=data["input"],
        answers=list(answers),
        length=float(data["length"]),
        all_classes=classes,
        source=where,
    )


def length_bucket(length: float) -> str:
    for low, high, name in LENGTH_BUCKETS:
        if low <= length < high:
            return name
    return LENGTH_BUCKETS[-1][2]


def truncate_middle(ids: list[int], limit: int, keep_prefix: int = 0) -> list[int]:
    """At most `limit` ids: the first half and the last half kept, the middle dropped."""
    if len(ids) <= limit:
        return ids
    head = max(limit // 2, keep_prefix)
    return ids[:head] + ids[len(ids) - (limit - head) :]


def build_longbench_examples(
    tokenizer,
    examples: Sequence[LongBenchExample],
    context_tokens: int,
    chat_template: bool = False,
    max_new_tokens: int | None = None,
) -> list[EvalExample]:
    """Prompts per family, middle-truncated so that prompt and answer fit `context_tokens`."""
    built = []
    for ex in examples:
        family, metric, budget, known = task_of(ex.dataset)
        prompt = PROMPTS[family].format(context=ex.context, input=ex.input)
        if chat_template and getattr(tokenizer, "chat_template", None):
            ids = list(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
                )["input_ids"]
            )
        else:
            ids = encode(tokenizer, prompt)
        # The answer budget never takes more than half the context (small models, long summaries).
        budget = min(max_new_tokens or budget, max(context_tokens // 2, 1))
        ids = truncate_middle(ids, max(context_tokens - budget, 1))
        base = ex.dataset[:-2] if ex.dataset.endswith("_e") else ex.dataset
        built.append(
            EvalExample(
                id=ex.id,
                input_ids=ids,
                answers=ex.answers,
                metric=metric,
                max_new_tokens=budget,
                all_classes=ex.all_classes,
                postprocess="first_line" if base in FIRST_LINE_DATASETS else None,
                meta={
                    "dataset": ex.dataset,
                    "family": family,
                    "metric": metric if known else f"{metric} (default: unknown dataset)",
                    "length": ex.length,
                    "length_bucket": length_bucket(ex.length),
                    "prompt_tokens": len(ids),
                    "source": ex.source,
                },
            )
        )
    return built


def longbench_summary(records: Sequence[Scored]) -> dict[str, Any]:
    """Scores x100 per dataset (and per length bucket), per family, and the mean over datasets."""
    by_dataset: dict[str, list[Scored]] = defaultdict(list)
    for record in records:
        by_dataset[record.meta["dataset"]].append(record)
    datasets = {}
    families: dict[str, list[float]] = defaultdict(list)
    for name in sorted(by_dataset):
        items = by_dataset[name]
        buckets: dict[str, list[float]] = defaultdict(list)
        for item in items:
            buckets[item.meta["length_bucket"]].append(item.score)
        score = 100 * mean([i.score for i in items])
        datasets[name] = {
            "score": score,
            "n": len(items),
            "metric": items[0].meta["metric"],
            "family": items[0].meta["family"],
            "by_length": {b: 100 * mean(v) for b, v in sorted(buckets.items())},
        }
        families[items[0].meta["family"]].append(score)
    return {
        "average": mean([d["score"] for d in datasets.values()]),
        "n": len(records),
        "datasets": datasets,
        "families": {f: mean(v) for f, v in sorted(families.items())},
    }
