"""Block-sparse attention in Triton, forward and backward, flash-attention style.

Import-guarded: the CPU install never needs triton; `TRITON_AVAILABLE` tells whether it imports. The
kernels run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (triton's interpreter, which
is how the tests check them without a GPU). Status: checked against dense attention and the torch
kernel under the interpreter; compiled here for sm_80, sm_89 and sm_90a (``make triton-compile``: shared
memory, registers, spills); run on a GPU once, inside an H200 training step, but never timed alone
(``make gpu-check`` does both).

Layout and semantics are those of kernels/torch_kernel.py: ``q [B, Hq, L, D]``, ``k, v [B, Hkv, L, D]``,
``block_indices [B, Hkv, nq, K]`` with the first ``block_counts[b, h, i]`` entries kept, token-level
causal (and sliding-window) masking inside kept blocks. A query row that sees no key gets a zero output
and zero gradients, as in the torch kernel.

Forward: one program per (batch, query head, query block) walks the block's kept key blocks with an
online softmax in fp32 (base 2), evaluating the causal/window mask only on blocks that need it (the
diagonal block, blocks reaching past the window's edge); it stores the output and each row's
log-sum-exp. Backward recomputes probabilities from the log-sum-exp after a pass for
``delta = rowsum(dO * O)``: dQ per (batch, query head, query block) over its kept blocks; dK and dV per
(batch, kv head, key block) over the query blocks that kept it, found through a transposed (CSR) index
built in torch, summing the GQA group's query heads inside the program. Every gradient element has one
writer: no atomics, deterministic.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources

    TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover - triton is optional (the `triton` extra)
    TRITON_AVAILABLE = False

_LOG2E = 1.4426950408889634


def interpreting() -> bool:
    """Whether triton's interpreter is on (then the kernels take CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on")


