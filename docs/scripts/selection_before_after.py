"""One layer's block selection, this checkout's against an earlier commit's, timed interleaved in one run.

Why a script and not a test: a change that only makes the selection faster must keep its choices, and its
speed is a ratio of two codes that one checkout does not hold. The earlier `attention/selection.py` is read
from git (`git show COMMIT:...`) into a temporary module; both select at the default budget from the same
q and k (SmolLM2-135M's shape: 9 query heads, 3 key-value heads, head dim 64, q and k strided as the model
hands them over, bfloat16 scoring as on a CPU with AMX), first on small layouts where the chosen blocks are
compared (one document, packed documents with short tails, a sliding window), then at each length as one
document, and at the longest packed with documents of `--packed` tokens (as training packs them), where the
medians of the timed rounds give the ratio. Last, torch's profiler splits one selection of this
checkout at the longest length by operator: what is left to make faster.

    .venv/bin/python docs/scripts/selection_before_after.py 008c7e9 --out bench_results/selection/cpu-before-after.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from sparsebalance_ft.attention import selection as current
from sparsebalance_ft.attention.config import SparsityConfig
from sparsebalance_ft.attention.budget import budget_params

SELECTION = "sparsebalance_ft/attention/selection.py"


def load_selection_at(commit: str, workdir: Path):
    """The module `attention/selection.py` as it was at `commit`, importable beside the current package."""
    text = subprocess.run(["git", "show", f"{commit}:{SELECTION}"], check=True, capture_output=True, text=True).stdout
    text = text.replace("from .", "from sparsebalance_ft.attention.")
    path = workdir / f"selection_{commit}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def model_like_qk(length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q [9, L, 64] and k [3, L, 64], strided as transformers hands them over, with some keys that a few
    queries single out (so the ranking has something to find)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, length, 9, 64, generator=g).transpose(1, 2)[0]
    k = torch.randn(1, length, 3, 64, generator=g).transpose(1, 2)[0]
    k[:, ::97] += 3 * q[:3, ::97]
    return q, k


def select(module, q, k, docs, window, config: SparsityConfig):
    layout = module.make_layout(docs, config.block_size)
    qp, kp = module.to_layout(q[None], layout)[0], module.to_layout(k[None], layout)[0]
    return module.select_block_sets(
        qp, kp, layout, config.selection, [budget_params(config, config.budget)], k_min=config.k_min,
        sink_blocks=config.sink_blocks, local_blocks=config.local_blocks, scale=64 ** -0.5, window=window,
        score_queries=config.score_queries, score_dtype=torch.bfloat16)[0]


def kept_sets(sel) -> list[set[int]]:
    counts = sel.counts.tolist()
    return [set(sel.indices[h, i, :n].tolist()) for h, row in enumerate(counts) for i, n in enumerate(row)]


def profile_shares(q, k, length: int, config: SparsityConfig) -> dict[str, float]:
    """Share of one selection's operator time (self CPU) taken by the sampled logits' product, their softmax,
    the sums (per key block, and the block means), and everything else."""
    from torch.profiler import profile

    with profile() as prof:
        select(current, q, k, [length], None, config)
    times = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(times.values())
    parts = {"product": times.get("aten::mm", 0.0), "softmax": times.get("aten::_softmax", 0.0),
             "sums": times.get("aten::sum", 0.0)}
    parts["rest"] = total - sum(parts.values())
    return {name: t / total for name, t in parts.items()}


def time_case(before, docs: list[int], rounds: int, config: SparsityConfig) -> dict:
    """Medians of `rounds` selections of one row holding `docs`, by each code, alternating (after one
    warm-up round)."""
    q, k = model_like_qk(sum(docs))
    seconds = {"before": [], "after": []}
    for round_ in range(rounds + 1):
        for name, module in (("before", before), ("after", current)):
            start = time.perf_counter()
            select(module, q, k, docs, None, config)
            if round_:
                seconds[name].append(time.perf_counter() - start)
    median = {name: sorted(s)[len(s) // 2] for name, s in seconds.items()}
    print(f"{sum(docs):>6} tokens in {len(docs)} document(s): before {median['before']:.3f} s, after "
          f"{median['after']:.3f} s, after/before {median['after'] / median['before']:.2f}", flush=True)
    return {"length": sum(docs), "documents": len(docs), "before_s": median["before"], "after_s": median["after"],
            "after_over_before": median["after"] / median["before"], "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commit", help="the earlier commit whose selection.py is compared")
    parser.add_argument("--lengths", default="8192,16384,32768")
    parser.add_argument("--packed", type=int, default=4096, help="document length of the packed row")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per code and length (after one warm-up)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    config = SparsityConfig()
    with tempfile.TemporaryDirectory() as tmp:
        before = load_selection_at(args.commit, Path(tmp))
        same = {}
        for docs, window in (([4096], None), ([1000, 2000, 64, 1030], None), ([3000, 1096], 700)):
            q, k = model_like_qk(sum(docs))
            a, b = (select(m, q, k, docs, window, config) for m in (before, current))
            same[f"{docs} window={window}"] = torch.equal(a.counts, b.counts) and kept_sets(a) == kept_sets(b)
        lengths = [int(x) for x in args.lengths.split(",")]
        cases = [[length] for length in lengths] + [[args.packed] * (lengths[-1] // args.packed)]
        rows = [time_case(before, docs, args.rounds, config) for docs in cases]
        length = lengths[-1]
        q, k = model_like_qk(length)
        profile = profile_shares(q, k, length, config)
        print(f"{length} tokens, where this checkout's selection spends its time: "
              + ", ".join(f"{name} {share:.0%}" for name, share in profile.items()))
    result = {"commit_before": args.commit, "threads": torch.get_num_threads(), "score_queries": config.score_queries,
              "same_selection": same, "rows": rows, "profile_longest": {"length": length, "shares": profile}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"same blocks kept: {same}\nwrote {args.out}")
    if not all(same.values()):
        sys.exit("the two codes keep different blocks")


if __name__ == "__main__":
    main()
