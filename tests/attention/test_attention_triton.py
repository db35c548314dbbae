"""The Triton block-sparse kernel == dense attention and the torch kernel, outputs and gradients.

With a GPU the tests run the compiled kernels on CUDA; without one, `test_kernels_in_fresh_interpreter`
reruns this file under triton's interpreter (`_interpreter.py` says why it must be a fresh process).
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from _interpreter import kernel_check, rerun_check, rerun_under_interpreter
from _reference import full_selection, grads, masked_reference, qkv
from sparsebalance_ft.attention import kernels
from sparsebalance_ft.attention.kernels import block_sparse_attention, resolve_backend
from sparsebalance_ft.attention.kernels.triton import _transposed_index, launch
from sparsebalance_ft.bench.triton_compile import TARGETS

pytest.importorskip("triton")
from triton.runtime.errors import OutOfResources  # noqa: E402

BS, D = 16, 16


# What the interpreter cannot check, by the skip reason its cases give (the compiled kernels on a GPU check
# them: `make gpu-check`); any other skip in the subprocess fails the parent test.
INTERPRETER_SKIPS = {
    "triton 3.8's interpreter multiplies bf16 bit patterns as integers in tl.dot": 1,
    "CUDA only: too slow for the interpreter": 4,
}


@rerun_check
def test_kernels_in_fresh_interpreter():
    rerun_under_interpreter(__file__, INTERPRETER_SKIPS)


def _triton(device, idx, counts, window=None, bs=BS):
    """fn(q, k, v) running the Triton backend on `device` (inputs and outputs stay on the CPU side)."""
    def fn(q, k, v):
        qd, kd, vd = (t.to(device) for t in (q, k, v))
        i, c = idx.to(device), None if counts is None else counts.to(device)
        return block_sparse_attention(qd, kd, vd, i, c, block_size=bs, window=window, backend="triton").cpu()
    return fn


def _torch_kernel(idx, counts, window=None):
    return lambda q, k, v: block_sparse_attention(q, k, v, idx, counts, block_size=BS, window=window, backend="torch")


def _random_selection(batch, hkv, nb, kmax, seed):
    """Random distinct causal blocks in random order, counts 0..min(kmax, i + 1); padding slots hold
    arbitrary (even non-causal) block numbers, which the kernel must never read."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, nb, (batch, hkv, nb, kmax), generator=g)
    counts = torch.zeros(batch, hkv, nb, dtype=torch.long)
    for n in range(batch):
        for h in range(hkv):
            for i in range(nb):
                c = int(torch.randint(0, min(kmax, i + 1) + 1, (1,), generator=g))
                idx[n, h, i, :c] = torch.randperm(i + 1, generator=g)[:c]
                counts[n, h, i] = c
    return idx, counts


def _close(got, want, atol, rtol):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b.to(a.dtype), atol=atol, rtol=rtol)


class _SyncingOps(TorchDispatchMode):
    """The aten ops a host must wait for on a GPU (a result whose shape or value it reads), seen on a CPU."""

    SYNCING = {"aten::nonzero", "aten::masked_select", "aten::bincount", "aten::_local_scalar_dense",
               "aten::is_nonzero", "aten::equal", "aten::repeat_interleave", "aten::_unique2"}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        indexes = args[1] if name in ("aten::index", "aten::index_put", "aten::index_put_") else ()
        by_mask = any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in indexes or ())
        if name in self.SYNCING or by_mask:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_transposed_index_lists_each_key_blocks_readers_without_a_sync():
    """The backward's key-block -> query-blocks index: every reader of each key block, ascending, built
    without an op that would make the host wait for the GPU."""
    b, hkv, nq, kmax = 2, 3, 12, 4
    gen = torch.Generator().manual_seed(0)
    cnt = torch.randint(1, kmax + 1, (b, hkv, nq), generator=gen).minimum(torch.arange(1, nq + 1))
    idx = torch.zeros(b, hkv, nq, kmax, dtype=torch.int32)
    for bb in range(b):
        for h in range(hkv):
            for i in range(nq):
                idx[bb, h, i] = i  # unused slots hold the diagonal, as selections do
                idx[bb, h, i, :cnt[bb, h, i]] = torch.randperm(i + 1, generator=gen)[:cnt[bb, h, i]].int()
    with _SyncingOps() as ops:
        tptr, tidx = _transposed_index(idx, cnt, nq)
    assert ops.seen == []
    for bb in range(b):
        for h in range(hkv):
            for j in range(nq):
                c = (bb * hkv + h) * nq + j
                readers = [i for i in range(nq) if j in idx[bb, h, i, :cnt[bb, h, i]].tolist()]
                assert tidx[tptr[c]:tptr[c + 1]].tolist() == readers


