"""Context extension end to end on the tiny model (256 native positions, trained at 512 with yarn, LoRA plus
embeddings and norms, head tied to the embeddings): the setting is recorded in every checkpoint, a resume with
another one is refused, a resume restores the full-trained modules exactly, and plain transformers loads the
export at the new length with the trained model's logits (`sbft export --verify-tokens`: within the float32 floor)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from sparsebalance_ft.recipe import load_recipe
from sparsebalance_ft.train.checkpoint import latest_checkpoint
from sparsebalance_ft.train.export import export_merged
from sparsebalance_ft.train.export_check import check_export
from sparsebalance_ft.train.loop import train
from sparsebalance_ft.train.metrics import read_metrics
from sparsebalance_ft.train.model import embedding_and_norm_modules, full_training_summary, load_model
from sparsebalance_ft.train.rope import ROPE_RECORD, RopeError


@pytest.fixture
def tied_short_model(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256, "tie_word_embeddings": True}))
    weights = load_file(model / "model.safetensors")
    del weights["lm_head.weight"]  # tied, as SmolLM2 saves it: the head is the embedding matrix
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    return model


def _recipe(write_recipe, model, tmp_path, out, rope_type="yarn"):
    return load_recipe(write_recipe(
        model={"path": str(model), "rope_scaling": {"type": rope_type}},
        lora={"train_embeddings_and_norms": True},
        training={"max_steps": 4, "checkpoint_every": 2, "output_dir": str(tmp_path / out), "docs_per_rank": 1},
    ))


def test_embeddings_and_norms_are_found_in_the_model(tiny_model):
    names = embedding_and_norm_modules(tiny_model)
    layers = tiny_model.config.num_hidden_layers
    assert names[0] == "model.embed_tokens" and names[-1] == "model.norm" and len(names) == 2 + 2 * layers
    assert {n.rsplit(".", 1)[-1] for n in names[1:-1]} == {"input_layernorm", "post_attention_layernorm"}


@pytest.mark.slow
def test_extension_round_trips_through_checkpoint_resume_and_export(write_recipe, tied_short_model, tmp_path, monkeypatch):
    recipe = _recipe(write_recipe, tied_short_model, tmp_path, "a")
    summary = train(recipe)
    expected = read_metrics(tmp_path / "a" / "metrics.jsonl")
    record = json.loads((latest_checkpoint(tmp_path / "a") / ROPE_RECORD).read_text())
    assert record["rope_parameters"]["rope_type"] == "yarn" and record["max_position_embeddings"] == 512

    # a resume with another setting is refused before anything loads
    with pytest.raises(RopeError, match=r"--resume: .*checkpoint-4 was trained with rope yarn x2.*asks for rope linear x2"):
        train(_recipe(write_recipe, tied_short_model, tmp_path, "a", rope_type="linear"), resume=True)

    # killed after its checkpoint at step 2, resumed: the same losses (embeddings and norms restored)
    monkeypatch.setenv("SBFT_FAIL_AT", "0:3")
    with pytest.raises(RuntimeError, match="injected failure"):
        train(_recipe(write_recipe, tied_short_model, tmp_path, "b"))
    monkeypatch.delenv("SBFT_FAIL_AT")
    train(_recipe(write_recipe, tied_short_model, tmp_path, "b"), resume=True)
    resumed = read_metrics(tmp_path / "b" / "metrics.jsonl")
    torch.testing.assert_close(torch.tensor([r["loss"] for r in resumed]), torch.tensor([r["loss"] for r in expected]),
                               rtol=1e-6, atol=1e-7)

    fresh, _ = load_model(recipe)
    base = AutoModelForCausalLM.from_pretrained(tied_short_model, dtype=torch.float32)
    in_full = sum(base.get_submodule(name).weight.numel() for name in embedding_and_norm_modules(base))
    assert f"{in_full:,} parameters" in full_training_summary(fresh)

    trained, _ = load_model(recipe, adapter_dir=summary["adapter_dir"], trainable=False)
    merged_dir = export_merged(recipe, summary["adapter_dir"], tmp_path / "merged")
    config = json.loads((merged_dir / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["max_position_embeddings"] == 512
    plain = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    embedding = plain.get_input_embeddings().weight
    assert not torch.equal(embedding, base.get_input_embeddings().weight), "the embeddings did not train"
    assert plain.get_output_embeddings().weight is embedding, "the head no longer follows the embeddings"
    ids = torch.arange(3, 3 + 500).remainder(4000).unsqueeze(0)  # past the 256 native positions
    with torch.no_grad():
        diff = (plain(input_ids=ids).logits - trained(input_ids=ids).logits).abs().max().item()
    assert diff <= 1e-4, f"exported logits differ by {diff}"

    # `sbft export --verify-tokens`: the same figure, within the float32 floor; an export that lost its scaling is not
    check = check_export(recipe, summary["adapter_dir"], merged_dir, 500)
    assert check.export_vs_trained <= 1e-4 and check.within_floor, check.describe()
    assert 0 < check.trained_vs_float64 < 1e-3
    lost = tmp_path / "lost-scaling"
    shutil.copytree(merged_dir, lost)
    config = json.loads((lost / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_parameters"]["rope_theta"]}
    (lost / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    broken = check_export(recipe, summary["adapter_dir"], lost, 500)
    assert broken.export_vs_trained > 1000 * check.trained_vs_float64 and not broken.within_floor, broken.describe()
