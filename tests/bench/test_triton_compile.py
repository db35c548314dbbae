"""The Triton kernels compile for GPUs this machine lacks, at the settings their wrappers launch with.

Real compiles (triton's own ptxas, no driver), a few seconds each: SmolLM2's tiles on an H100, and one tile
whose pipelining must be made shallower to fit an A100, as `launch` would find at run time.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sparsebalance_ft.bench.triton_compile import TARGETS, compile_for, deepest_fitting, kernels_at  # noqa: E402


def test_smollm2_tiles_compile_for_an_h100_at_full_pipelining_depth():
    """bf16, block 64, head dim 64, 3 query heads per key-value head, 8 sampled tokens: every kernel a step
    launches compiles for sm_90a, fits its shared memory at triton's default depth, and ptxas reports on it."""
    h100 = TARGETS["h100"]
    names = []
    for name, kernel, types, settings in kernels_at(torch.bfloat16, 64, 64, group=3, per_block=8):
        result = deepest_fitting(kernel, types, settings, h100)
        assert result["stages"] == 3, (name, result)
        assert 0 < result["shared_bytes"] <= h100.shared_bytes
        assert result["registers"] and result["spill_store_bytes"] is not None, (name, result)
        names.append(name)
    assert names == ["forward", "delta", "dq", "dkdv", "sampled_mass"]


def test_a_tile_over_an_a100s_shared_memory_compiles_shallower():
    """fp32 forward at block 64 and head dim 128 (a Llama head): triton's 3 stages need more shared memory than an
    A100 lets a block have, so the depth that fits is a shallower one, and it does fit."""
    a100 = TARGETS["a100"]
    _, kernel, types, settings = kernels_at(torch.float32, 64, 128, group=4, per_block=8)[0]
    deepest = compile_for(kernel, types, settings, a100.capability, stages=3)
    assert deepest["shared_bytes"] > a100.shared_bytes
    fitting = deepest_fitting(kernel, types, settings, a100)
    assert fitting["stages"] in (1, 2)
    assert fitting["shared_bytes"] <= a100.shared_bytes < deepest["shared_bytes"]