class _DepthBoundKernel:
    """Stands in for a compiled kernel whose shared memory is 64 KiB per pipelining stage on a device that has
    `limit`: triton refuses a depth over it (OutOfResources) before running anything, as `launch` relies on."""

    __name__ = "_depth_bound_kernel"

    def __init__(self, limit: int):
        self.limit, self.tried, self.ran = limit, [], []

    def __getitem__(self, grid):
        def run(*args, num_stages, **meta):
            self.tried.append(num_stages)
            if num_stages * 64 * 1024 > self.limit:
                raise OutOfResources(num_stages * 64 * 1024, self.limit, "shared memory")
            self.ran.append(num_stages)
        return run


def test_launch_runs_at_the_deepest_pipelining_that_fits_and_remembers_it():
    kernel = _DepthBoundKernel(limit=150 * 1024)
    for _ in range(2):
        launch(kernel, (1,), torch.zeros(1), BS=64, D=64, num_warps=4)
    assert kernel.ran == [2, 2]
    assert kernel.tried == [3, 2, 2]  # the second launch goes straight to the depth that fitted


def test_launch_names_what_to_change_when_no_depth_fits():
    kernel = _DepthBoundKernel(limit=48 * 1024)
    refusal = r"fit this GPU at no pipelining depth \(shared memory: 65536 needed, 49152 there\); use bfloat16"
    with pytest.raises(ValueError, match=refusal):
        launch(kernel, (1,), torch.zeros(1), BS=128, D=128, num_warps=8)
    assert kernel.tried == [3, 2, 1] and kernel.ran == []


@kernel_check
def test_routes_to_triton(device):
    assert resolve_backend("triton", device) == "triton"


def test_falls_back_without_cuda_or_interpreter(monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernels.warn_once.cache_clear()
    with caplog.at_level(logging.WARNING):
        assert resolve_backend("triton", torch.device("cpu")) == "torch"
    assert "using the torch kernel" in caplog.text
    assert resolve_backend("auto", torch.device("cpu")) == "torch"


@kernel_check
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)])
def test_full_selection_equals_dense_causal(device, hq, hkv):
    length, batch = 64, 2
    q, k, v = qkv(hq, hkv, length, D, batch=batch)
    go = torch.randn(batch, hq, length, D)
    idx, counts = full_selection(length, BS, hkv, batch)
    got = grads(_triton(device, idx, counts), q, k, v, go)
    want = grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=hq != hkv),
                 q, k, v, go)
    _close(got, want, atol=2e-5, rtol=1e-4)


