"""Validation: a held-out split never trained on, sharded sums equal to one rank's, eval loss in metrics and TensorBoard."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from sparsebalance_ft.data import TokenizedCorpus, load_corpus
from sparsebalance_ft.errors import UserError
from sparsebalance_ft.recipe import TrainingConfig, load_recipe
from sparsebalance_ft.train.trackers import tracker_names
from sparsebalance_ft.train.validation import Validation, build_validation, split_for_eval


def _corpus(n=20):
    rng = np.random.default_rng(0)
    return TokenizedCorpus.from_documents([rng.integers(0, 100, 5 + i) for i in range(n)])


def _docs(corpus):
    return [tuple(corpus[i].tolist()) for i in range(len(corpus))]


def test_eval_split_is_a_seeded_share_never_in_the_training_documents():
    corpus = _corpus()
    train, held = split_for_eval(corpus, 0.25, seed=3)
    assert (len(train), len(held)) == (15, 5)
    assert sorted(_docs(train) + _docs(held)) == sorted(_docs(corpus))
    assert not set(_docs(train)) & set(_docs(held))
    assert _docs(split_for_eval(corpus, 0.25, seed=3)[1]) == _docs(held)  # same seed, same split
    assert _docs(split_for_eval(corpus, 0.25, seed=4)[1]) != _docs(held)
    assert train.target_tokens.tolist() == (train.lengths - 1).tolist()
    with pytest.raises(UserError, match="data.eval_split 0.01 of 20 documents holds out 0"):
        split_for_eval(corpus, 0.01, seed=0)


def _reference_loss(model, docs):
    """Token-weighted mean of each document's own loss, the model run on one document at a time."""
    total, count = 0.0, 0
    with torch.no_grad():
        for doc in docs:
            ids = torch.tensor(doc, dtype=torch.long)[None]
            total += float(model(input_ids=ids, labels=ids, use_cache=False).loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return total / count


def test_sharded_sums_add_up_to_the_mean_per_token(tiny_model, tiny_tokenizer, data_config):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    corpus = load_corpus(data_config(max_seq_len=256, max_documents=7), tiny_tokenizer)
    whole = Validation(corpus, 512, None, rank=0, world=1)
    shards = [Validation(corpus, 512, None, rank=r, world=2) for r in range(2)]
    assert sorted(i for s in shards for mb in s.micro_batches for i in mb) == list(range(7))
    loss, count = whole.local_sums(accelerator, tiny_model)
    parts = [s.local_sums(accelerator, tiny_model) for s in shards]
    assert count == sum(c for _, c in parts) == int((corpus.lengths - 1).sum())
    assert math.isclose(loss, sum(l for l, _ in parts), rel_tol=1e-5)
    result = whole.evaluate(accelerator, tiny_model, step=1)
    assert result["eval_tokens"] == count
    assert math.isclose(result["eval_loss"], _reference_loss(tiny_model, list(corpus)), rel_tol=1e-5)


def test_sparse_eval_uses_the_default_budget_and_leaves_the_rank_state_alone(tiny_model_dir, tiny_tokenizer, data_config):
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from sparsebalance_ft.attention import SparseAttentionController, SparsityConfig, register_sparse_attention

    register_sparse_attention()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sparsebalance")
    controller = SparseAttentionController.attach(model, SparsityConfig(block_size=16, k_max=4, k_min=2))
    controller.set_budget(0.2)
    corpus = load_corpus(data_config(max_seq_len=256, max_documents=3), tiny_tokenizer)
    before = controller.budgets
    result = Validation(corpus, 512, None, 0, 1, budget=1.0).evaluate(Accelerator(cpu=True), model, 1, controller)
    assert controller.budgets == before
    assert controller.pop_report().mean_density is None  # eval forwards left no report behind
    dense = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    # at budget 1.0 every causal block is kept: the sparse attention is exact
    assert math.isclose(result["eval_loss"], _reference_loss(dense, list(corpus)), rel_tol=1e-4)


def test_eval_path_is_loaded_like_data_path(write_recipe, tiny_tokenizer, tmp_path):
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps({"text": f"held-out document number {i} " * 8}) + "\n" for i in range(3)))
    recipe = load_recipe(write_recipe(data={"eval_path": str(eval_file)}))
    corpus = load_corpus(recipe.data, tiny_tokenizer)
    train_corpus, validation = build_validation(recipe, corpus, tiny_tokenizer, rank=0, world=1)
    assert train_corpus is corpus and len(validation.corpus) == 3
    assert build_validation(load_recipe(write_recipe()), corpus, tiny_tokenizer, 0, 1) == (corpus, None)


