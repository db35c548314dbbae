"""Exact block-sparse attention in PyTorch with its own autograd (CPU and GPU).

Layout: ``q [B, Hq, L, D]``, ``k, v [B, Hkv, L, D]``, ``L`` a multiple of the block size. A *row* is one
(batch, key-value head, query block); the GQA group's ``G = Hq / Hkv`` query heads of a row share its kept
key blocks. ``block_indices [B, Hkv, nq, K]`` lists kept key blocks per row, the first
``block_counts[b, h, i]`` entries valid. Within kept blocks the usual token-level causal rule applies
(key position <= query position, and ``key > query - window`` with a sliding window).

Forward, per chunk of rows (rows sorted by kept count so a chunk wastes little on padding slots):
gather the chunk's kept key/value blocks (``index_select``, memory = kept blocks of the chunk only), build
the chunk's additive token mask, and run softmax attention over exactly those keys, saving the
log-sum-exp per query row. Backward recomputes per chunk from the saved log-sum-exp (never an L x L
matrix), and scatters the key/value gradients back with ``index_add_``.

Two engines compute a chunk: on CPU the fused flash kernel of ATen
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward, which take an additive mask and
return the log-sum-exp); elsewhere, or when that op is missing, plain batched matmuls with float32
accumulation. A query row that sees no key (a row with no kept block, or a window that hides every kept
key) gets a zero output and zero gradients on both engines.

Attention sinks (GPT-OSS's learned per-head logit ``s_h``, a virtual key with no value) join each query
row's softmax denominator: ``O' = O * exp(lse - lse')`` with ``lse' = logaddexp(lse, s_h)``. The usual
flash backward run with (O', lse') is then exactly the gradient of the sink-augmented softmax for q, k
and v, and ``dL/ds_h = -sum_rows exp(s_h - lse') * rowsum(dO * O')``.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

_NEG_INF = float("-inf")


def _cpu_flash_ops():
    try:
        fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        return fwd, bwd
    except (AttributeError, RuntimeError):  # pragma: no cover - older or stripped torch builds
        return None


_CPU_FLASH = _cpu_flash_ops()


@dataclass
class Plan:
    """Rows of a call grouped into chunks; all index tensors are flat over rows R = B * Hkv * nq."""

    gidx: torch.Tensor  # [R, K] kept key blocks as global indices into the flat [B*Hkv*nk] block list
    lidx: torch.Tensor  # [R, K] kept key blocks as indices within the row's sequence
    counts: torch.Tensor  # [R]
    qblock: torch.Tensor  # [R] query block index of each row within its sequence
    chunks: list[tuple[torch.Tensor, int]]  # (rows of the chunk, K of the chunk), masked path
    # split path (every row keeps its diagonal block): the diagonal blocks in one causal call, the
    # off-diagonal kept blocks (fully visible, no mask) in chunks of rows with equal off-diagonal counts
    diag: torch.Tensor | None = None  # [R] global index of each row's diagonal block
    off_gidx: torch.Tensor | None = None  # [R, K-1] off-diagonal kept blocks, compacted to the front
    off_chunks: list[tuple[torch.Tensor, int]] | None = None


def _group_chunks(counts: torch.Tensor, chunk_blocks: int) -> list[tuple[torch.Tensor, int]]:
    """Rows with equal counts (count > 0) grouped, each group split so a chunk gathers <= chunk_blocks."""
    order = torch.argsort(counts, stable=True)
    sc = counts[order]
    values, sizes = torch.unique_consecutive(sc, return_counts=True)
    chunks = []
    start = 0
    for c, size in zip(values.tolist(), sizes.tolist()):
        if c > 0:
            per = max(1, chunk_blocks // c)
            for a in range(start, start + size, per):
                chunks.append((order[a:min(start + size, a + per)], c))
        start += size
    return chunks


def make_plan(block_indices: torch.Tensor, block_counts: torch.Tensor | None, num_kv_blocks: int,
              chunk_blocks: int = 256) -> Plan:
    b, hkv, nq, kk = block_indices.shape
    dev = block_indices.device
    lidx = block_indices.reshape(b * hkv * nq, kk).long()
    if block_counts is None:
        counts = torch.full((b * hkv * nq,), kk, dtype=torch.long, device=dev)
    else:
        counts = block_counts.reshape(-1).long()
    base = (torch.arange(b * hkv, device=dev) * num_kv_blocks).repeat_interleave(nq)
    gidx = lidx + base[:, None]
    qblock = torch.arange(nq, device=dev).repeat(b * hkv)
    order = torch.argsort(counts, stable=True)
    sorted_counts = counts[order].tolist()
    chunks: list[tuple[torch.Tensor, int]] = []
    start = 0
    r = len(sorted_counts)
    while start < r:
        end = start + 1
        kc = max(1, sorted_counts[start])
        while end < r and (end - start + 1) * max(1, sorted_counts[end]) <= chunk_blocks:
            kc = max(1, sorted_counts[end])
            end += 1
        chunks.append((order[start:end], kc))
        start = end
    plan = Plan(gidx, lidx, counts, qblock, chunks)
    slot = torch.arange(kk, device=dev)
    valid = slot[None, :] < counts[:, None]
    is_diag = valid & (lidx == qblock[:, None])
    if nq == num_kv_blocks and bool((is_diag.sum(-1) == 1).all()):
        off = valid & ~is_diag
        key = torch.where(off, slot[None, :], slot[None, :] + kk)
        order2 = key.argsort(dim=-1, stable=True)
        plan.off_gidx = gidx.gather(-1, order2)[:, : max(kk - 1, 1)].contiguous()
        plan.diag = base + qblock
        plan.off_chunks = _group_chunks(off.sum(-1), chunk_blocks)
    return plan


def _chunk_mask(plan: Plan, rows: torch.Tensor, kc: int, bs: int, window: int | None, dtype, device):
    """Additive mask [n, 1, bs, kc*bs]: 0 where the key is kept and causally visible, -inf elsewhere."""
    ar = torch.arange(bs, device=device)
    li = plan.lidx[rows, :kc]
    kpos = (li[:, :, None] * bs + ar).reshape(len(rows), 1, kc * bs)  # [n, 1, kc*bs]
    qpos = (plan.qblock[rows, None] * bs + ar)[:, :, None]  # [n, bs, 1]
    ok = kpos <= qpos
    if window is not None:
        ok &= kpos > qpos - window
    valid = (torch.arange(kc, device=device)[None, :] < plan.counts[rows, None])  # [n, kc]
    ok &= valid.repeat_interleave(bs, dim=1)[:, None, :]
    mask = torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill_(~ok, _NEG_INF)
    return mask[:, None]


def _use_cpu_flash(q: torch.Tensor) -> bool:
    return _CPU_FLASH is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _fwd_chunk(qc, kg, vg, mask, scale, flash: bool):
    """qc [n,G,bs,D], kg/vg [n,1,kc*bs,D], mask [n,1,bs,kc*bs] -> (out [n,G,bs,D], lse [n,G,bs] fp32)."""
    n, g = qc.shape[:2]
    if flash:
        out, lse = _CPU_FLASH[0](qc, kg.expand(n, g, *kg.shape[2:]), vg.expand(n, g, *vg.shape[2:]),
                                 attn_mask=mask, scale=scale)
        return out, lse
    acc = _lse_dtype(qc.dtype)
    s = torch.matmul(qc.to(acc), kg.to(acc).transpose(-1, -2)).mul_(scale).add_(mask.to(acc))
    m = s.amax(-1, keepdim=True)
    m = m.masked_fill(m == _NEG_INF, 0.0)  # a row that sees no key: exp(-inf - 0) = 0, not nan
    s.sub_(m).exp_()
    l_ = s.sum(-1, keepdim=True)
    out = torch.matmul(s, vg.to(acc)).div_(l_.clamp(min=torch.finfo(acc).tiny))  # 0 / tiny = 0 for such a row
    return out.to(qc.dtype), (m + l_.log()).squeeze(-1)


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _bwd_chunk(go, qc, kg, vg, out, lse, mask, scale, flash: bool):
    """Returns dq [n,G,bs,D], dk [n,kc*bs,D], dv [n,kc*bs,D] (the latter two summed over the group)."""
    n, g = qc.shape[:2]
    if flash:
        gq, gk, gv = _CPU_FLASH[1](go, qc, kg.expand(n, g, *kg.shape[2:]), vg.expand(n, g, *vg.shape[2:]),
                                   out, lse, 0.0, False, attn_mask=mask, scale=scale)
        return gq, gk.sum(1), gv.sum(1)
    acc = _lse_dtype(qc.dtype)
    qf, kf, vf, gof = qc.to(acc), kg.to(acc), vg.to(acc), go.to(acc)
    lse = lse.masked_fill(lse == _NEG_INF, 0.0)  # rows that saw no key: every p is exp(-inf) = 0
    p = torch.matmul(qf, kf.transpose(-1, -2)).mul_(scale).add_(mask.to(acc)).sub_(lse[..., None]).exp_()
    delta = (gof * out.to(acc)).sum(-1, keepdim=True)
    dv = torch.matmul(p.transpose(-1, -2), gof).sum(1)
    dp = torch.matmul(gof, vf.transpose(-1, -2))
    ds = dp.sub_(delta).mul_(p)
    dq = torch.matmul(ds, kf).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), qf).sum(1).mul_(scale)
    return dq.to(qc.dtype), dk, dv


def _rows_view(q: torch.Tensor, hkv: int, bs: int) -> torch.Tensor:
    """[B, Hq, L, D] -> [R, G, bs, D] (a copy)."""
    b, hq, L, d = q.shape
    g = hq // hkv
    nq = L // bs
    return q.reshape(b, hkv, g, nq, bs, d).permute(0, 1, 3, 2, 4, 5).reshape(b * hkv * nq, g, bs, d)


def _rows_unview(x: torch.Tensor, b: int, hkv: int, bs: int) -> torch.Tensor:
    """[R, G, bs, D] -> [B, Hq, L, D]."""
    r, g, _, d = x.shape
    nq = r // (b * hkv)
    return x.reshape(b, hkv, nq, g, bs, d).permute(0, 1, 3, 2, 4, 5).reshape(b, hkv * g, nq * bs, d)


class _Workers:
    """Chunk-level parallelism on CPU: W Python threads, each running single-threaded ATen kernels.

    Many medium-sized kernel calls each opening an OpenMP parallel region scale badly when the cores
    are shared (every region ends in a barrier that waits for a descheduled thread); independent
    chunks on single-threaded workers avoid the barriers. W = torch.get_num_threads() of the caller.
    """

    def __init__(self):
        self._pool = None
        self._size = 0
        self._lock = threading.Lock()

    def pool(self, size: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._size != size:
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                self._pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="sbft-attn",
                                                initializer=torch.set_num_threads, initargs=(1,))
                self._size = size
            return self._pool

    def map(self, fn, items: list, cost=None) -> list:
        """Run fn over items; results in order. Largest cost first for balance."""
        width = torch.get_num_threads()
        if width <= 1 or len(items) <= 1 or not PARALLEL_CHUNKS:
            return [fn(it) for it in items]
        order = sorted(range(len(items)), key=(lambda i: -cost(items[i])) if cost else (lambda i: i))
        pool = self.pool(width)
        prev = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            futures = {i: pool.submit(_no_grad_call, fn, items[i]) for i in order}
            return [futures[i].result() for i in range(len(items))]
        finally:
            torch.set_num_threads(prev)


def _no_grad_call(fn, item):
    with torch.no_grad():  # grad mode is thread-local; kernels of an autograd.Function run without it
        return fn(item)


_WORKERS = _Workers()
PARALLEL_CHUNKS = True


def _row_slices(r: int, parts: int) -> list[slice]:
    step = -(-r // max(1, parts))
    return [slice(a, min(r, a + step)) for a in range(0, r, step)]


def _diagonal_blocks(kb, vb, plan: Plan, sl: slice, g: int):
    """Each row's own (diagonal) key and value block, shared by the row's `g` query heads."""
    n, bs, d = sl.stop - sl.start, kb.shape[1], kb.shape[2]
    kd = kb.index_select(0, plan.diag[sl]).view(n, 1, bs, d).expand(n, g, bs, d)
    vd = vb.index_select(0, plan.diag[sl]).view(n, 1, bs, d).expand(n, g, bs, d)
    return kd, vd


def _kept_off_diagonal_blocks(kb, vb, plan: Plan, rows, c: int):
    """The `c` kept off-diagonal key and value blocks of each of `rows`, gathered into one sequence,
    with the block indices they came from (where backward scatters their gradients)."""
    n, bs, d = rows.numel(), kb.shape[1], kb.shape[2]
    gi = plan.off_gidx[rows, :c].reshape(-1)
    return gi, kb.index_select(0, gi).view(n, 1, c * bs, d), vb.index_select(0, gi).view(n, 1, c * bs, d)


def _split_forward(qr, kb, vb, plan: Plan, bs: int, scale: float):
    """Diagonal blocks (causal flash calls) merged by log-sum-exp with the off-diagonal kept blocks
    (unmasked flash calls per chunk of rows with equal off-diagonal counts)."""
    r, g, _, d = qr.shape
    fwd = _CPU_FLASH[0]
    out = torch.empty_like(qr)
    lse = torch.empty(qr.shape[:3], dtype=_lse_dtype(qr.dtype), device=qr.device)

    def diag_part(sl: slice):
        kd, vd = _diagonal_blocks(kb, vb, plan, sl, g)
        o, l_ = fwd(qr[sl], kd, vd, is_causal=True, scale=scale)
        out[sl] = o
        lse[sl] = l_

    _WORKERS.map(diag_part, _row_slices(r, 4 * torch.get_num_threads()))

    def off_part(item):
        rows, c = item
        n = rows.numel()
        gi, kg, vg = _kept_off_diagonal_blocks(kb, vb, plan, rows, c)
        o2, l2 = fwd(qr.index_select(0, rows).view(n, 1, g * bs, d), kg, vg, scale=scale)
        o1 = out.index_select(0, rows)
        l1 = lse.index_select(0, rows)
        l2 = l2.view(n, g, bs)
        lt = torch.logaddexp(l1, l2)
        w1 = (l1 - lt).exp_().unsqueeze(-1).to(o1.dtype)
        w2 = (l2 - lt).exp_().unsqueeze(-1).to(o1.dtype)
        merged = o1.mul_(w1).add_(o2.view(n, g, bs, d).mul_(w2))
        out.index_copy_(0, rows, merged)
        lse.index_copy_(0, rows, lt)

    _WORKERS.map(off_part, plan.off_chunks, cost=lambda it: it[0].numel() * it[1])
    return out, lse


def _split_backward(go, qr, kb, vb, out, lse, plan: Plan, bs: int, scale: float):
    """Each part's flash backward with the *merged* output and log-sum-exp gives exactly that part's
    share of the gradient (P = exp(S - lse_total), delta = rowsum(dO * O_total))."""
    r, g, _, d = qr.shape
    bwd = _CPU_FLASH[1]
    acc = torch.float32 if kb.dtype in (torch.float16, torch.bfloat16) else kb.dtype
    dq = torch.empty(qr.shape, dtype=acc, device=qr.device)
    dk = torch.zeros(kb.shape, dtype=acc, device=kb.device)
    dv = torch.zeros(vb.shape, dtype=acc, device=vb.device)

    def diag_part(sl: slice):
        kd, vd = _diagonal_blocks(kb, vb, plan, sl, g)
        gq, gk, gv = bwd(go[sl], qr[sl], kd, vd, out[sl], lse[sl], 0.0, True, scale=scale)
        dq[sl] = gq
        # each row's diagonal block is its own: rows of different slices touch different blocks
        dk.index_add_(0, plan.diag[sl], gk.sum(1, dtype=acc))
        dv.index_add_(0, plan.diag[sl], gv.sum(1, dtype=acc))

    _WORKERS.map(diag_part, _row_slices(r, 4 * torch.get_num_threads()))

    locals_: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    lock = threading.Lock()

    def off_part(item):
        rows, c = item
        n = rows.numel()
        gi, kg, vg = _kept_off_diagonal_blocks(kb, vb, plan, rows, c)
        gq, gk, gv = bwd(go.index_select(0, rows).view(n, 1, g * bs, d), qr.index_select(0, rows).view(n, 1, g * bs, d),
                         kg, vg, out.index_select(0, rows).view(n, 1, g * bs, d),
                         lse.index_select(0, rows).view(n, 1, g * bs), 0.0, False, scale=scale)
        dq.index_add_(0, rows, gq.view(n, g, bs, d).to(acc))  # rows of different chunks are disjoint
        tid = threading.get_ident()
        with lock:
            if tid not in locals_:
                locals_[tid] = (torch.zeros_like(dk), torch.zeros_like(dv))
            adk, adv = locals_[tid]
        adk.index_add_(0, gi, gk.reshape(n * c, bs, d).to(acc))
        adv.index_add_(0, gi, gv.reshape(n * c, bs, d).to(acc))

    _WORKERS.map(off_part, plan.off_chunks, cost=lambda it: it[0].numel() * it[1])
    for adk, adv in locals_.values():
        dk.add_(adk)
        dv.add_(adv)
    return dq.to(qr.dtype), dk.to(kb.dtype), dv.to(vb.dtype)


def _row_sinks(sinks: torch.Tensor, b: int, hkv: int, nq: int, dtype) -> torch.Tensor:
    """Per-query-head sink logits [Hq] -> [R, G, 1] in the row layout (rows ordered batch, kv head, q block)."""
    g = sinks.numel() // hkv
    return sinks.to(dtype).view(1, hkv, 1, g).expand(b, hkv, nq, g).reshape(b * hkv * nq, g, 1)


def _add_sinks(out: torch.Tensor, lse: torch.Tensor, sink_rows: torch.Tensor):
    """Fold each row's sink logit into its softmax: (O * exp(lse - lse'), lse'), lse' = logaddexp(lse, s)."""
    lse_total = torch.logaddexp(lse, sink_rows)
    return out * (lse - lse_total).exp().unsqueeze(-1).to(out.dtype), lse_total


def _sink_grad(go, out, lse, sink_rows, b: int, hkv: int, nq: int) -> torch.Tensor:
    """dL/ds_h = -sum over rows of head h of exp(s_h - lse') * rowsum(dO * O') -> [Hq]."""
    delta = (go.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # [R, G, bs]
    per_row = -((sink_rows - lse).exp() * delta).sum(-1)  # [R, G]
    return per_row.view(b, hkv, nq, -1).sum((0, 2)).reshape(-1)


class BlockSparseAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, plan: Plan, bs: int, scale: float, window: int | None):
        b, hq, L, d = q.shape
        hkv = k.shape[1]
        flash = _use_cpu_flash(q)
        qr = _rows_view(q, hkv, bs)
        kb = k.reshape(b * hkv * (k.shape[2] // bs), bs, d)
        vb = v.reshape(b * hkv * (v.shape[2] // bs), bs, d)
        split = flash and window is None and plan.diag is not None
        if split:
            out, lse = _split_forward(qr, kb, vb, plan, bs, scale)
        else:
            out, lse = _masked_forward(qr, kb, vb, plan, bs, scale, window, flash)
        sink_rows = None
        if sinks is not None:
            sink_rows = _row_sinks(sinks, b, hkv, L // bs, lse.dtype)
            out, lse = _add_sinks(out, lse, sink_rows)
        ctx.save_for_backward(qr, kb, vb, out, lse, sink_rows)
        ctx.meta = (plan, bs, scale, window, b, hkv, tuple(k.shape), flash, split, None if sinks is None else sinks.dtype)
        return _rows_unview(out, b, hkv, bs)

    @staticmethod
    def backward(ctx, grad_out):
        qr, kb, vb, out, lse, sink_rows = ctx.saved_tensors
        plan, bs, scale, window, b, hkv, kshape, flash, split, sink_dtype = ctx.meta
        go = _rows_view(grad_out.contiguous(), hkv, bs)
        if split:
            dq, dk, dv = _split_backward(go, qr, kb, vb, out, lse, plan, bs, scale)
        else:
            dq, dk, dv = _masked_backward(go, qr, kb, vb, out, lse, plan, bs, scale, window, flash)
        dsinks = None
        if sink_rows is not None:
            dsinks = _sink_grad(go, out, lse, sink_rows, b, hkv, kshape[2] // bs).to(sink_dtype)
        return (_rows_unview(dq, b, hkv, bs), dk.reshape(kshape), dv.reshape(kshape), dsinks,
                None, None, None, None)


def _chunk_gathers(qr, kb, vb, plan: Plan, bs: int, window: int | None, flash: bool):
    """Per chunk of rows: (rows, flat kept-block ids, gathered K, gathered V, additive causal/window mask),
    the same gathers for the forward and its backward."""
    d = qr.shape[-1]
    mdtype = qr.dtype if flash else _lse_dtype(qr.dtype)
    for rows, kc in plan.chunks:
        gi = plan.gidx[rows, :kc].reshape(-1)
        n = rows.numel()
        kg = kb.index_select(0, gi).view(n, 1, kc * bs, d)
        vg = vb.index_select(0, gi).view(n, 1, kc * bs, d)
        yield rows, gi, kg, vg, _chunk_mask(plan, rows, kc, bs, window, mdtype, qr.device)


def _masked_forward(qr, kb, vb, plan: Plan, bs: int, scale: float, window: int | None, flash: bool):
    """Every chunk of rows over its gathered kept blocks, with the chunk's additive causal/window mask."""
    out = torch.empty_like(qr)
    lse = torch.empty(qr.shape[:3], dtype=_lse_dtype(qr.dtype), device=qr.device)
    for rows, _, kg, vg, mask in _chunk_gathers(qr, kb, vb, plan, bs, window, flash):
        o, l_ = _fwd_chunk(qr.index_select(0, rows), kg, vg, mask, scale, flash)
        out.index_copy_(0, rows, o)
        lse.index_copy_(0, rows, l_)
    return out, lse


