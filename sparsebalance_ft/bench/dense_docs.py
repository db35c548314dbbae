"""Benchmark: dense causal attention over a packed row of documents, forward + backward, one SDPA call per
document (the previous `_dense_docs`) against the one fused block-sparse kernel call keeping every causal
block of each document (what the full-budget route now runs). Measured alternately in one process
(median of `repeats`), single-threaded; JSON with the side-by-side ratio.

    python -m sparsebalance_ft.bench.dense_docs --out bench_results/dense_docs.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..attention.register import _dense_docs
from ..attention.selection import Layout, make_layout

MIXES = ([2000, 1000, 600, 300, 150, 46], [256] * 16, [3000, 2500, 1500, 800, 392])


def sdpa_per_document(qp, kp, vp, layout: Layout, scale: float) -> torch.Tensor:
    """The baseline: fused SDPA once per document in a Python loop."""
    outs, start, bs = [], 0, layout.block_size
    for n in layout.doc_lengths:
        sl = slice(start, start + max(1, -(-n // bs)) * bs)
        outs.append(F.scaled_dot_product_attention(qp[:, :, sl], kp[:, :, sl], vp[:, :, sl], is_causal=True,
                                                   scale=scale, enable_gqa=qp.shape[1] != kp.shape[1]))
        start = sl.stop
    return torch.cat(outs, dim=2)


def _timed(fn, q, k, v) -> tuple[float, torch.Tensor]:
    for t in (q, k, v):
        t.grad = None
    t0 = time.perf_counter()
    out = fn(q, k, v)
    out.sum().backward()
    return time.perf_counter() - t0, out.detach()


def run(mixes=MIXES, heads: int = 9, kv_heads: int = 3, head_dim: int = 64, block_size: int = 64,
        repeats: int = 3) -> dict:
    torch.set_num_threads(1)
    rows = []
    for docs in mixes:
        layout = make_layout(list(docs), block_size)
        g = torch.Generator().manual_seed(0)
        shape = lambda h: (1, h, layout.padded_length, head_dim)  # noqa: E731
        q = torch.randn(shape(heads), generator=g).requires_grad_()
        k = torch.randn(shape(kv_heads), generator=g).requires_grad_()
        v = torch.randn(shape(kv_heads), generator=g).requires_grad_()
        scale = head_dim**-0.5
        contenders = {
            "per_document": lambda a, b, c: sdpa_per_document(a, b, c, layout, scale),
            "fused": lambda a, b, c: _dense_docs(a, b, c, layout, scale, "torch", 256),
        }
        times: dict[str, list[float]] = {name: [] for name in contenders}
        outs = {}
        for _ in range(repeats):
            for name, fn in contenders.items():
                dt, outs[name] = _timed(fn, q, k, v)
                times[name].append(dt)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        rows.append({"docs": list(docs), "tokens": sum(docs), "per_document_s": med["per_document"],
                     "fused_s": med["fused"], "speedup": med["per_document"] / med["fused"],
                     "max_abs_diff": float((outs["fused"] - outs["per_document"]).abs().max())})
        print(f"{len(docs):3d} docs, {sum(docs):5d} tokens: per-document {med['per_document']:.3f}s, "
              f"fused {med['fused']:.3f}s, speedup {rows[-1]['speedup']:.2f}x, max |diff| {rows[-1]['max_abs_diff']:.1e}")
    return {"shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "block_size": block_size},
            "repeats": repeats, "threads": 1, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
            "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    result = run(repeats=args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
