"""`training.sharding: fsdp` on two real gloo processes, against the unsharded trainer as the reference:
the same losses step by step (sparse attention, layer tuning, padding micro-batches, clipping, gradient
checkpointing, modules_to_save, validation) and an adapter saved whole. Resume and refusals:
tests/faults/test_sharding_faults.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparsebalance_ft.train.metrics import read_metrics

HELPER = Path(__file__).with_name("_sharded_adapter.py")

SPARSE_LAYER_TUNED = {
    "model": {"attn_implementation": "sparsebalance", "gradient_checkpointing": True},
    "sparsity": {"k_max": 4, "k_min": 2, "block_size": 16, "recall_samples": 1},
    # target fastest: here the layer tuner moves about a quarter of the kept blocks every step
    "balance": {"batching": "length-grouped", "tuning": "layer", "lookahead_steps": 2, "target": "fastest"},
    "lora": {"modules_to_save": ["norm"]},
    # 12 documents, 2 held out: half the steps give the ranks different micro-batch counts (padding forwards)
    "data": {"max_documents": 12, "max_seq_len": 256, "eval_split": 0.15},
}


def sharding_recipe(write_recipe, out: Path, sharding: str, **training):
    return write_recipe(**SPARSE_LAYER_TUNED, training={
        "docs_per_rank": 3, "micro_batch_tokens": 256, "output_dir": str(out), "sharding": sharding, **training})


def _losses(out: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(out / "metrics.jsonl")]


def _uneven_steps(recipe_path: Path, steps: int) -> int:
    """Steps whose plan gives the two ranks different numbers of real micro-batches."""
    from transformers import AutoTokenizer

    from sparsebalance_ft.batching import BatchSampler
    from sparsebalance_ft.data import load_corpus
    from sparsebalance_ft.recipe import load_recipe
    from sparsebalance_ft.train.validation import split_for_eval

    recipe = load_recipe(recipe_path)
    corpus = load_corpus(recipe.data, AutoTokenizer.from_pretrained(recipe.model.path))
    corpus, _ = split_for_eval(corpus, recipe.data.eval_split, recipe.training.seed)
    sampler = BatchSampler(corpus.lengths, 2, "length-grouped", recipe.token_cap, 3, recipe.training.seed,
                           lookahead_steps=2)
    per_epoch = sampler.steps_per_epoch
    counts = [[sum(1 for mb in plan.micro_batches[r] if mb) for r in (0, 1)]
              for plan in (sampler.plan(s // per_epoch, s % per_epoch) for s in range(steps))]
    return sum(a != b for a, b in counts)


def _sbft_train(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "sbft_cli.app", "train", *map(str, args)], capture_output=True,
                          text=True, timeout=600, env=env)


def _adapter_tensors(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "adapter" / "adapter_model.safetensors")


@pytest.mark.slow
def test_sharded_training_equals_unsharded_step_by_step(write_recipe, tmp_path):
    """12 steps (not 20: each 2-rank run costs ~1 s a step on a shared 2-core machine)."""
    steps = 12
    memory = {}
    for sharding in ("none", "fsdp"):
        out = tmp_path / sharding
        # a clipping norm every step exceeds: a norm of one rank's shards only would change every update
        path = sharding_recipe(write_recipe, out, sharding, max_steps=steps, eval_every=6, max_grad_norm=0.01)
        if sharding == "none":
            assert _uneven_steps(path, steps) >= 3  # the padding forwards do run
        result = _sbft_train(path, "--nproc", "2")
        assert result.returncode == 0, result.stderr[-3000:]
        memory[sharding] = json.loads((out / "memory.json").read_text())["ranks"]

    plain, sharded = tmp_path / "none", tmp_path / "fsdp"
    assert len(_losses(sharded)) == steps
    assert _losses(sharded) == pytest.approx(_losses(plain), abs=1e-4)
    assert all(row["layer_moved_share"] > 0.05 for row in read_metrics(sharded / "metrics.jsonl"))
    evals = [[row["eval_loss"] for row in read_metrics(out / "metrics.jsonl") if "eval_loss" in row] for out in (plain, sharded)]
    assert len(evals[0]) == 2 and evals[1] == pytest.approx(evals[0], abs=1e-4)

    whole, shards = memory["none"], memory["fsdp"]
    assert sum(r["parameters"] for r in shards) == whole[0]["parameters"]  # the shards add up to the model
    assert all(r["parameters"] <= 0.6 * whole[0]["parameters"] for r in shards)
    assert sum(r["optimizer"] for r in shards) <= whole[0]["optimizer"] + 16 * 8 * len(shards)  # + Adam step counters

    mine, reference = _adapter_tensors(sharded), _adapter_tensors(plain)
    assert sorted(mine) == sorted(reference)
    for name, tensor in reference.items():
        assert mine[name].shape == tensor.shape, name
        torch.testing.assert_close(mine[name], tensor, atol=1e-4, rtol=1e-3)


@pytest.mark.slow
def test_adapter_of_a_sharded_model_is_whole_and_reproduces_its_logits(write_recipe, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from sparsebalance_ft.recipe import load_recipe
    from sparsebalance_ft.train.export import export_merged
    from sparsebalance_ft.train.model import load_base_model, load_model

    path = write_recipe(lora={"modules_to_save": ["norm"]}, training={"sharding": "fsdp"})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(HELPER), str(path), str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    recipe = load_recipe(path)
    sharded_logits = torch.load(tmp_path / "sharded_logits.pt")

    fresh, _ = load_model(recipe)  # unsharded: the full shape of every trainable tensor
    full_shapes = {name: p.shape for name, p in fresh.named_parameters() if p.requires_grad}
    saved = _adapter_tensors(tmp_path)
    assert len(saved) == len(full_shapes)
    for name, tensor in saved.items():
        match = [shape for full, shape in full_shapes.items()
                 if full.replace(".modules_to_save.default", "").replace(".default", "") == name]
        assert match == [tensor.shape], name  # one rank's slice would be half as long

    loaded = PeftModel.from_pretrained(load_base_model(recipe), tmp_path / "adapter").eval()
    ids = torch.arange(5, 69).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, sharded_logits, atol=1e-5, rtol=1e-4)
    merged = AutoModelForCausalLM.from_pretrained(export_merged(recipe, tmp_path / "adapter", tmp_path / "merged"),
                                                  dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, sharded_logits, atol=1e-4, rtol=1e-4)


def test_fp16_with_sharding_is_a_recipe_error(write_recipe):
    from sparsebalance_ft.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="training.sharding: fsdp computes in bf16 or float32"):
        load_recipe(write_recipe(training={"sharding": "fsdp", "mixed_precision": "fp16"}))


def test_one_rank_trains_unsharded_with_a_note(write_recipe, tmp_path, capsys):
    from rich.console import Console

    from sparsebalance_ft.recipe import load_recipe
    from sparsebalance_ft.train.loop import train

    recipe = load_recipe(write_recipe(training={"sharding": "fsdp", "max_steps": 2, "checkpoint_every": 2}))
    summary = train(recipe, console=Console(stderr=True, width=250))
    assert summary["steps"] == 2
    assert "note: training.sharding: fsdp on one rank has nothing to shard over: training unsharded" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoint-2" / "sharded").exists()


@pytest.mark.slow
def test_full_fine_tuning_shards_and_saves_the_whole_model(write_recipe, tmp_path, tiny_model_dir):
    """`lora.enabled: false` trains every weight; the saved model is gathered whole from the shards."""
    from transformers import AutoModelForCausalLM

    path = write_recipe(lora={"enabled": False}, training={"sharding": "fsdp", "max_steps": 2})
    result = _sbft_train(path, "--nproc", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "adapter", dtype=torch.float32)
    trained_params = dict(trained.named_parameters())
    for name, p in base.named_parameters():
        assert trained_params[name].shape == p.shape, name
    assert not torch.equal(trained_params["model.layers.0.mlp.up_proj.weight"], base.model.layers[0].mlp.up_proj.weight)
