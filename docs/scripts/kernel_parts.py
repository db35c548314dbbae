"""Where the CPU torch kernel's time goes in one attention layer, part by part, against dense SDPA.

Why: inside the 4K-8K training step the sparse attention reaches only 62-63% of its ideal 1/d
(`docs/benchmarks/step.md`), and a profile put the shortfall in the kernel's forward. This splits that
forward into what `_split_forward` runs: the diagonal blocks (one causal flash call per slice of rows), the
off-diagonal kept blocks (gathered, then one unmasked flash call per chunk of rows) and the rest (the
log-sum-exp merge of the two, the row copies). The off-diagonal part is also timed on pre-gathered keys, so
the gathers show apart. The backward (`_split_backward`, from the saved output and log-sum-exp) is timed
against dense SDPA's backward. Every part and dense are timed interleaved, median of `--repeats` rounds.

SmolLM2-135M's shapes (9 query heads, 3 key-value heads, head dim 64), float32 as the CPU step runs, random
q, k, v, the selection with each length's density forced (the default budget's kept density in
`step.json`: 0.382 / 0.248 / 0.191 at 4K / 8K / 16K).

    .venv/bin/python docs/scripts/kernel_parts.py --out bench_results/attention-kernel-parts.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from sparsebalance_ft.attention.budget import SparseAttentionController
from sparsebalance_ft.attention.config import SparsityConfig
from sparsebalance_ft.attention.kernels import make_plan
from sparsebalance_ft.attention.kernels import torch_kernel as tk
from sparsebalance_ft.attention.selection import make_layout
from sparsebalance_ft.bench.attention import _inputs

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def parts_at(length: int, density: float, repeats: int) -> dict:
    cfg = SparsityConfig()
    bs, scale = cfg.block_size, HEAD_DIM ** -0.5
    q, k, v, go = (t.detach() for t in _inputs(length, HEADS, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"), 0))
    layout = make_layout([length], bs)
    sel = SparseAttentionController(cfg).select(q[0], k[0], layout, cfg.budget, scale, force_density=density)
    plan = make_plan(sel.indices[None], sel.counts[None], layout.num_blocks, cfg.chunk_blocks)
    qr, gor = tk._rows_view(q, KV_HEADS, bs), tk._rows_view(go, KV_HEADS, bs)
    kb, vb = k.reshape(-1, bs, HEAD_DIM), v.reshape(-1, bs, HEAD_DIM)
    rows, group = qr.shape[0], HEADS // KV_HEADS
    flash_fwd = tk._CPU_FLASH[0]
    out, lse = tk._split_forward(qr, kb, vb, plan, bs, scale)

    def diagonal():
        def part(sl):
            kd, vd = tk._diagonal_blocks(kb, vb, plan, sl, group)
            flash_fwd(qr[sl], kd, vd, is_causal=True, scale=scale)
        tk._WORKERS.map(part, tk._row_slices(rows, 4 * torch.get_num_threads()))

    def off_diagonal_inputs(item):
        """A chunk's queries (its rows' group heads folded into one sequence) and its gathered kept blocks."""
        chunk_rows, c = item
        n = chunk_rows.numel()
        _, kg, vg = tk._kept_off_diagonal_blocks(kb, vb, plan, chunk_rows, c)
        return qr.index_select(0, chunk_rows).view(n, 1, group * bs, HEAD_DIM), kg, vg

    def off_diagonal(gathered: bool):
        if not gathered:
            return lambda: tk._WORKERS.map(lambda it: flash_fwd(*off_diagonal_inputs(it), scale=scale),
                                           plan.off_chunks, cost=lambda it: it[0].numel() * it[1])
        inputs = [off_diagonal_inputs(item) for item in plan.off_chunks]
        return lambda: tk._WORKERS.map(lambda it: flash_fwd(*it, scale=scale), inputs,
                                       cost=lambda it: it[1].shape[2] * it[0].shape[0])

    arms = {
        "dense_forward": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "sparse_forward": lambda: tk._split_forward(qr, kb, vb, plan, bs, scale),
        "diagonal": diagonal,
        "off_diagonal": off_diagonal(gathered=False),
        "off_diagonal_pre_gathered": off_diagonal(gathered=True),
        "sparse_backward": lambda: tk._split_backward(gor, qr, kb, vb, out, lse, plan, bs, scale),
    }
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))

    def dense_forward_backward():
        with torch.enable_grad():
            F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True).backward(go)
    arms["dense_forward_backward"] = dense_forward_backward

    times = {name: [] for name in arms}
    with torch.no_grad():
        for fn in arms.values():
            fn()  # warm-up
        for _ in range(repeats):  # interleaved: drifting load hits every part alike
            for name, fn in arms.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    s = {name: statistics.median(t) for name, t in times.items()}
    dense_backward = s["dense_forward_backward"] - s["dense_forward"]
    kept = sel.density
    fwd = s["sparse_forward"]
    return {
        "length": length, "kept_density": kept, "ideal": 1 / kept, "seconds": s,
        "dense_backward_s": dense_backward,
        "ideal_forward_s": s["dense_forward"] * kept,  # dense forward at the kept density: what 1/d allows
        "forward_speedup": s["dense_forward"] / fwd,
        "forward_share_of_ideal": s["dense_forward"] / fwd * kept,
        "backward_speedup": dense_backward / s["sparse_backward"],
        "backward_share_of_ideal": dense_backward / s["sparse_backward"] * kept,
        "forward_parts": {
            "diagonal": s["diagonal"] / fwd,
            "off_diagonal_flash": s["off_diagonal_pre_gathered"] / fwd,
            "off_diagonal_gathers": (s["off_diagonal"] - s["off_diagonal_pre_gathered"]) / fwd,
            "merge_and_copies": (fwd - s["diagonal"] - s["off_diagonal"]) / fwd,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--densities", default="0.382,0.248,0.191")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    densities = [float(x) for x in args.densities.split(",")]
    rows = [parts_at(n, d, args.repeats) for n, d in zip(lengths, densities, strict=True)]
    result = {"command": "docs/scripts/kernel_parts.py", "threads": torch.get_num_threads(),
              "torch": torch.__version__, "repeats": args.repeats, "rows": rows}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
