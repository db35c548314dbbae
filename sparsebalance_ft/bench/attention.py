"""Benchmark of one attention layer, forward + backward: block-sparse vs dense causal SDPA.

For each length and target density the sparse path is what training runs (selection with the density
forced, the plan, the kernel, its backward); dense is `scaled_dot_product_attention(is_causal=True)` with
GQA. The two are measured alternately in one process so that drifting machine load hits both alike.
Density 1.0 goes through the production full-budget route: exact dense computation (fused SDPA), with
the report still counting every causal block; `kernel_at_full=True` also times the sparse kernel itself
keeping every block ("full-kernel" rows).
"""
from __future__ import annotations

import gc
import math
import os
import platform
import statistics
import threading
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..attention.budget import SparseAttentionController
from ..attention.config import SparsityConfig
from ..attention.kernels import make_plan, resolve_backend
from ..attention.kernels import block_sparse_attention as _kernel
from ..attention.selection import make_layout

DEFAULT_LENGTHS = (4096, 8192, 16384, 32768)
DEFAULT_DENSITIES = (0.05, 0.1, 0.25, 1.0)


@dataclass
class BenchRow:
    length: int
    target_density: float
    density: float
    route: str
    sparse_s: float
    dense_s: float | None
    speedup: float | None
    ideal_speedup: float
    share_of_ideal: float | None
    selection_s: float
    selection_share: float
    sparse_peak_mb: float | None
    dense_peak_mb: float | None


def _libc():
    try:
        import ctypes
        import ctypes.util

        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:  # pragma: no cover
        return None


def _tight_malloc() -> None:
    """glibc only: serve blocks >= 64 KiB by mmap so that freed tensors leave the resident set at once;
    then RSS above a baseline tracks live tensor memory, which is what the CPU peak below samples."""
    libc = _libc()
    try:
        if libc is not None:
            libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    except AttributeError:  # pragma: no cover - not glibc
        pass


def _trim() -> None:
    libc = _libc()
    try:
        if libc is not None:
            libc.malloc_trim(0)
    except AttributeError:  # pragma: no cover
        pass


