"""`sbft bench memory`: fresh-process peaks, the cap that protects a shared machine, and the accounting."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sparsebalance_ft.bench.memory import (
    GIB,
    LLAMA3_8B,
    LLAMA3_70B,
    SMOLLM2,
    MemoryCase,
    Shape,
    default_cases,
    layer_parameters,
    lora_parameters,
    profiled_allocations,
    projected_peak,
    projected_step,
    result_row,
    run_case,
    selection_cases,
    selection_row,
)


def test_chunked_loss_peaks_lower_than_full_logits_with_the_same_loss():
    tokens = 4096  # six chunks of the 49,152-entry vocabulary: one chunk's logits are far below the whole
    full = run_case(MemoryCase("loss", tokens, "full"), "cpu", cap_gib=8, timeout_s=600)
    chunked = run_case(MemoryCase("loss", tokens, "chunked"), "cpu", cap_gib=8, timeout_s=600)
    assert full["loss"] == pytest.approx(chunked["loss"], rel=1e-5)
    full_step = full["peak_bytes"] - full["before_step_bytes"]
    chunked_step = chunked["peak_bytes"] - chunked["before_step_bytes"]
    logits = tokens * 49_152 * 4
    assert full_step > 2 * logits  # the logits and their log-softmax, at least
    assert chunked_step < full_step / 2
    # the accounting predicts what was measured
    for case, measured in ((MemoryCase("loss", tokens, "full"), full_step), (MemoryCase("loss", tokens, "chunked"), chunked_step)):
        assert measured == pytest.approx(projected_step(case), rel=0.25), case.name


def test_a_configuration_above_the_cap_is_stopped_and_recorded():
    result = run_case(MemoryCase("loss", 1024, "full"), "cpu", cap_gib=0.05, timeout_s=600)
    assert result["exceeded_bytes"] == int(0.05 * GIB) and "peak_bytes" not in result
    assert result_row(result)["note"] == "stopped above 0 GiB"


def test_lora_parameter_count_matches_peft():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = Shape("small", 2, 64, 4, 2, 16, 128, 100, 0, 4)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    assert lora_parameters(shape) == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_layer_parameter_count_matches_a_llama_layer():
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = Shape("small", 2, 64, 4, 2, 16, 128, 100, 0, 4)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    assert layer_parameters(shape) == sum(p.numel() for p in model.model.layers[0].parameters())


def test_sharding_divides_the_weights_and_adds_what_is_gathered():
    whole = projected_peak(LLAMA3_70B, 32_768, True, "chunked")
    sharded = projected_peak(LLAMA3_70B, 32_768, True, "chunked", shards=8)
    assert sharded["weights"] == whole["weights"] / 8 and sharded["lora_state"] == whole["lora_state"] / 8
    root = LLAMA3_70B.parameters - LLAMA3_70B.layers * layer_parameters(LLAMA3_70B)
    assert root == 2 * LLAMA3_70B.vocab * LLAMA3_70B.hidden + LLAMA3_70B.hidden  # untied embedding and head, final norm
    assert sharded["gathered"] == (root + 2 * layer_parameters(LLAMA3_70B)) * 2
    assert sharded["total"] - sharded["weights"] - sharded["gathered"] - sharded["lora_state"] == pytest.approx(
        whole["total"] - whole["weights"] - whole["lora_state"])  # activations do not shard


def test_accounting_orders_the_three_changes():
    target = projected_peak(SMOLLM2, 32_768, checkpointing=True, loss="chunked")["total"]
    assert projected_peak(SMOLLM2, 32_768, checkpointing=True, loss="full")["total"] > 3 * target
    assert projected_peak(SMOLLM2, 32_768, checkpointing=False, loss="chunked")["total"] > 5 * target


def test_default_cases_are_the_target_and_one_change_ablations():
    cases = default_cases([8192], [16384], [32768])
    assert [c.name for c in cases] == [
        "loss 16K full", "loss 16K chunked",
        "model 8K sparse ckpt chunked", "model 8K sparse ckpt full", "model 8K sparse no-ckpt chunked",
        "model 8K dense ckpt chunked", "model 8K dense no-ckpt full",
        "model 32K sparse ckpt chunked", "model 32K sparse ckpt full", "model 32K sparse no-ckpt chunked",
    ]


def test_cli_prints_the_llama_projection():
    done = subprocess.run([sys.executable, "-m", "sbft_cli.app", "bench", "memory", "--project"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "COLUMNS": "160"})
    assert done.returncode == 0, done.stderr
    total = projected_peak(LLAMA3_8B, 131_072, True, "chunked")["total"]
    assert f"{total / 1e9:.1f}" in done.stdout and "Llama-3-8B" in done.stdout


def test_profiled_allocations_sees_the_peak_of_live_tensors_and_the_largest_one():
    import torch

    mib = 2**20

    def call():
        a = torch.ones(mib)  # 4 MiB of float32
        b = torch.ones(2 * mib)  # 8 MiB, while a lives: 12 MiB at once
        del a, b
        c = torch.ones(mib)  # 4 MiB again, after both were freed: no new peak
        return c.sum()

    found = profiled_allocations(call, largest=2)
    assert found["torch_peak_bytes"] == pytest.approx(12 * mib, abs=64 * 1024)
    assert [a["bytes"] for a in found["largest_allocations"]] == [8 * mib, 4 * mib]
    assert all(a["op"] for a in found["largest_allocations"])


def test_selection_workload_measures_one_layer_selection_in_a_fresh_process():
    small, large = (run_case(case, "cpu", cap_gib=4, timeout_s=600) for case in selection_cases([2048, 8192]))
    for result, tokens in ((small, 2048), (large, 8192)):
        assert result["name"] == f"selection {tokens // 1024}K"
        assert 0 < result["density"] <= 1
        assert result["peak_bytes"] >= result["before_step_bytes"]
        largest = result["largest_allocations"]
        assert largest and result["torch_peak_bytes"] >= largest[0]["bytes"] > 0
    # four times the tokens: the chunked selection's live tensors grow about fourfold (a chunk's logits span
    # the keys, until their element cap binds near 32K tokens), never the sixteenfold of the unchunked
    # selection's [nb, nb] scores; 8x, the geometric middle, tells the two apart
    assert large["torch_peak_bytes"] < 8 * small["torch_peak_bytes"]
    row = selection_row(large)
    assert row["torch_peak_mib"] == round(large["torch_peak_bytes"] / 2**20, 1) and row["note"] == ""


def test_cli_selection_workload_writes_json_naming_the_measured_code(tmp_path):
    out = tmp_path / "selection.json"
    done = subprocess.run([sys.executable, "-m", "sbft_cli.app", "bench", "memory", "--workload", "selection",
                           "--selection-tokens", "1024", "--out", str(out)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "COLUMNS": "160"})
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["results"]] == ["selection 1K"]
    assert "torch_peak_bytes" in report["results"][0] and "selection 1K" in done.stdout
    assert set(report["code"]) == {"commit", "dirty", "selection_py_blob"}
    bad = subprocess.run([sys.executable, "-m", "sbft_cli.app", "bench", "memory", "--workload", "nope"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--workload" in bad.stderr
