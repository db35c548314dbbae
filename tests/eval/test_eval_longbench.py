"""LongBench-format reader, prompts, scoring and its one-line errors."""
from __future__ import annotations

import json

import pytest

from sparsebalance_ft.errors import UserError
from sparsebalance_ft.eval.engine import Scored
from sparsebalance_ft.eval.errors import EvalDataError
from sparsebalance_ft.eval.longbench import (
    build_longbench_examples,
    length_bucket,
    longbench_summary,
    read_longbench,
    task_of,
    truncate_middle,
)


def _row(dataset: str, i: int, **extra) -> dict:
    row = {
        "input": f"What is item {i}?",
        "context": f"Item {i} is a red apple. " * 20,
        "answers": [f"red apple {i}"],
        "length": 150 + 1000 * i,
        "dataset": dataset,
        "language": "en",
        "all_classes": None,
        "_id": f"{dataset}-{i}",
    }
    row.update(extra)
    return row


def write_sample(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


@pytest.fixture
def sample_dir(tmp_path):
    folder = tmp_path / "longbench"
    folder.mkdir()
    write_sample(folder / "hotpotqa.jsonl", [_row("hotpotqa", i) for i in range(3)])
    write_sample(
        folder / "trec.jsonl",
        [_row("trec", 0, answers=["LOC"], all_classes=["LOC", "NUM", "HUM"])],
    )
    write_sample(folder / "gov_report_e.jsonl", [_row("gov_report_e", 9)])
    return folder


def test_reader_folder_filter_and_limit(sample_dir):
    examples = read_longbench(sample_dir)
    assert [e.dataset for e in examples] == ["gov_report_e", "hotpotqa", "hotpotqa", "hotpotqa", "trec"]
    assert examples[1].answers == ["red apple 0"] and examples[1].length == 150
    assert examples[1].source.endswith("hotpotqa.jsonl:1")
    assert examples[-1].all_classes == ["LOC", "NUM", "HUM"]
    assert len(read_longbench(sample_dir, limit=2)) == 4
    only = read_longbench(sample_dir / "hotpotqa.jsonl", datasets=["hotpotqa"])
    assert len(only) == 3


def test_task_families():
    assert task_of("hotpotqa")[:2] == ("multi_doc_qa", "qa_f1")
    assert task_of("gov_report_e")[:2] == ("summarization", "rouge_l")
    assert task_of("lcc")[:2] == ("code", "code_sim")
    assert task_of("passage_retrieval_en")[1] == "retrieval"
    assert task_of("my_own_qa") == ("single_doc_qa", "qa_f1", 64, False)


def test_missing_path(tmp_path):
    with pytest.raises(UserError, match="not found") as info:
        read_longbench(tmp_path / "absent.jsonl")
    assert str(tmp_path / "absent.jsonl") in str(info.value)
    with pytest.raises(EvalDataError, match="no .jsonl files"):
        read_longbench(tmp_path)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({k: v for k, v in _row("qasper", 1).items() if k != "answers"}), "missing field 'answers'"),
        (json.dumps(_row("qasper", 1, length="long")), "field 'length' must be a number"),
        (json.dumps(_row("qasper", 1, answers="x")), "field 'answers' must be a list"),
        (json.dumps(_row("qasper", 1, answers=[])), "non-empty list of strings"),
        (json.dumps(_row("qasper", 1, all_classes="x")), "all_classes"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_row("qasper", 0)) + "\n\n" + line + "\n", encoding="utf-8")
    with pytest.raises(EvalDataError) as info:
        read_longbench(path)
    text = str(info.value)
    assert text.startswith(f"{path}:3: ")
    assert message in text
    assert "\n" not in text


def test_truncate_middle_and_buckets():
    assert truncate_middle(list(range(10)), 6) == [0, 1, 2, 7, 8, 9]
    assert truncate_middle([1, 2], 6) == [1, 2]
    assert [length_bucket(x) for x in (10, 4000, 9000)] == ["0-4k", "4-8k", "8k+"]


def test_build_examples(sample_dir, tiny_tokenizer):
    raw = read_longbench(sample_dir)
    built = build_longbench_examples(tiny_tokenizer, raw, context_tokens=100)
    by_dataset = {b.meta["dataset"]: b for b in built}
    assert by_dataset["trec"].postprocess == "first_line"
    assert by_dataset["trec"].metric == "classification"
    assert by_dataset["gov_report_e"].metric == "rouge_l"
    for b in built:
        assert len(b.input_ids) + b.max_new_tokens <= 100
    assert by_dataset["gov_report_e"].max_new_tokens == 50  # 512 capped at half the context
    long = build_longbench_examples(tiny_tokenizer, raw, context_tokens=10_000)
    text = tiny_tokenizer.decode(long[1].input_ids)
    assert "What is item 0?" in text and "Item 0 is a red apple." in text


def test_summary_per_dataset():
    def scored(dataset, score, length=100):
        meta = {"dataset": dataset, "family": "f", "metric": "qa_f1", "length": length, "length_bucket": length_bucket(length)}
        return Scored(id="x", prediction="", score=score, answers=["a"], meta=meta)

    summary = longbench_summary([scored("a", 1.0), scored("a", 0.0, 5000), scored("b", 0.5)])
    assert summary["datasets"]["a"]["score"] == pytest.approx(50.0)
    assert summary["datasets"]["a"]["by_length"] == {"0-4k": 100.0, "4-8k": 0.0}
    assert summary["datasets"]["b"]["score"] == pytest.approx(50.0)
    assert summary["average"] == pytest.approx(50.0)