class PeakMemory:
    """Peak memory while the block runs, above the starting point (`peak_mb`) and in all (`peak_bytes`).
    CPU: RSS sampled every 5 ms after trimming the heap (glibc keeps some freed memory resident unless
    `_tight_malloc` ran, so an upper bound); CUDA: the allocator's peak."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_mb: float | None = None
        self.peak_bytes: int | None = None

    @staticmethod
    def _rss() -> int | None:
        try:
            with open("/proc/self/statm") as fh:
                return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        _trim()
        self._base = self._rss()
        self._max = self._base or 0
        self._stop = threading.Event()

        def sample():
            while not self._stop.wait(0.005):
                r = self._rss()
                if r is not None and r > self._max:
                    self._max = r

        self._thread = threading.Thread(target=sample, daemon=True)
        if self._base is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            self.peak_mb = (self.peak_bytes - self._base) / 2**20
            return False
        if self._base is not None:
            self._stop.set()
            self._thread.join()
            r = self._rss()
            self._max = max(self._max, r or 0)
            self.peak_bytes = int(self._max)
            self.peak_mb = (self._max - self._base) / 2**20
        return False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inputs(length: int, heads: int, kv_heads: int, head_dim: int, dtype, device, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(1, heads, length, head_dim, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
    k = torch.randn(1, kv_heads, length, head_dim, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
    v = torch.randn(1, kv_heads, length, head_dim, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
    go = torch.randn(1, heads, length, head_dim, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
    return [t.requires_grad_(t is not go) for t in (q, k, v)] + [go]


def _dense_step(q, k, v, go, device, now=time.perf_counter):
    t = now()
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    o.backward(go)
    _sync(device)
    return now() - t


def _sparse_step(q, k, v, go, cfg: SparsityConfig, density: float, full_route: bool, device, now=time.perf_counter):
    """Returns (total seconds, selection seconds, achieved density, route)."""
    bs = cfg.block_size
    length = q.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    t0 = now()
    if density >= 1.0 and full_route:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        o.backward(go)
        _sync(device)
        return now() - t0, 0.0, 1.0, "dense-sdpa"
    layout = make_layout([length], bs, q.device)
    sel = SparseAttentionController(cfg).select(q[0].detach(), k[0].detach(), layout, cfg.budget, scale,
                                                force_density=min(density, 1.0))
    backend = resolve_backend(cfg.backend, q.device)
    plan = make_plan(sel.indices[None], sel.counts[None], layout.num_blocks, cfg.chunk_blocks) if backend == "torch" else None
    _sync(device)
    t_sel = now() - t0
    o = _kernel(q, k, v, sel.indices[None], sel.counts[None], block_size=bs, scale=scale, backend=backend,
                chunk_blocks=cfg.chunk_blocks, plan=plan)
    o.backward(go)
    _sync(device)
    total = now() - t0
    achieved = sel.density
    return total, t_sel, achieved, "full-kernel" if density >= 1.0 else f"sparse-{backend}"


def run_attention_bench(
    lengths=DEFAULT_LENGTHS,
    densities=DEFAULT_DENSITIES,
    repeats: int = 1,
    heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 64,
    dtype: str = "float32",
    device: str = "cpu",
    backend: str = "auto",
    dense: bool = True,
    kernel_at_full: bool = False,
    warmup: bool = True,
    seed: int = 0,
    progress=None,
    clock: str = "wall",
) -> dict:
    """Time sparse vs dense attention (one layer, forward + backward). Returns a JSON-able dict.

    `clock="cpu"` times with this process's CPU time (CPU only, meant for one torch thread): on a machine
    shared with other jobs it measures the work itself, not the time spent waiting for a core."""
    from ..profiling.profiler import CLOCKS

    now = CLOCKS[clock]
    dev = torch.device(device)
    dt = getattr(torch, dtype)
    if dev.type == "cpu":
        _tight_malloc()
    cfg = SparsityConfig(block_size=block_size, backend=backend)
    rows: list[BenchRow] = []
    cases = [(d, True) for d in densities]
    if kernel_at_full:
        cases.append((1.0, False))
    for length in lengths:
        length = int(math.ceil(length / block_size) * block_size)
        q, k, v, go = _inputs(length, heads, kv_heads, head_dim, dt, dev, seed)
        if warmup:
            small = _inputs(min(length, 4 * block_size), heads, kv_heads, head_dim, dt, dev, seed)
            _dense_step(*small, dev)
            _sparse_step(*small, cfg, 0.5, True, dev)
        dense_times: list[float] = []
        dense_peak: list[float] = []
        per_case: dict[tuple[float, bool], list] = {c: [] for c in cases}
        for _ in range(repeats):
            for case in cases:
                if dense:
                    for t in (q, k, v):
                        t.grad = None
                    gc.collect()
                    with PeakMemory(dev) as mem:
                        dense_times.append(_dense_step(q, k, v, go, dev, now))
                    if mem.peak_mb is not None:
                        dense_peak.append(mem.peak_mb)
                for t in (q, k, v):
                    t.grad = None
                gc.collect()
                with PeakMemory(dev) as mem:
                    res = _sparse_step(q, k, v, go, cfg, case[0], case[1], dev, now)
                per_case[case].append((*res, mem.peak_mb))
                if progress is not None:
                    progress(length, case[0], res[0], dense_times[-1] if dense else None)
        d_med = statistics.median(dense_times) if dense_times else None
        for case in cases:
            runs = per_case[case]
            s_med = statistics.median(r[0] for r in runs)
            sel_med = statistics.median(r[1] for r in runs)
            achieved = runs[0][2]
            ideal = 1.0 / achieved
            speed = d_med / s_med if d_med else None
            peaks = [r[4] for r in runs if r[4] is not None]
            rows.append(BenchRow(
                length=length, target_density=case[0], density=achieved, route=runs[0][3], sparse_s=s_med,
                dense_s=d_med, speedup=speed, ideal_speedup=ideal,
                share_of_ideal=(speed / ideal) if speed else None, selection_s=sel_med,
                selection_share=sel_med / s_med if s_med > 0 else 0.0,
                sparse_peak_mb=max(peaks) if peaks else None,
                dense_peak_mb=max(dense_peak) if dense_peak else None,
            ))
        del q, k, v, go
        gc.collect()
    return {
        "setup": {
            "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "block_size": block_size, "dtype": dtype,
            "device": device, "backend": resolve_backend(backend, dev), "repeats": repeats, "batch": 1,
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "dense": "torch.nn.functional.scaled_dot_product_attention(is_causal=True, enable_gqa=True)",
            "measured": "forward + backward of one attention layer, sparse and dense alternately",
            "clock": "process CPU time" if clock == "cpu" else "wall clock",
        },
        "rows": [asdict(r) for r in rows],
    }
