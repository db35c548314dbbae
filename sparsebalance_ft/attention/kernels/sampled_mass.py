"""The selection's sampled scores in one Triton kernel: each sampled query token's softmax mass per key block,
computed flash-style without ever writing the logits.

Why: the torch path (`selection._sampled_shares`) writes every sampled token's logits over its whole causal
span, then masks, normalises and sums them per block: a few passes over hq x 4 x (L / block) x L elements
per layer (2.4 G at 64K tokens for SmolLM2's 9 heads). On a GPU that is memory traffic plus a few dozen
launches per chunk of query blocks, and it made the selection 79% of the sparse attention's time on an H200
at 64K (`bench_results/gpu/step-triton.json`, measured before this kernel). Here the logits live only in
registers: a first pass over the key blocks finds each sampled row's softmax maximum and normaliser, a
second recomputes the probabilities and sums them per key block (one tile is one block), averaged over the
row's query block's samples and its group's query heads. Status: checked against a float64 per-token
reference under triton's interpreter and compiled here for sm_80, sm_89 and sm_90a (`make triton-compile`),
never run on a GPU; `make gpu-check` runs and times it.

One program takes `R` consecutive query blocks of one key-value head: their `G` query heads x `S` samples,
padded to `GP` rows each, make one tile of R x GP rows, so every key tile loaded serves R blocks.
"""
from __future__ import annotations

import torch

from .triton import TRITON_AVAILABLE, interpreting, launch

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

_LOG2E = 1.4426950408889634
_TILE_ROWS = 64  # sampled rows per program: R query blocks x GP padded rows each
_SIZES = (16, 32, 64, 128)  # head dims and block sizes the tiles take (tl.dot wants powers of two >= 16)


def fused_sampling_available(device: torch.device, head_dim: int, block_size: int) -> bool:
    """Whether the selection scores its sampled queries with this kernel: triton installed, the tensors on
    CUDA (or the interpreter on, for the tests), tile sizes it takes."""
    return (TRITON_AVAILABLE and (device.type == "cuda" or interpreting())
            and head_dim in _SIZES and block_size in _SIZES)