def _masked_backward(go, qr, kb, vb, out, lse, plan: Plan, bs: int, scale: float, window: int | None, flash: bool):
    d = qr.shape[-1]
    dq = torch.zeros_like(qr)
    acc = torch.float32 if kb.dtype in (torch.float16, torch.bfloat16) else kb.dtype
    dk = torch.zeros(kb.shape, dtype=acc, device=kb.device)
    dv = torch.zeros(vb.shape, dtype=acc, device=vb.device)
    for rows, gi, kg, vg, mask in _chunk_gathers(qr, kb, vb, plan, bs, window, flash):
        gq, gk, gv = _bwd_chunk(go.index_select(0, rows), qr.index_select(0, rows), kg, vg,
                                out.index_select(0, rows), lse.index_select(0, rows), mask, scale, flash)
        dq.index_copy_(0, rows, gq.to(dq.dtype))
        dk.index_add_(0, gi, gk.reshape(-1, bs, d).to(acc))
        dv.index_add_(0, gi, gv.reshape(-1, bs, d).to(acc))
    return dq, dk.to(kb.dtype), dv.to(vb.dtype)


def torch_block_sparse_attention(q, k, v, plan: Plan, block_size: int, scale: float, window: int | None = None,
                                 sinks: torch.Tensor | None = None):
    return BlockSparseAttentionFn.apply(q.contiguous(), k.contiguous(), v.contiguous(), sinks, plan, block_size,
                                        scale, window)
