"""Every bad input is one line on stderr and exit status 2, with one rank and with two."""
from __future__ import annotations

import json
import shutil

import pytest

from _sbft import one_error_line, run_sbft

RANKS = [pytest.param(1, id="1-rank"), pytest.param(2, id="2-ranks")]


def _model_copy(tiny_model_dir, tmp_path, drop=(), **config):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    for name in drop:
        (model / name).unlink()
    if config:
        values = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**values, **config}))
    return model


@pytest.mark.parametrize("nproc", RANKS)
def test_a_list_recipe_with_set_overrides(tmp_path, nproc):
    recipe = tmp_path / "list.yaml"
    recipe.write_text("- model\n- data\n")
    line = one_error_line(run_sbft("train", recipe, "--set", "training.max_steps=3", "--nproc", nproc))
    assert f"{recipe}: expected a mapping of sections at the top level, got list" in line


@pytest.mark.parametrize("nproc", RANKS)
def test_a_model_dir_without_weights(write_recipe, tiny_model_dir, tmp_path, nproc):
    model = _model_copy(tiny_model_dir, tmp_path, drop=["model.safetensors"])
    line = one_error_line(run_sbft("train", write_recipe(model={"path": str(model)}), "--nproc", nproc))
    assert f"model.path: no weights in {model}" in line


@pytest.mark.parametrize("nproc", RANKS)
def test_an_empty_model_dir_names_model_path(write_recipe, tmp_path, nproc):
    empty = tmp_path / "empty"
    empty.mkdir()
    line = one_error_line(run_sbft("train", write_recipe(model={"path": str(empty)}), "--nproc", nproc))
    assert line.startswith("error: model.path:") and "data.tokenizer" not in line
    assert line.endswith(f"not a Hugging Face checkpoint (no config.json): {empty}")


@pytest.mark.parametrize("nproc", RANKS)
def test_an_unwritable_output_dir(write_recipe, nproc):
    line = one_error_line(run_sbft("train", write_recipe(training={"output_dir": "/sys/sbft-run"}), "--nproc", nproc))
    assert "training.output_dir: cannot write to /sys/sbft-run" in line


@pytest.mark.parametrize("nproc", RANKS)
def test_fp16_on_cpu_is_refused(write_recipe, nproc):
    line = one_error_line(run_sbft("train", write_recipe(training={"mixed_precision": "fp16"}), "--nproc", nproc))
    assert "training.mixed_precision: fp16 needs a CUDA GPU" in line


@pytest.mark.parametrize("nproc", RANKS)
def test_max_seq_len_above_the_models_positions(write_recipe, tiny_model_dir, tmp_path, nproc):
    model = _model_copy(tiny_model_dir, tmp_path, max_position_embeddings=256)
    line = one_error_line(run_sbft("train", write_recipe(model={"path": str(model)}), "--nproc", nproc))
    assert "data.max_seq_len (512) is above model.path's max_position_embeddings (256)" in line


@pytest.mark.parametrize("nproc", RANKS)
def test_a_fresh_run_in_a_used_output_dir(write_recipe, tmp_path, nproc):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    line = one_error_line(run_sbft("train", write_recipe(), "--nproc", nproc))
    assert "already holds a run (metrics.jsonl); continue it with --resume or replace it with --overwrite" in line
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 1}\n'  # nothing lost


@pytest.mark.parametrize("nproc", RANKS)
def test_resume_from_a_checkpoint_that_does_not_exist(write_recipe, tmp_path, nproc):
    gone = tmp_path / "run" / "checkpoint-7"
    line = one_error_line(run_sbft("train", write_recipe(), "--resume", gone, "--nproc", nproc))
    assert f"--resume: checkpoint not found: {gone}" in line


def test_accelerate_launch_that_started_one_process_of_two(write_recipe):
    # What `accelerate launch --num_processes 2` sets on a machine without GPUs: a group address, no WORLD_SIZE.
    env = {"ACCELERATE_DYNAMO_BACKEND": "NO", "ACCELERATE_MIXED_PRECISION": "no", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    line = one_error_line(run_sbft("train", write_recipe(), env=env))
    assert "accelerate launch asked for several processes but started one" in line and "--multi_gpu" in line


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["1-rank", "2-ranks"])
def test_a_malformed_data_line(write_recipe, tmp_path, jsonl_corpus, nproc):
    data = tmp_path / "broken.jsonl"
    data.write_text(jsonl_corpus.read_text().splitlines()[0] + "\n" + '{"text": "cut off\n')
    line = one_error_line(run_sbft("train", write_recipe(data={"path": str(data)}), "--nproc", nproc))
    assert f"{data}:2: not valid JSON" in line
    if nproc == 2:
        assert line.startswith("error: rank 0 failed (exit code 2):") and line.endswith("all ranks were stopped")


@pytest.mark.parametrize("nproc", RANKS)
def test_a_second_run_on_a_dir_in_use(write_recipe, tmp_path, nproc):
    import os
    import socket

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".sbft.lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    line = one_error_line(run_sbft("train", write_recipe(), "--resume", "--nproc", nproc))
    assert f"is in use by another sbft train (pid {os.getpid()} on {socket.gethostname()})" in line


def _gpt2_dir(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)).save_pretrained(tmp_path / "gpt2")
    return tmp_path / "gpt2"


ROPE_CASES = {
    "unknown-type": ({"rope_scaling": {"type": "ntk"}}, "model.rope_scaling.type: unknown rope scaling type 'ntk'"),
    "factor-1": ({"rope_scaling": {"type": "linear", "factor": 1}}, "model.rope_scaling.factor: factor must be above 1"),
    "factor-too-small": ({"rope_scaling": {"type": "yarn", "factor": 1.5}},
                         "factor: 1.5 covers 384 positions (256 native x 1.5), below data.max_seq_len (512); use factor 2 or auto"),
    "theta-0": ({"rope_theta": 0}, "model.rope_theta: Input should be greater than 0"),
    "no-rotary": ({"rope_scaling": {"type": "linear"}}, "has no rotary position embeddings (model_type gpt2)"),
    "yarn-key-on-linear": ({"rope_scaling": {"type": "linear", "beta_fast": 8}},
                           "model.rope_scaling: beta_fast is a yarn key; type is linear"),
}


@pytest.mark.slow  # each message is also checked in-process by tests/train/test_rope.py
@pytest.mark.parametrize("nproc", RANKS)
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_a_bad_rope_setting(write_recipe, tiny_model_dir, tmp_path, case, nproc):
    keys, message = ROPE_CASES[case]
    model = _gpt2_dir(tmp_path) if case == "no-rotary" else _model_copy(tiny_model_dir, tmp_path, max_position_embeddings=256)
    line = one_error_line(run_sbft("train", write_recipe(model={"path": str(model), **keys}), "--nproc", nproc))
    assert message in line


def test_score_precision_bench_refuses_lengths_off_the_blocks_or_past_the_model_and_a_folder_without_one(
        tiny_model_dir, tmp_path):
    line = one_error_line(run_sbft("bench", "score-precision", "--length", "1000", "--model", tmp_path))
    assert "--length: must be a multiple of the block size 64, got 1000" in line
    line = one_error_line(run_sbft("bench", "score-precision", "--model", tmp_path))
    assert line.endswith(f"--model: not a Hugging Face checkpoint (no config.json): {tmp_path}")
    native = json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    line = one_error_line(run_sbft("bench", "score-precision", "--model", tiny_model_dir, "--length", native + 64))
    assert f"--length {native + 64} is above the model's {native} positions" in line
