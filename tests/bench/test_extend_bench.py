"""`sbft bench extend`: loss by position equals the plain forward's cross-entropy, the held-out text is never
trained on, and the quick plan runs every section on the tiny model into extend.json and its figures."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sparsebalance_ft.bench.extend import ExtendPlan, loss_by_position, run_extend_bench
from sparsebalance_ft.bench.extend_data import HELDOUT_GLOB, TRAIN_GLOB, long_texts, source_files, write_training_jsonl

RECIPE = Path(__file__).parents[2] / "recipes" / "extend-smollm2.yaml"


def test_loss_by_position_is_the_forwards_cross_entropy_per_bucket(tiny_model):
    ids = list(range(7, 7 + 300))
    result = loss_by_position(tiny_model, [ids], bucket=128, device="cpu")
    with torch.no_grad():
        logits = tiny_model(input_ids=torch.tensor([ids])).logits[0, :-1]
    per_token = F.cross_entropy(logits.float(), torch.tensor(ids[1:]), reduction="none")
    assert list(result["by_position"]) == ["0-128", "128-256", "256-300"]
    # position t predicts token t + 1: bucket 0-128 holds the predictions made at positions 0..126 and 127
    expected = [per_token[0:127].mean(), per_token[127:255].mean(), per_token[255:].mean()]
    assert list(result["by_position"].values()) == pytest.approx([float(x) for x in expected], rel=1e-5)
    assert result["second_half"] == pytest.approx(float(per_token[149:].mean()), rel=1e-5)


def test_training_and_heldout_documents_come_from_different_files(tiny_tokenizer, tmp_path):
    train_files = set(source_files(TRAIN_GLOB))
    heldout_files = set(source_files(HELDOUT_GLOB))
    assert heldout_files and not train_files & heldout_files
    heldout = long_texts(tiny_tokenizer, HELDOUT_GLOB, 2048, 1)[0]
    written = write_training_jsonl(tiny_tokenizer, 2048, 3, tmp_path / "train.jsonl")
    texts = [json.loads(line)["text"] for line in written.read_text().splitlines()]
    assert len(texts) == 3 and all(len(tiny_tokenizer(t)["input_ids"]) >= 2048 for t in texts)
    first_heldout_file = sorted(heldout_files)[0].read_text()
    assert first_heldout_file in heldout and not any(first_heldout_file in t for t in texts)


@pytest.mark.slow
def test_the_quick_plan_writes_every_section(tmp_path):
    out = tmp_path / "out"
    result = run_extend_bench(
        RECIPE, out, tmp_path / "work",
        ["before", "finetune", "after"], ExtendPlan.make_quick(), say=lambda line: None)
    saved = json.loads((out / "extend.json").read_text())
    assert set(saved["before"]["untrained"]) == {"native", "linear", "dynamic", "yarn"}
    assert list(saved["before"]["untrained"]["yarn"]["loss"]["512"]["by_position"]) == ["0-128", "128-256", "256-384", "384-512"]
    for arm in ("dense", "sparse"):
        assert saved["finetune"]["arms"][arm]["steps"] == 2 and saved["finetune"]["arms"][arm]["tokens_per_s"] > 0
        assert saved["after"][arm]["passkey"]["lengths"]["512"]["total"] == 1
    for key in ("finetuned_loss_16k", "best_untrained_loss_16k", "dense_arm_loss_16k", "sparse_arm_loss_16k",
                "dense_arm_wall_s", "sparse_arm_wall_s", "sparse_over_dense_wall"):
        assert key in saved["summary"], key
    assert set(saved["summary"]["targets"]) >= {"finetuned_below_best_untrained", "sparse_loss_within_1pct", "sparse_faster"}
    assert (out / "loss_by_position.png").is_file() and (out / "loss_vs_wall.png").is_file()
    assert result["summary"] == saved["summary"]
