"""Passkey retrieval on a real model, dense against sparse attention, and where sparse attention loses the key.

One prompt per (length, depth, trial): a 5-digit key hidden in filler text at `depth` (the generator that
`sbft eval` uses), answered by greedy decoding. Exact match: the first integer of the completion equals the
key. Each prompt runs dense (budget 1.0, exact) and at each sparse budget on the same model: the prompt goes
through the block-sparse attention, decoding steps (one query each) through the exact path, so what differs
is what the prompt's tokens could see.

Where the needle is lost: during the sparse prefill a probe re-runs each layer's selection and records
whether the last query block (it holds the question and the token that emits the first digit) kept every
key block holding the needle, in every key-value head. `needle_layers_mean` counts the layers that did.
"""
from __future__ import annotations

import random
import time
from typing import Any, Callable, Sequence

import torch

from ..attention.budget import SparseAttentionController
from ..attention.config import SparsityConfig
from ..data.synthetic import make_passkey
from ..eval.engine import generate_greedy
from ..eval.metrics import retrieval_exact
from ..eval.passkey import special_overhead
from .real_probe import probe_attention, selection_of

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
MAX_NEW_TOKENS = 8


def passkey_prompt(tokenizer, length: int, depth: float, rng: random.Random) -> dict[str, Any]:
    """Prompt ids of at most `length` tokens, the key, and the token positions of the needle sentence."""
    rec = make_passkey(length - special_overhead(tokenizer), depth, rng, tokenizer=tokenizer, fit="prompt")
    enc = tokenizer(rec["prompt"], return_offsets_mapping=True)
    needle = [t for t, (a, b) in enumerate(enc["offset_mapping"]) if b > rec["needle_start"] and a < rec["needle_end"]]
    return {"ids": list(enc["input_ids"]), "key": rec["answer"], "needle": needle}


def _needle_probe(controller: SparseAttentionController, needle: list[int]):
    """(record, callback): record[layer] = the last query block kept every needle block in every kv head
    (a dense layer counts as kept)."""
    record: dict[int, bool] = {}
    bs = controller.config.block_size
    blocks = sorted({t // bs for t in needle})

    def on_layer(layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        got = selection_of(controller, layer, q, k)
        if got is None:
            record[layer] = True
            return
        sel, layout = got
        last = layout.num_blocks - 1
        record[layer] = all(set(blocks) <= set(sel.indices[h, last, : int(sel.counts[h, last])].tolist())
                            for h in range(sel.indices.shape[0]))

    return record, on_layer


def passkey_curves(
    model,
    tokenizer,
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
    lengths: Sequence[int] | None = None,
    budgets: Sequence[float] | None = None,
    trials: int = 2,
    config: SparsityConfig | None = None,
    seed: int = 0,
) -> dict:
    """Exact-match retrieval per length, dense and at each sparse budget (default: the default budget and
    0.3), `trials` prompts per depth. Full: 1K, 2K, 4K and 8K tokens; quick: 1K and 4K, one trial."""
    config = config or SparsityConfig()
    lengths = list(lengths or ((1024, 4096) if quick else (1024, 2048, 4096, 8192)))
    budgets = list(budgets or (config.budget, 0.3))
    trials = 1 if quick else trials
    say = progress or (lambda _msg: None)
    controller = SparseAttentionController.attach(model, config)
    rng = random.Random(seed)
    result: dict[str, Any] = {
        "setup": {"lengths": lengths, "depths": list(DEPTHS), "trials_per_depth": trials, "budgets": budgets,
                  "seed": seed, "config": config.model_dump(),
                  "metric": "exact match of the first integer of the greedy completion"},
        "lengths": {},
    }
    for length in lengths:
        cases = [(d, passkey_prompt(tokenizer, length, d, rng)) for d in DEPTHS for _ in range(trials)]
        row: dict[str, Any] = {}
        for name, budget in [("dense", 1.0)] + [(f"{b:g}", b) for b in budgets]:
            controller.set_budget(budget)
            controller.pop_report()
            hits, by_depth, kept_layers, densities = 0, {}, [], []
            started = time.perf_counter()
            for depth, prompt in cases:
                record, on_layer = _needle_probe(controller, prompt["needle"])
                with probe_attention(model, on_layer):
                    answer = generate_greedy(model, tokenizer, [prompt["ids"]], MAX_NEW_TOKENS, batch_size=1)[0]
                    ok = retrieval_exact(answer, prompt["key"]) == 1.0
                hits += ok
                by_depth.setdefault(f"{depth:g}", []).append(int(ok))
                kept_layers.append(sum(record.values()))
                report = controller.pop_report()
                if report.mean_density is not None:
                    densities.append(report.mean_density)
            entry = {"correct": hits, "total": len(cases), "by_depth": by_depth,
                     "seconds": round(time.perf_counter() - started, 1)}
            if budget < 1.0:
                entry.update({"needle_layers_mean": sum(kept_layers) / len(kept_layers),
                              "layers": controller.num_layers, "density": sum(densities) / max(1, len(densities))})
            row[name] = entry
            say(f"  passkey {length} tokens, {'dense' if budget >= 1.0 else 'budget ' + name}: {hits}/{len(cases)}"
                + (f", needle kept in {entry['needle_layers_mean']:.1f}/{controller.num_layers} layers, density "
                   f"{entry['density']:.3f}" if budget < 1.0 else ""))
        result["lengths"][str(length)] = row
    controller.set_budget(config.budget)
    return result
