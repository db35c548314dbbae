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

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setitem(real._RUNNERS, "selection", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_real_bench(tiny_model_dir, out, ["selection"], _plan(), tmp_path / "work", say=lambda line: None)
    assert json.loads((out / "real.json").read_text()) == first


def test_selection_curves_meet_dense_at_full_budget(tiny_model_dir):
    """Budget 1.0 keeps every block: exact recall 1 and the dense loss; a lower budget keeps fewer blocks,
    holds less of the exact mass and its points come sorted by budget for `flat_steps`."""
    import inspect

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sparsebalance_ft.attention.config import SparsityConfig
    from sparsebalance_ft.bench.real_selection import flat_steps, selection_curves

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = inspect.getsource(json)
    section = selection_curves(model, tokenizer, texts={"code": text}, lengths=[512], budgets=[0.2, 1.0],
                               rules=["mass"], config=SparsityConfig(k_min=1, recall_samples=2))
    low, full = section["curves"]["mass"]["code"]["512"]
    assert full["density"] == 1.0 and full["exact_recall"] == pytest.approx(1.0, abs=1e-5)
    assert full["loss"] == pytest.approx(section["dense_loss"]["code/512"], rel=1e-5)
    assert low["density"] < 1.0 and low["exact_recall"] < 1.0
    assert flat_steps([{"budget": b, "density": d} for b, d in [(0.1, 0.2), (0.2, 0.2), (0.3, 0.201), (0.4, 0.5)]]) \
        == [[0.1, 0.3]]


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