if TRITON_AVAILABLE:

    @triton.jit
    def _masked(s, qpos, kpos, i, j, window, BS: tl.constexpr, HAS_WINDOW: tl.constexpr):
        """-inf where a key is not visible; blocks fully below the diagonal and inside the window skip it."""
        need = i == j
        if HAS_WINDOW:
            need = need | (j * BS <= i * BS + BS - 1 - window)
        if need:
            ok = kpos <= qpos
            if HAS_WINDOW:
                ok = ok & (kpos > qpos - window)
            s = tl.where(ok, s, float("-inf"))
        return s

    @triton.jit
    def _kept_block_scores(q, K, V, IDX, row, t, kh, i, offs_m, offs_d, qk_scale, window, L, KMAX,
                           BS: tl.constexpr, D: tl.constexpr, HAS_WINDOW: tl.constexpr, PREC: tl.constexpr):
        """The t-th kept key block of a query block: its K and V tiles and the masked base-2 scores q k^T."""
        j = tl.load(IDX + row * KMAX + t)
        offs_n = j * BS + tl.arange(0, BS)
        kv_off = kh * L * D + offs_n[:, None] * D + offs_d[None, :]
        k = tl.load(K + kv_off)
        v = tl.load(V + kv_off)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        return k, v, _masked(s, offs_m[:, None], offs_n[None, :], i, j, window, BS, HAS_WINDOW)

    @triton.jit
    def _fwd_kernel(Q, K, V, Out, LSE, IDX, CNT, qk_scale, window, L, NQ, KMAX,
                    G: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    PREC: tl.constexpr):
        i = tl.program_id(0)
        qh = tl.program_id(1).to(tl.int64)  # b * Hq + query head
        kh = qh // G  # b * Hkv + kv head
        offs_m = i * BS + tl.arange(0, BS)
        offs_d = tl.arange(0, D)
        q = tl.load(Q + qh * L * D + offs_m[:, None] * D + offs_d[None, :])
        m_i = tl.full([BS], float("-inf"), tl.float32)
        l_i = tl.zeros([BS], tl.float32)
        acc = tl.zeros([BS, D], tl.float32)
        row = kh * NQ + i
        for t in range(tl.load(CNT + row)):
            _, v, s = _kept_block_scores(q, K, V, IDX, row, t, kh, i, offs_m, offs_d, qk_scale, window, L, KMAX,
                                         BS, D, HAS_WINDOW, PREC)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: exp2 gives 0, not NaN
            p = tl.math.exp2(s - m_ref[:, None])
            alpha = tl.math.exp2(m_i - m_ref)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        seen = l_i > 0
        l_safe = tl.where(seen, l_i, 1.0)
        out = acc / l_safe[:, None]
        tl.store(Out + qh * L * D + offs_m[:, None] * D + offs_d[None, :], out.to(Out.dtype.element_ty))
        # +inf for rows that saw nothing: backward's exp2(s - lse) is then 0 for them
        tl.store(LSE + qh * L + offs_m, tl.where(seen, m_i + tl.math.log2(l_safe), float("inf")))

    @triton.jit
    def _delta_kernel(Out, DO, DELTA, BS: tl.constexpr, D: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BS + tl.arange(0, BS)
        off = rows[:, None] * D + tl.arange(0, D)[None, :]
        o = tl.load(Out + off).to(tl.float32)
        do = tl.load(DO + off).to(tl.float32)
        tl.store(DELTA + rows, tl.sum(o * do, 1))

    @triton.jit
    def _dq_kernel(Q, K, V, DO, DQ, LSE, DELTA, IDX, CNT, scale, qk_scale, window, L, NQ, KMAX,
                   G: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   PREC: tl.constexpr):
        i = tl.program_id(0)
        qh = tl.program_id(1).to(tl.int64)
        kh = qh // G
        offs_m = i * BS + tl.arange(0, BS)
        offs_d = tl.arange(0, D)
        q_off = qh * L * D + offs_m[:, None] * D + offs_d[None, :]
        q = tl.load(Q + q_off)
        do = tl.load(DO + q_off)
        lse = tl.load(LSE + qh * L + offs_m)
        delta = tl.load(DELTA + qh * L + offs_m)
        dq = tl.zeros([BS, D], tl.float32)
        row = kh * NQ + i
        for t in range(tl.load(CNT + row)):
            k, v, s = _kept_block_scores(q, K, V, IDX, row, t, kh, i, offs_m, offs_d, qk_scale, window, L, KMAX,
                                         BS, D, HAS_WINDOW, PREC)
            p = tl.math.exp2(s - lse[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
        tl.store(DQ + q_off, (dq * scale).to(DQ.dtype.element_ty))

    @triton.jit
    def _dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, TPTR, TIDX, scale, qk_scale, window, L, NK,
                     G: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, HAS_WINDOW: tl.constexpr,
                     PREC: tl.constexpr):
        j = tl.program_id(0)
        kh = tl.program_id(1).to(tl.int64)  # b * Hkv + kv head
        offs_n = j * BS + tl.arange(0, BS)
        offs_d = tl.arange(0, D)
        kv_off = kh * L * D + offs_n[:, None] * D + offs_d[None, :]
        k = tl.load(K + kv_off)
        v = tl.load(V + kv_off)
        dk = tl.zeros([BS, D], tl.float32)
        dv = tl.zeros([BS, D], tl.float32)
        col = kh * NK + j
        for t in range(tl.load(TPTR + col), tl.load(TPTR + col + 1)):
            i = tl.load(TIDX + t)
            offs_m = i * BS + tl.arange(0, BS)
            for g in range(G):  # the group's query heads share this kv head's selection
                qh = kh * G + g
                q_off = qh * L * D + offs_m[:, None] * D + offs_d[None, :]
                q = tl.load(Q + q_off)
                do = tl.load(DO + q_off)
                lse = tl.load(LSE + qh * L + offs_m)
                delta = tl.load(DELTA + qh * L + offs_m)
                st = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale  # [keys, queries]
                st = _masked(st, offs_m[None, :], offs_n[:, None], i, j, window, BS, HAS_WINDOW)
                pt = tl.math.exp2(st - lse[None, :])
                dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC)
                dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
                dst = pt * (dpt - delta[None, :])
                dk += tl.dot(dst.to(q.dtype), q, input_precision=PREC)
        tl.store(DK + kv_off, (dk * scale).to(DK.dtype.element_ty))
        tl.store(DV + kv_off, dv.to(DV.dtype.element_ty))


def _transposed_index(idx: torch.Tensor, cnt: torch.Tensor, nk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR of the selection by key block: for column c = (b * Hkv + h) * nk + j, the query blocks that
    kept key block j are ``tidx[tptr[c]:tptr[c + 1]]`` (ascending; a stable sort keeps it deterministic).

    Every tensor keeps the selection's fixed size, so nothing waits for the GPU: unused slots go to a
    sentinel column past the last one (sorted to the end of `tidx`, where no range reaches), and the column
    sizes come from a scatter-add, not from boolean indexing or `bincount` (each a host synchronisation)."""
    b, hkv, nq, kmax = idx.shape
    dev = idx.device
    columns = b * hkv * nk
    valid = torch.arange(kmax, device=dev) < cnt[..., None]
    col = torch.arange(b * hkv, device=dev).view(b, hkv, 1, 1) * nk + idx.long()
    col = torch.where(valid, col, columns).reshape(-1)
    qblock = torch.arange(nq, device=dev).view(1, 1, nq, 1).expand(b, hkv, nq, kmax).reshape(-1)
    order = torch.argsort(col, stable=True)
    sizes = torch.zeros(columns + 1, dtype=torch.long, device=dev).scatter_add_(0, col, torch.ones_like(col))
    tptr = torch.zeros(columns + 1, dtype=torch.int32, device=dev)
    tptr[1:] = sizes[:columns].cumsum(0)
    return tptr, qblock[order].to(torch.int32).contiguous()


def kernel_constexprs(group: int, bs: int, d: int, window: int | None, dtype: torch.dtype) -> dict:
    """The compile-time settings of the forward, dQ and dK/dV kernels for q of `dtype`: what `make gpu-check`
    runs and `bench/triton_compile.py` compiles for GPUs this machine lacks. fp32 inputs keep fp32 products
    ("ieee"): tf32 would silently lower the precision fp32 asks for."""
    return {"G": group, "BS": bs, "D": d, "HAS_WINDOW": window is not None,
            "PREC": "ieee" if dtype == torch.float32 else None, "num_warps": 4 if bs * d <= 64 * 64 else 8}


def delta_constexprs(common: dict) -> dict:
    """The backward's delta kernel's settings, taken from the other kernels' (`kernel_constexprs`)."""
    return {name: common[name] for name in ("BS", "D", "num_warps")}


# Software-pipelining depths, deepest (triton's default) first: a kernel's shared memory grows with the depth,
# and some tiles fit a GPU only shallower (fp32 64 x 128 on an A100: bench_results/gpu/triton-compile.json).
PIPELINE_STAGES = (3, 2, 1)
_fitting_stages: dict[tuple, int] = {}


def launch(kernel, grid, *args, **meta) -> None:
    """``kernel[grid](*args, **meta)`` at the deepest of `PIPELINE_STAGES` whose shared memory the GPU holds.

    Triton compares a compiled kernel's shared memory with the device's before it runs anything, so a depth
    it refuses (OutOfResources) has no effect and the next is tried; the depth that fits is remembered per
    kernel, device and settings. Tiles that fit at no depth (fp32 128 x 128 in the backward needs 256 KiB or
    more, over an H100's 227 KiB) stop with a one-line error that says what to change."""
    key = (kernel, args[0].device, tuple(sorted(meta.items())))
    refused = None
    for stages in (_fitting_stages[key],) if key in _fitting_stages else PIPELINE_STAGES:
        try:
            kernel[grid](*args, num_stages=stages, **meta)
        except OutOfResources as error:
            refused = error
            continue
        _fitting_stages[key] = stages
        return
    raise ValueError(f"triton kernel {kernel.__name__}: {args[0].dtype} tiles of block size {meta['BS']} and head dim "
                     f"{meta['D']} fit this GPU at no pipelining depth ({refused.name}: {refused.required} needed, "
                     f"{refused.limit} there); use bfloat16 or float16, or a smaller sparsity.block_size") from refused


class _TritonBlockSparseFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, idx, cnt, bs: int, scale: float, window: int | None):
        b, hq, L, d = q.shape
        nq = L // bs
        o = torch.empty_like(q)
        lse = torch.empty(b, hq, L, dtype=torch.float32, device=q.device)
        launch(_fwd_kernel, (nq, b * hq), q, k, v, o, lse, idx, cnt, scale * _LOG2E, window or 0, L, nq,
               idx.shape[-1], **kernel_constexprs(hq // k.shape[1], bs, d, window, q.dtype))
        ctx.save_for_backward(q, k, v, o, lse, idx, cnt)
        ctx.meta = (bs, scale, window)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, idx, cnt = ctx.saved_tensors
        bs, scale, window = ctx.meta
        b, hq, L, d = q.shape
        hkv, nq = k.shape[1], L // bs
        do = do.contiguous()
        common = kernel_constexprs(hq // hkv, bs, d, window, q.dtype)
        delta = torch.empty_like(lse)
        launch(_delta_kernel, (b * hq * nq,), o, do, delta, **delta_constexprs(common))
        dq = torch.empty_like(q)
        launch(_dq_kernel, (nq, b * hq), q, k, v, do, dq, lse, delta, idx, cnt, scale, scale * _LOG2E, window or 0, L,
               nq, idx.shape[-1], **common)
        tptr, tidx = _transposed_index(idx, cnt, nq)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        launch(_dkdv_kernel, (nq, b * hkv), q, k, v, do, dk, dv, lse, delta, tptr, tidx, scale, scale * _LOG2E,
               window or 0, L, nq, **common)
        return dq, dk, dv, None, None, None, None, None


def triton_block_sparse_attention(q, k, v, block_indices, block_counts, block_size: int, scale: float,
                                  window: int | None = None):
    """Exact block-sparse attention with the Triton kernels; q, k, v fp32, fp16 or bf16 (fp32 accumulation),
    head dim a power of two in 16..128, block size a power of two in 16..128."""
    if not TRITON_AVAILABLE:
        raise RuntimeError("triton is not installed (pip install 'sparsebalance-ft[triton]')")
    d = q.shape[-1]
    if d not in (16, 32, 64, 128) or block_size not in (16, 32, 64, 128):
        raise ValueError(f"triton kernel: head dim ({d}) and block size ({block_size}) must be 16, 32, 64 or 128")
    b, hkv, nq, kmax = block_indices.shape
    idx = block_indices.to(torch.int32).contiguous()
    if block_counts is None:
        cnt = torch.full((b, hkv, nq), kmax, dtype=torch.int32, device=idx.device)
    else:
        cnt = block_counts.to(torch.int32).contiguous()
    return _TritonBlockSparseFn.apply(q.contiguous(), k.contiguous(), v.contiguous(), idx, cnt, block_size, scale,
                                      window)
