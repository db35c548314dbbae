"""`sbft bench real` orchestration: sections written into one real.json, kept across partial runs."""
import json

import pytest

from sparsebalance_ft.bench import real
from sparsebalance_ft.bench.real import RealPlan, run_real_bench
from sparsebalance_ft.errors import UserError


def _plan():
    return RealPlan(density_docs_per_kind=1, density_min_tokens=64, density_max_tokens=256)


def test_densities_then_a_failing_section_keeps_both(tmp_path, tiny_model_dir, monkeypatch):
    out = tmp_path / "out"
    run_real_bench(tiny_model_dir, out, ["densities"], _plan(), tmp_path / "work", say=lambda line: None)
    first = json.loads((out / "real.json").read_text())
    assert len(first["densities"]["documents"]) == 3 and first["densities"]["elapsed_s"] > 0

    def missing(*args):
        raise ImportError("no module named real_selection")

    monkeypatch.setitem(real._RUNNERS, "selection", missing)
    run_real_bench(tiny_model_dir, out, ["selection"], _plan(), tmp_path / "work", say=lambda line: None)
    second = json.loads((out / "real.json").read_text())
    assert second["densities"] == first["densities"]
    assert second["selection"]["error"].startswith("not run: no module named real_selection")


def test_unknown_section_and_missing_model_are_one_line(tmp_path, tiny_model_dir):
    with pytest.raises(UserError, match="--sections: unknown speed"):
        run_real_bench(tiny_model_dir, tmp_path, ["speed"], _plan(), tmp_path, say=lambda line: None)
    with pytest.raises(UserError, match="sbft init-model smollm2"):
        run_real_bench(tmp_path / "nothing", tmp_path, ["densities"], _plan(), tmp_path, say=lambda line: None)


@pytest.mark.slow
def test_finetune_section_trains_every_arm_from_one_init(tmp_path, tiny_model_dir):
    from sparsebalance_ft.bench.real_finetune import FinetunePlan, finetune_section

    plan = FinetunePlan(nproc=1, steps=1, tokens=128, heldout_docs=1, passkey_lengths=[256], passkey_depths=[0.5],
                        passkey_samples=1)
    section = finetune_section(tiny_model_dir, tmp_path / "ft", plan)
    assert [a["arm"] for a in section["arms"]] == ["dense", "sparse-fixed", "sparsebalance"]
    for arm in section["arms"]:
        assert arm["train"]["steps"] == 1 and arm["train"]["mean_step_time"] > 0
        assert arm["heldout_loss"]["dense"] > 0 and arm["passkey"]["accuracy"] is not None
        # one step of LoRA moved every arm away from the shared initialisation
        assert arm["heldout_loss"]["dense"] != section["heldout_before"]["dense"]
