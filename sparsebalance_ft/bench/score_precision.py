"""The sampled queries' logits in bfloat16 against float32, on a real model: same blocks kept, and how much faster.

`score_precision: auto` scores in bfloat16 where the hardware multiplies it natively (`scoring_dtype`). The
logits only rank key blocks, so what matters is whether the ranking, and so the kept blocks, move. For every
layer of the model reading `length` tokens of a standard-library source, both precisions select at the
default budget from the same q/k and this reports:

- agreement: the share of (key-value head, query block, key block) keep-or-drop decisions that are the same;
- density and exact recall (the dense softmax mass of the kept blocks, `block_mass`) under each;
- the selection's time under each, interleaved per layer, medians of `repeats`, and their ratio.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from ..attention.budget import SparseAttentionController
from ..attention.config import SparsityConfig
from ..attention.selection import make_layout, scoring_dtype
from .selection import block_mass, kept_mask, text_qk

PRECISIONS = ("float32", "auto")


def _timed(ctl: SparseAttentionController, q: torch.Tensor, k: torch.Tensor, layout, budget: float,
           scale: float):
    start = time.perf_counter()
    sel = ctl.select(q, k, layout, budget, scale)
    return sel, time.perf_counter() - start


def compare_score_precision(model_dir: str | Path = "runs/smollm2", length: int = 8192, repeats: int = 3,
                            out: str | Path | None = "bench_results/selection/score-precision.json",
                            say: Callable[[str], None] = lambda line: None) -> dict:
    """Per-layer agreement, density, recall and selection time of float32 and `auto` scoring; JSON to `out`."""
    qks, about = text_qk(model_dir, length, 1)
    config = SparsityConfig()
    layout = make_layout([length], config.block_size)
    controllers = {p: SparseAttentionController(config.model_copy(update={"score_precision": p})) for p in PRECISIONS}
    q0 = qks[0][0]
    resolved = scoring_dtype("auto", q0.dtype, q0.device)
    # the decisions: a query block's causal key blocks (the future is never kept)
    causal = torch.ones(layout.num_blocks, layout.num_blocks, dtype=torch.bool).tril()
    rows = []
    for layer, (q, k) in enumerate(qks):
        scale = q.shape[-1] ** -0.5
        mass = block_mass(q, k, layout, scale)
        row, sels, seconds = {"layer": layer}, {}, {p: [] for p in PRECISIONS}
        for _ in range(repeats):  # interleaved, so drift in the machine's speed hits both alike
            for p in PRECISIONS:
                sels[p], s = _timed(controllers[p], q, k, layout, config.budget, scale)
                seconds[p].append(s)
        kept = {p: kept_mask(sel) for p, sel in sels.items()}
        for p, sel in sels.items():
            row[p] = {"density": sel.density,
                      "recall": float((mass * kept[p]).sum(-1).mean()),
                      "select_s": statistics.median(seconds[p])}
        row["agreement"] = float((kept["float32"] == kept["auto"])[:, causal].float().mean())
        rows.append(row)
        say(f"layer {layer}: agreement {row['agreement']:.5f}, recall {row['float32']['recall']:.4f} -> "
            f"{row['auto']['recall']:.4f}, select {row['float32']['select_s']:.3f} s -> {row['auto']['select_s']:.3f} s")
    summary = {p: {key: statistics.mean(r[p][key] for r in rows) for key in ("density", "recall")} for p in PRECISIONS}
    for p in PRECISIONS:
        summary[p]["select_s"] = sum(r[p]["select_s"] for r in rows)
    summary["agreement"] = statistics.mean(r["agreement"] for r in rows)
    summary["auto_speedup"] = summary["float32"]["select_s"] / summary["auto"]["select_s"]
    result = {"setup": {**about, "length": length, "budget": config.budget, "repeats": repeats,
                        "auto_dtype": str(resolved or q0.dtype).removeprefix("torch."),
                        "threads": torch.get_num_threads()},
              "summary": summary, "layers": rows}
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
    return result
