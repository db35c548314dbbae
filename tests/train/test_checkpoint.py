"""Checkpoints: ordered and pruned by step number, verified file by file, peft's adapter state, per-rank visibility."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from sparsebalance_ft.train.checkpoint import (
    COMPLETE_MARKER,
    CheckpointError,
    _manifest,
    _prune,
    checkpoint_dirs,
    checkpoint_problem,
    choose_checkpoint,
    load_checkpoint,
    restore_trainable,
    trainable_state,
)


def _fake_checkpoint(root, step: int, files=("optimizer.bin", "random_states_0.pkl")):
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    for name in files:
        (path / name).write_bytes(bytes(range(200)))
    (path / COMPLETE_MARKER).write_text(json.dumps({"step": step, "files": _manifest(path)}))
    return path


def test_checkpoints_sort_and_prune_by_step_number(tmp_path):
    for step in (9, 10, 29, 30):
        _fake_checkpoint(tmp_path, step)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["checkpoint-9", "checkpoint-10", "checkpoint-29", "checkpoint-30"]
    _prune(tmp_path, step=10, keep=1)  # a run at step 10 beside an older run's 29 and 30
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["checkpoint-10", "checkpoint-29", "checkpoint-30"]


def test_a_truncated_file_is_named_and_the_newest_intact_checkpoint_used(tmp_path):
    _fake_checkpoint(tmp_path, 2)
    newest = _fake_checkpoint(tmp_path, 4)
    rng = newest / "random_states_0.pkl"
    rng.write_bytes(rng.read_bytes()[:50])
    assert checkpoint_problem(newest) == f"{rng} is truncated (50 of 200 bytes)"
    with pytest.warns(UserWarning) as caught:
        assert choose_checkpoint(tmp_path).name == "checkpoint-2"
    assert [str(w.message) for w in caught] == [
        f"skipping a damaged checkpoint: {rng} is truncated (50 of 200 bytes)",
        "resuming from checkpoint-2, the newest intact checkpoint",
    ]
    with pytest.raises(CheckpointError, match=f"--resume: {rng} is truncated"):
        choose_checkpoint(tmp_path, newest)  # a checkpoint the user chose is never swapped silently
    (tmp_path / "checkpoint-2" / "optimizer.bin").unlink()
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="no intact checkpoint"):
        choose_checkpoint(tmp_path)


def test_a_rank_that_cannot_see_the_checkpoint_says_so(tmp_path):
    accelerator = SimpleNamespace(process_index=1)
    with pytest.raises(CheckpointError, match="rank 1 cannot see .*checkpoint-3: checkpoints need a filesystem that every rank shares"):
        load_checkpoint(accelerator, None, tmp_path / "checkpoint-3")


def _lora_model(tiny_model_dir, seed: int):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"], task_type="CAUSAL_LM")
    return get_peft_model(base, config)


def test_trainable_state_round_trips_lora_and_modules_to_save(tiny_model_dir, tmp_path):
    trained = _lora_model(tiny_model_dir, seed=1)
    with torch.no_grad():
        for p in trained.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))  # what training does: every trainable tensor moves
    state = trainable_state(trained)
    assert any("lm_head" in name for name in state) and any("lora_A" in name for name in state)
    torch.save(state, tmp_path / "weights.pt")

    fresh = _lora_model(tiny_model_dir, seed=2)
    restore_trainable(fresh, tmp_path / "weights.pt")
    mine = {n: p for n, p in fresh.named_parameters() if p.requires_grad}
    theirs = {n: p for n, p in trained.named_parameters() if p.requires_grad}
    assert mine.keys() == theirs.keys()
    for name in mine:
        torch.testing.assert_close(mine[name], theirs[name], rtol=0, atol=0)


def test_weights_the_model_lacks_are_refused(tiny_model_dir, tmp_path):
    state = trainable_state(_lora_model(tiny_model_dir, seed=1))
    state["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"] = torch.zeros(4, 128)
    torch.save(state, tmp_path / "weights.pt")
    with pytest.raises(CheckpointError, match="holds weights the recipe's model lacks"):
        restore_trainable(_lora_model(tiny_model_dir, seed=2), tmp_path / "weights.pt")
