"""Passkey and needle prompt builders put the answer where they say; grids and heatmaps aggregate."""
from __future__ import annotations

import pytest

from sparsebalance_ft.eval.engine import Scored, plan_batches
from sparsebalance_ft.eval.errors import EvalDataError, EvalOptionError
from sparsebalance_ft.eval.needle import NEEDLE, NeedleOptions, build_needle_examples, load_haystack, nearest_boundary
from sparsebalance_ft.eval.passkey import RetrievalOptions, build_retrieval_examples, default_lengths, resolve_lengths
from sparsebalance_ft.eval.report import grid, heatmap, retrieval_summary


def test_needle_examples_exact_length_and_position(tiny_tokenizer, text_corpus_dir):
    options = NeedleOptions(lengths=[256, 512], depths=[0.0, 0.3, 0.5, 1.0], samples=2, haystack=[text_corpus_dir])
    examples = build_needle_examples(tiny_tokenizer, options)
    assert len(examples) == 2 * 4 * 2
    numbers = set()
    for ex in examples:
        meta = ex.meta
        assert len(ex.input_ids) == meta["length"] == meta["prompt_tokens"]
        needle_text = tiny_tokenizer.decode(ex.input_ids[meta["needle_token_start"] : meta["needle_token_end"]])
        assert needle_text.strip() == NEEDLE.format(number=ex.answers[0])
        assert tiny_tokenizer.decode(ex.input_ids).count(ex.answers[0]) == 1
        assert abs(meta["actual_depth"] - meta["depth"]) < 0.2
        if meta["depth"] == 0.0:
            assert meta["needle_token_start"] == 0
        numbers.add(ex.answers[0])
    assert len(numbers) == len(examples)
    last = [ex for ex in examples if ex.meta["depth"] == 1.0][0]
    question_start = last.meta["needle_token_end"]
    assert "What is the special magic number" in tiny_tokenizer.decode(last.input_ids[question_start:])
    assert "." not in tiny_tokenizer.decode(last.input_ids[question_start:]).split("Question")[0]


def test_nearest_boundary():
    window = [5, 1, 5, 5, 5, 1, 5, 5]  # token 1 ends a sentence
    assert nearest_boundary(window, 4, {1}) == 2  # 2 and 6 are as near; the earlier one wins
    assert nearest_boundary(window, 5, {1}) == 6
    assert nearest_boundary(window, 0, {1}) == 0
    assert nearest_boundary(window, 8, {1}) == 8
    assert nearest_boundary([5] * 10, 4, {1}) == 0


def test_haystack_errors(tmp_path):
    with pytest.raises(EvalDataError, match="haystack path not found"):
        load_haystack([tmp_path / "missing"], 1000)
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(EvalDataError, match="no readable"):
        load_haystack([tmp_path], 1000)
    (tmp_path / "a.txt").write_text("Hello there. " * 10)
    assert load_haystack([tmp_path], 50) == ("Hello there. " * 10)[:50]


def test_passkey_examples_hold_the_key(tiny_tokenizer):
    options = RetrievalOptions(lengths=[128, 256], depths=[0.0, 1.0], samples=2)
    examples = build_retrieval_examples(tiny_tokenizer, options)
    assert len(examples) == 8
    for ex in examples:
        assert len(ex.input_ids) <= ex.meta["length"]
        assert len(ex.input_ids) >= ex.meta["length"] - 12
        text = tiny_tokenizer.decode(ex.input_ids)
        assert f"The pass key is {ex.answers[0]}." in text
        assert text.endswith("The pass key is")
    kv = build_retrieval_examples(tiny_tokenizer, RetrievalOptions(lengths=[200], depths=[0.5], samples=1), task="kv")
    assert kv[0].answers[0] in tiny_tokenizer.decode(kv[0].input_ids)


def test_default_and_bad_lengths():
    assert default_lengths(4096) == [256, 512, 1024, 2048, 4096]
    assert default_lengths(1000) == [500, 1000]  # never below 256 tokens
    with pytest.raises(EvalOptionError, match="too short"):
        resolve_lengths(RetrievalOptions(lengths=[50]), 1024)


def test_plan_batches():
    lengths = [10, 30, 30, 20, 30]
    assert plan_batches(lengths, 2, allow_padding=True) == [[1, 2], [4, 3], [0]]
    assert plan_batches(lengths, 2, allow_padding=False) == [[1, 2], [4], [3], [0]]


def _scored(length, depth, score):
    return Scored(id=f"{length}-{depth}", prediction=" 12345", score=score, answers=["12345"], meta={"length": length, "depth": depth})


def test_summary_grid_and_heatmap(tmp_path):
    records = [_scored(128, 0.0, 1.0), _scored(128, 0.0, 0.0), _scored(128, 1.0, 1.0), _scored(256, 0.0, 0.0)]
    summary = retrieval_summary(records)
    assert summary["accuracy"] == pytest.approx(0.5)
    assert summary["position_accuracy"] == 1.0
    assert summary["by_length"] == {"128": pytest.approx(2 / 3), "256": 0.0}
    assert summary["by_depth"] == {"0": pytest.approx(1 / 3), "1": 1.0}
    cells = grid(records)
    assert cells["rows"] == [0.0, 1.0] and cells["cols"] == [128, 256]
    assert cells["accuracy"] == [[0.5, 0.0], [1.0, None]]
    assert cells["count"] == [[2, 1], [1, 0]]
    png = heatmap(cells, tmp_path / "h.png", "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