def test_recipe_errors_for_validation_are_one_line(write_recipe):
    from sparsebalance_ft.recipe import RecipeError

    with pytest.raises(RecipeError, match=r"training.eval_every needs validation data: set data.eval_path or data.eval_split$"):
        load_recipe(write_recipe(training={"eval_every": 5}))
    with pytest.raises(RecipeError, match=r"data: eval_path and eval_split are alternatives: set one$"):
        load_recipe(write_recipe(data={"eval_split": 0.1, "eval_path": "x.jsonl"}))
    with pytest.raises(RecipeError, match=r"data.eval_path: path not found: .*absent.jsonl$"):
        load_recipe(write_recipe(data={"eval_path": "/nowhere/absent.jsonl"}))


def test_report_to():
    assert tracker_names(TrainingConfig()) == ["tensorboard"]
    assert tracker_names(TrainingConfig(report_to="none")) == []
    assert tracker_names(TrainingConfig(tensorboard=False)) == []  # the older key still works
    with pytest.raises(UserError, match=r"^training.report_to: unknown tracker 'tensorbord' \(known: .*tensorboard"):
        tracker_names(TrainingConfig(report_to=["tensorbord"]))
    from accelerate.tracking import get_available_trackers

    if "wandb" not in get_available_trackers():
        with pytest.raises(UserError, match=r"^training.report_to: wandb is not installed \(pip install wandb\)"):
            tracker_names(TrainingConfig(report_to="wandb"))


def _scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, dict[int, float]] = {}
    for events in (run_dir / "tensorboard").rglob("events.out.tfevents.*"):  # the hparams go to a file of their own
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return scalars


def test_training_logs_eval_loss_to_metrics_and_tensorboard(write_recipe):
    from sparsebalance_ft.train.loop import train
    from sparsebalance_ft.train.metrics import read_metrics
    from sparsebalance_ft.train.model import load_model, load_tokenizer

    recipe = load_recipe(write_recipe(
        data={"eval_split": 0.25, "max_documents": 12},
        training={"max_steps": 4, "eval_every": 3, "tensorboard": True, "report_to": "tensorboard"},
    ))
    summary = train(recipe)
    run = Path(recipe.training.output_dir)
    rows = read_metrics(run / "metrics.jsonl")
    assert [("eval_loss" in r) for r in rows] == [False, False, True, True]  # every 3 steps and after the last
    scalars = _scalars(run)
    assert set(scalars["eval_loss"]) == {3, 4} and set(scalars["loss"]) == {1, 2, 3, 4}
    assert math.isclose(scalars["eval_loss"][4], rows[-1]["eval_loss"], rel_tol=1e-6)

    tokenizer = load_tokenizer(recipe)
    _, held_out = split_for_eval(load_corpus(recipe.data, tokenizer), 0.25, recipe.training.seed)
    model, _ = load_model(recipe, adapter_dir=summary["adapter_dir"], trainable=False)
    assert rows[-1]["eval_tokens"] == int((held_out.lengths - 1).sum())
    assert math.isclose(rows[-1]["eval_loss"], _reference_loss(model.eval(), list(held_out)), rel_tol=1e-4)


def test_report_to_none_writes_no_tracker_files(write_recipe):
    from sparsebalance_ft.train.loop import train

    recipe = load_recipe(write_recipe(training={"max_steps": 1, "tensorboard": True, "report_to": "none"}))
    train(recipe)
    assert not (Path(recipe.training.output_dir) / "tensorboard").exists()


@pytest.mark.slow
def test_two_ranks_sum_their_shares_of_the_validation(write_recipe):
    """Each rank holds half the held-out documents: eval_tokens counts them all only if the ranks' sums are added."""
    import subprocess
    import sys

    from sparsebalance_ft.train.metrics import read_metrics
    from sparsebalance_ft.train.model import load_model, load_tokenizer

    path = write_recipe(data={"eval_split": 0.25, "max_documents": 12}, training={"max_steps": 2, "docs_per_rank": 1})
    result = subprocess.run([sys.executable, "-m", "sbft_cli.app", "train", str(path), "--nproc", "2"],
                            capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    recipe = load_recipe(path)
    rows = read_metrics(Path(recipe.training.output_dir) / "metrics.jsonl")
    assert len(rows[-1]["ranks"]) == 2 and "eval_loss" in rows[-1] and "eval_loss" not in rows[0]
    _, held_out = split_for_eval(load_corpus(recipe.data, load_tokenizer(recipe)), 0.25, recipe.training.seed)
    assert rows[-1]["eval_tokens"] == int((held_out.lengths - 1).sum())
    model, _ = load_model(recipe, adapter_dir=Path(recipe.training.output_dir) / "adapter", trainable=False)
    assert math.isclose(rows[-1]["eval_loss"], _reference_loss(model.eval(), list(held_out)), rel_tol=1e-4)
