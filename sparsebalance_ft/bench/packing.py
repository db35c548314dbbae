"""Packing speed: `pack_micro_batch` (numpy) against transformers' `DataCollatorWithFlattening`.

Both build the same tensors (a test pins that); the question is whether the library call can
replace the project's code without slowing every training step, since packing runs on the
step's critical path. The contenders alternate on the same documents and the median of each
is reported with their ratio.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ..data.packing import pack_micro_batch

DOCS_PER_MICRO_BATCH = 8


def _time(fn, docs) -> float:
    start = time.perf_counter()
    fn(docs)
    return time.perf_counter() - start


def compare_packing(totals: list[int], repeats: int = 20, vocab: int = 49152, seed: int = 0,
                    out: str | Path | None = None) -> dict:
    """Median seconds per micro-batch of each contender at each micro-batch size (tokens)."""
    from transformers import DataCollatorWithFlattening

    torch.set_num_threads(1)
    library = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    rng = np.random.default_rng(seed)
    rows = []
    for total in totals:
        cuts = np.sort(rng.choice(np.arange(1, total), DOCS_PER_MICRO_BATCH - 1, replace=False))
        docs = [d.astype(np.int32) for d in np.split(rng.integers(0, vocab, total), cuts)]
        features = [{"input_ids": d} for d in docs]
        own, lib = [], []
        for _ in range(repeats):  # alternate, so load on the shared machine hits both alike
            own.append(_time(pack_micro_batch, docs))
            lib.append(_time(library, features))
        own_s, lib_s = statistics.median(own), statistics.median(lib)
        rows.append({"tokens": total, "docs": DOCS_PER_MICRO_BATCH, "own_ms": own_s * 1e3, "library_ms": lib_s * 1e3,
                     "library_over_own": lib_s / own_s})
    result = {"repeats": repeats, "threads": 1, "rows": rows}
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2))
    return result
