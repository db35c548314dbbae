"""The accuracy study's plumbing with a stand-in trainer (the real one is the training loop)."""
from __future__ import annotations

import json

import pytest

from sparsebalance_ft.eval.study import DEFAULT_ARMS, StudyPlan, arm_recipe, prepare_study, run_accuracy_study, study_table


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    plan = StudyPlan.quick()
    return root, plan, prepare_study(root, plan)


def test_study_runs_arms_and_writes_table(study):
    tmp_path, plan, base = study
    assert base.training.max_steps == plan.max_steps
    lines = (tmp_path / "train_passkey.jsonl").read_text().splitlines()
    assert len(lines) == plan.train_records and "text" in json.loads(lines[0])

    seen = []

    def fake_trainer(recipe):
        """Saves the recipe's fresh adapter (no training) and a metrics file like the loop's."""
        from pathlib import Path

        from sparsebalance_ft.train.model import load_model

        seen.append(recipe)
        out = Path(recipe.training.output_dir)
        model, tokenizer = load_model(recipe.model_copy(update={"model": recipe.model.model_copy(update={"attn_implementation": "sdpa"})}))
        model.save_pretrained(out / "adapter")
        step = {"step": 1, "loss": 3.0, "step_time": 0.5, "bubble": 0.1, "imbalance": 1.1,
                "ranks": [{"budget": 0.5, "density": 0.4, "recall": 0.9}, {"budget": 0.7, "density": 0.6, "recall": None}]}
        (out / "metrics.jsonl").write_text(json.dumps(step) + "\n")
        return {"adapter_dir": str(out / "adapter"), "steps": 1}

    arms = DEFAULT_ARMS[:2]
    result = run_accuracy_study(base, arms, fake_trainer, tmp_path, plan=plan, show_progress=False)
    assert [r.model.attn_implementation for r in seen] == ["sdpa", "sparsebalance"]
    assert len({r.training.seed for r in seen}) == 1 and len({r.data.path for r in seen}) == 1
    dense = result["arms"][0]
    assert dense["train"]["mean_budget"] == 0.6 and dense["train"]["mean_recall"] == 0.9
    assert set(dense["eval"]["dense"]["by_length"]) == {"128", "256"}
    table = (tmp_path / "accuracy_study.md").read_text()
    assert table.startswith("| arm | eval attention | passkey@128 | passkey@256 |")
    assert "sparse-fixed" in table
    assert study_table(json.loads((tmp_path / "accuracy_study.json").read_text())) == table.strip()


def test_arm_recipe_only_changes_overrides(study, tmp_path):
    _, _, base = study
    arm = arm_recipe(base, "sparsebalance", DEFAULT_ARMS[2][1], tmp_path / "runs")
    assert arm.balance.tuning == "bidirectional" and arm.balance.batching == "sparsebalance"
    assert arm.training.output_dir == str(tmp_path / "runs" / "sparsebalance")
    assert arm.model.path == base.model.path and arm.training.max_steps == base.training.max_steps
