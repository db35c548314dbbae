"""`sbft bench memory`: fresh-process peaks, the cap that protects a shared machine, and the accounting."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sparsebalance_ft.bench.memory import (
    GIB,
    LLAMA3_8B,
    SMOLLM2,
    MemoryCase,
    Shape,
    default_cases,
    lora_parameters,
    projected_peak,
    projected_step,
    result_row,
    run_case,
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