@kernel_check
@pytest.mark.parametrize("window", [None, 24])
def test_partial_selection_equals_torch_kernel(device, window):
    """Counts below K (some rows keep nothing: zero output, zero gradient, no NaN) and, with the window,
    blocks straddling its edge or lying wholly outside it."""
    hq, hkv, length, batch = 4, 2, 128, 2
    q, k, v = qkv(hq, hkv, length, D, dtype=torch.float64, seed=1, batch=batch)
    go = torch.randn(batch, hq, length, D, dtype=torch.float64)
    idx, counts = _random_selection(batch, hkv, length // BS, 3, seed=2)
    assert (counts == 0).any() and (counts < 3).any()
    want = grads(_torch_kernel(idx, counts, window), q, k, v, go)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    got = grads(_triton(device, idx, counts, window), q32, k32, v32, go.float())
    assert all(torch.isfinite(t).all() for t in got)
    empty = (counts == 0).repeat_interleave(hq // hkv, 1).repeat_interleave(BS, 2)
    assert (got[0][empty] == 0).all()
    _close(got, want, atol=1e-5, rtol=1e-4)


@kernel_check
def test_window_full_selection_equals_masked_dense(device):
    """Window 24 with blocks of 16: the diagonal, a block straddling the window's edge, blocks outside it."""
    hq, hkv, length, window = 4, 2, 64, 24
    q, k, v = qkv(hq, hkv, length, D, seed=3)
    go = torch.randn(1, hq, length, D)
    idx, counts = full_selection(length, BS, hkv)
    got = grads(_triton(device, idx, counts, window), q, k, v, go)
    want = grads(lambda a, b, c: masked_reference(a, b, c, idx, counts, BS, window), q, k, v, go)
    _close(got, want, atol=2e-5, rtol=1e-4)


@kernel_check
def test_counts_none_block_32_head_dim_32(device):
    """block_counts=None: all K entries valid (here K = 1: each query block attends to itself only)."""
    bs, hq, hkv, length, d = 32, 2, 1, 128, 32
    q, k, v = qkv(hq, hkv, length, d, seed=4)
    go = torch.randn(1, hq, length, d)
    nb = length // bs
    idx = torch.arange(nb).view(1, 1, nb, 1)
    got = grads(_triton(device, idx, None, bs=bs), q, k, v, go)
    want = grads(lambda a, b, c: masked_reference(a, b, c, idx, torch.ones(1, 1, nb, dtype=torch.long), bs),
                 q, k, v, go)
    _close(got, want, atol=2e-5, rtol=1e-4)


@kernel_check
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_close_to_float32(device, dtype):
    if dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("triton 3.8's interpreter multiplies bf16 bit patterns as integers in tl.dot")
    hq, hkv, length = 4, 2, 64
    q, k, v = qkv(hq, hkv, length, D, seed=5)
    go = torch.randn(1, hq, length, D)
    idx, counts = full_selection(length, BS, hkv)
    want = grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True), q, k, v, go)
    qh, kh, vh = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    got = grads(_triton(device, idx, counts), qh, kh, vh, go.to(dtype))
    assert all(t.dtype == dtype for t in got)
    _close([t.float() for t in got], want, atol=3e-2, rtol=3e-2)


def _shared_memory_per_block(device: torch.device) -> int:
    """The most shared memory one block may use on `device`: what triton checks a kernel's against."""
    from triton.runtime import driver

    return driver.active.utils.get_device_properties(device.index or 0)["max_shared_mem"]


@kernel_check
@pytest.mark.parametrize("bs,d", [(64, 64), (128, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_tiles(device, bs, d, dtype):
    """The tile sizes training uses, where a GPU's registers and shared memory can run out."""
    if device.type == "cpu":
        pytest.skip("CUDA only: too slow for the interpreter")
    hq, hkv, length = 4, 2, 4 * bs
    q, k, v = qkv(hq, hkv, length, d, seed=6)
    go = torch.randn(1, hq, length, d)
    idx, counts = full_selection(length, bs, hkv)
    want = grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True), q, k, v, go)
    qd, kd, vd = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    a100 = TARGETS["a100"].shared_bytes
    if bs * d >= 128 * 128 and (dtype == torch.float32 or _shared_memory_per_block(device) < a100):
        # 128 x 128 tiles in the backward, at its shallowest pipelining (bench_results/gpu/triton-compile.json):
        # fp32 needs 256 KiB of shared memory or more, over the 227 KiB or less any GPU gives a block; bf16 fits
        # an A100's 163 KiB and up, not an L40S's 99 KiB. Refused in one line, not with triton's OutOfResources.
        with pytest.raises(ValueError, match="fit this GPU at no pipelining depth"):
            grads(_triton(device, idx, counts, bs=bs), qd, kd, vd, go.to(dtype))
        return
    got = grads(_triton(device, idx, counts, bs=bs), qd, kd, vd, go.to(dtype))
    tol = 2e-4 if dtype == torch.float32 else 5e-2
    _close([t.float() for t in got], want, atol=tol, rtol=tol)
