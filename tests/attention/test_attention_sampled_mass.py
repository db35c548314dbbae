"""The Triton sampled-mass kernel == the selection's sampled scores, and the selection it feeds == the torch one.

With a GPU the tests run the compiled kernel on CUDA; without one, `test_kernels_in_fresh_interpreter` reruns
this file under triton's interpreter (`_interpreter.py`).
"""
from __future__ import annotations

import pytest
import torch

from _interpreter import kernel_check, rerun_check, rerun_under_interpreter
from _reference import sampled_block_shares
from sparsebalance_ft.attention import selection
from sparsebalance_ft.attention.kernels.sampled_mass import fused_sampling_available, sampled_block_mass
from sparsebalance_ft.attention.selection import causal_counts, make_layout, sample_positions, to_layout

pytest.importorskip("triton")

INTERPRETER_SKIPS = {"triton 3.8's interpreter multiplies bf16 bit patterns as integers in tl.dot": 1}


@rerun_check
def test_kernels_in_fresh_interpreter():
    rerun_under_interpreter(__file__, INTERPRETER_SKIPS)


def test_used_only_where_triton_runs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not fused_sampling_available(torch.device("cpu"), 64, 64)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fused_sampling_available(torch.device("cpu"), 64, 64)
    assert not fused_sampling_available(torch.device("cpu"), 96, 64)  # a head dim the tiles do not take
    assert not fused_sampling_available(torch.device("cpu"), 64, 48)


def _layout_qk(hq, hkv, docs, bs, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, sum(docs), d, generator=g)
    k = torch.randn(hkv, sum(docs), d, generator=g)
    k[:, 40:56] += 2.0 * q[:1, :16].mean(1, keepdim=True)  # one key stretch most queries read
    layout = make_layout(docs, bs)
    return layout, *(to_layout(x[None], layout)[0].contiguous() for x in (q, k))


def _mass_by_chunks(q, k, layout, per_block, scale, window, rows, device):
    """The kernel's [Hkv, nb, nb] over chunks of `rows` query blocks, as the selection calls it."""
    nb = layout.num_blocks
    causal = causal_counts(layout, window)
    lo, span = torch.arange(nb) - causal + 1, int(causal.max())
    out = torch.zeros(k.shape[0], nb, nb, dtype=torch.float64)
    for i0 in range(0, nb, rows):
        i1, k0 = min(nb, i0 + rows), max(0, i0 - span + 1)
        qpos = sample_positions(layout, i0, i1, per_block)
        got = sampled_block_mass(q.to(device), k.to(device), qpos.to(device), lo.to(device),
                                 layout.block_tokens.to(device), layout.block_size, i0, i1, k0, window, scale,
                                 per_block)
        out[:, i0:i1, k0:i1] = got.double().cpu()
    return out


@kernel_check
@pytest.mark.parametrize("hq,hkv,per_block", [(4, 2, 3), (6, 2, 4), (3, 3, 1)])
@pytest.mark.parametrize("docs,window", [([100, 150, 64, 90], None), ([230], 40)])
def test_equals_each_sampled_tokens_own_softmax(device, hq, hkv, per_block, docs, window):
    """Padded sample rows (a group's heads x samples below a power of two), short tail blocks, several
    documents, a window, GQA groups of 1-3, every chunking: each token's float64 softmax summed per block."""
    layout, q, k = _layout_qk(hq, hkv, docs, 16)
    want = sampled_block_shares(q, k, layout, per_block, 0.3, window)
    for rows in (layout.num_blocks, 5, 1):
        got = _mass_by_chunks(q, k, layout, per_block, 0.3, window, rows, device)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@kernel_check
def test_bfloat16_keys_stay_within_their_rounding(device):
    if device.type == "cpu":
        pytest.skip("triton 3.8's interpreter multiplies bf16 bit patterns as integers in tl.dot")
    layout, q, k = _layout_qk(6, 2, [300, 212], 32)
    want = sampled_block_shares(q, k, layout, 4, 0.25)
    got = _mass_by_chunks(q, k.bfloat16(), layout, 4, 0.25, None, layout.num_blocks, device)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)


@kernel_check
@pytest.mark.parametrize("window", [None, 48])
def test_selection_keeps_the_same_blocks_as_with_torch_ops(device, monkeypatch, window):
    """The whole selection with the kernel (one chunk: its temporaries no longer grow with the samples) keeps
    the blocks the torch ops keep, in the same order."""
    layout, q, k = _layout_qk(6, 2, [400, 250, 130], 16, seed=1)
    kw = dict(rule="mass", limits=[(0.9, 8), (0.5, 4)], k_min=2, sink_blocks=1, local_blocks=2, scale=0.25,
              window=window, score_queries=4)
    with_kernel = _select_on(device, q, k, layout, kw)
    monkeypatch.setattr(selection, "fused_sampling_available", lambda *_: False)
    with_ops = _select_on(device, q, k, layout, kw)
    for (idx_a, n_a), (idx_b, n_b) in zip(with_kernel, with_ops, strict=True):
        assert torch.equal(n_a, n_b)
        slots = torch.arange(idx_a.shape[-1])[None, None] < n_a[..., None]
        assert torch.equal(idx_a[slots], idx_b[slots])


def _select_on(device, q, k, layout, kw):
    """(indices, counts) on the CPU of each selection `select_block_sets` makes on `device`."""
    moved = make_layout(layout.doc_lengths, layout.block_size, device)
    return [(s.indices.cpu(), s.counts.cpu()) for s in selection.select_block_sets(q.to(device), k.to(device), moved,
                                                                                   **kw)]


@kernel_check
@pytest.mark.parametrize("backend,uses_kernel", [("auto", True), ("triton", True), ("torch", False)])
def test_the_torch_backend_keeps_the_selection_in_torch_ops(device, monkeypatch, backend, uses_kernel):
    """`sparsity.backend: torch` is the portable path end to end (and `make gpu-check`'s comparison)."""
    from sparsebalance_ft.attention import SparseAttentionController, SparsityConfig

    calls = []
    real = selection.sampled_block_mass
    monkeypatch.setattr(selection, "sampled_block_mass", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    layout, q, k = _layout_qk(6, 2, [200], 16)
    ctl = SparseAttentionController(SparsityConfig(block_size=16, backend=backend))
    ctl.select(q.to(device), k.to(device), make_layout([200], 16, device), 0.5, 0.25)
    assert bool(calls) == uses_kernel