if TRITON_AVAILABLE:

    @triton.jit
    def _visible_scores(q, K, TOKENS, kh, j, qpos, lo, valid, window, L,
                        BS: tl.constexpr, D: tl.constexpr, HAS_WINDOW: tl.constexpr, PREC: tl.constexpr):
        """Base-2 scores of the sampled rows against key block j, -inf where a row may not see a key: a
        padding key, a later one, one before its document's first allowed block, or one outside the window."""
        offs_n = j * BS + tl.arange(0, BS)
        k = tl.load(K + (kh * L + offs_n)[:, None] * D + tl.arange(0, D)[None, :])
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        real = tl.arange(0, BS) < tl.load(TOKENS + j)
        ok = (valid & (j >= lo))[:, None] & real[None, :] & (offs_n[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            ok = ok & (offs_n[None, :] > qpos[:, None] - window)
        return tl.where(ok, s, float("-inf"))

    @triton.jit
    def _sampled_mass_kernel(Q, K, QPOS, LO, TOKENS, Out, qk_scale, window, L, C, NK, I0, K0,
                             G: tl.constexpr, S: tl.constexpr, GP: tl.constexpr, R: tl.constexpr,
                             BS: tl.constexpr, D: tl.constexpr, HAS_WINDOW: tl.constexpr, PREC: tl.constexpr):
        first = tl.program_id(0) * R  # the program's first query block, counted from the chunk's
        kh = tl.program_id(1).to(tl.int64)
        slot = tl.arange(0, R * GP)
        row = first + slot // GP
        w = slot % GP  # query head in the group x sample, padded
        valid = (w < G * S) & (row < C)
        qpos = tl.load(QPOS + row * S + w % S, mask=valid, other=0)
        lo = tl.load(LO + row, mask=valid, other=0)
        qh = kh * G + w // S
        q = tl.load(Q + (qh * L + qpos)[:, None] * D + tl.arange(0, D)[None, :], mask=valid[:, None], other=0.0)
        q = (q.to(tl.float32) * qk_scale).to(K.dtype.element_ty)
        j_lo = tl.min(tl.where(valid, lo, I0 + C), 0)
        j_hi = I0 + tl.minimum(first + R, C)  # one past the last row's diagonal block
        m_i = tl.full([R * GP], float("-inf"), tl.float32)
        l_i = tl.zeros([R * GP], tl.float32)
        for j in range(j_lo, j_hi):
            s = _visible_scores(q, K, TOKENS, kh, j, qpos, lo, valid, window, L, BS, D, HAS_WINDOW, PREC)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: exp2 gives 0, not NaN
            l_i = l_i * tl.math.exp2(m_i - m_ref) + tl.sum(tl.math.exp2(s - m_ref[:, None]), 1)
            m_i = m_new
        m_ref = tl.where(m_i == float("-inf"), 0.0, m_i)
        # the softmax's normaliser and the average's; a padding row saw nothing (l = 0), and its scores are -inf
        weight = 1.0 / (tl.where(l_i > 0, l_i, 1.0) * (G * S))
        rows = first + tl.arange(0, R)
        owner = (tl.arange(0, R)[:, None] == (slot // GP)[None, :]).to(tl.float32)  # [R, R * GP]
        diag = I0 + rows
        lo_r = tl.load(LO + rows, mask=rows < C, other=0)
        for j in range(j_lo, j_hi):
            s = _visible_scores(q, K, TOKENS, kh, j, qpos, lo, valid, window, L, BS, D, HAS_WINDOW, PREC)
            row_mass = tl.sum(tl.math.exp2(s - m_ref[:, None]), 1) * weight
            mass = tl.sum(owner * row_mass[None, :], 1)
            tl.store(Out + (kh * C + rows) * NK + (j - K0), mass, mask=(rows < C) & (j >= lo_r) & (j <= diag))


def sampled_block_mass(q: torch.Tensor, k: torch.Tensor, qpos: torch.Tensor, lo: torch.Tensor,
                       block_tokens: torch.Tensor, block_size: int, i0: int, i1: int, k0: int,
                       window: int | None, scale: float, per_block: int) -> torch.Tensor:
    """[Hkv, C, nk] for query blocks i0..i1-1 and key blocks k0..i1-1: what `selection._sampled_shares`
    computes, in one launch. q: [Hq, P, D] and k: [Hkv, P, D] in the layout, contiguous, k in the scoring
    precision (q is cast to it); qpos: [C * per_block] the sampled positions; lo: each query block's first
    allowed key block (all of them); block_tokens: each block's real tokens."""
    hq, length, d = q.shape
    hkv = k.shape[0]
    rows, keys = i1 - i0, i1 - k0
    meta = kernel_constexprs(hq // hkv, per_block, block_size, d, window, k.dtype)
    out = torch.zeros(hkv, rows, keys, dtype=torch.float32, device=q.device)
    launch(_sampled_mass_kernel, (triton.cdiv(rows, meta["R"]), hkv), q, k, qpos.to(torch.int32),
           lo[i0:i1].to(torch.int32), block_tokens.to(torch.int32), out, scale * _LOG2E, window or 0, length, rows,
           keys, i0, k0, **meta)
    return out


def kernel_constexprs(group: int, per_block: int, block_size: int, d: int, window: int | None,
                      dtype: torch.dtype) -> dict:
    """The kernel's compile-time settings for keys of `dtype` (the scoring precision): what the selection
    launches and `bench/triton_compile.py` compiles for GPUs this machine lacks. A query block's G x S sampled
    rows are padded to a power of two (GP) for the tile, and R blocks share one program's rows."""
    padded = triton.next_power_of_2(group * per_block)
    return {"G": group, "S": per_block, "GP": padded, "R": max(1, _TILE_ROWS // padded), "BS": block_size, "D": d,
            "HAS_WINDOW": window is not None, "PREC": "ieee" if dtype == torch.float32 else None, "num_warps": 4}
