"""Per-document kept density past a model's native length, by kind of text: the figures the simulator
needs to judge balancing at 16K-128K tokens.

The documents are the standard library's long documents (`data.long_documents`: code, documentation,
prose, templated), truncated to each measured length; each runs alone through the model, forward only,
with the `sparsebalance` attention at the default budget (`real_densities.measure_densities`, the
probe of `sbft bench real --sections densities`).

A model read past its native positions needs its rotary positions scaled: `load_scaled_model` loads it
with the recipe key `model.rope_scaling` at type linear (LongLoRA's position interpolation), one factor for
every length, as one training run to the longest length would use.

The output's `densities` entry is the contract `sim.calibration` reads (`sbft simulate --density-from`),
its rows carrying the kinds of `data.long_documents` and the rope factor they ran at.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ..attention.config import SparsityConfig
from ..data.long_documents import KINDS, build_documents, default_stdlib, library_sections
from ..data.synthetic import length_function
from ..errors import UserError
from .real_densities import measure_densities, summarize
from .real_documents import Document, truncated_document


def load_scaled_model(model_dir: Path, factor: float, longest: int):
    """(model, tokenizer) of `model_dir` read with linear RoPE scaling by `factor`, float32, dense SDPA.

    Built through the trainer's own loader from a recipe with `model.rope_scaling`, so the positions are
    exactly what a training run with that key gets (and the same one-line refusals: a factor <= 1, or one
    that does not cover `longest` tokens).
    """
    from transformers import AutoTokenizer

    from ..recipe import recipe_from_dict
    from ..train.model import load_base_model

    recipe = recipe_from_dict({
        "model": {"path": str(model_dir), "dtype": "float32", "attn_implementation": "sdpa",
                  "rope_scaling": {"type": "linear", "factor": factor}},
        "data": {"path": str(model_dir), "max_seq_len": longest},
    }, "--rope-factor")
    return load_base_model(recipe).eval(), AutoTokenizer.from_pretrained(model_dir)


def documents_at(sections, tokenizer, length: int, per_kind: int) -> list[Document]:
    """`per_kind` documents of each kind, truncated to `length` tokens, interleaved by kind.

    The candidates are the long documents of at least `length` tokens (both splits: this measures, it
    does not train), in their stable order; the chosen ones are evenly spaced through it, so they come
    from different sources.
    """
    documents, _ = build_documents(sections, length, max(2 * length, 131072), length_function(tokenizer))
    chosen: dict[str, list[Document]] = {}
    for kind in KINDS:
        mine = [doc for doc in documents if doc.kind == kind]
        picks = sorted(set(np.linspace(0, len(mine) - 1, per_kind).round().astype(int).tolist())) if mine else []
        chosen[kind] = [truncated_document(tokenizer, kind, "+".join(mine[i].sources[:3]), mine[i].text, length)
                        for i in picks]
        chosen[kind] = [d for d in chosen[kind] if d.tokens == length]
    return [chosen[kind][i] for i in range(per_kind) for kind in KINDS if i < len(chosen[kind])]


def long_densities(model_dir: Path, lengths: list[int], per_kind: list[int], rope_factor: float,
                   config: SparsityConfig | None = None, time_limit: float | None = None,
                   say: Callable[[str], None] = print, stdlib: Path | None = None,
                   previous: dict | None = None) -> dict:
    """Measure (see the module docstring); lengths in the order given, so a time limit cuts the last.

    `previous` (an earlier result of the same model, factor and budget) is continued: its rows are kept and
    its documents not measured again, so a measurement cut by a time limit goes on where it stopped.
    """
    config = config or SparsityConfig()
    label = f"{Path(model_dir).name} linear x{rope_factor:g}"
    rows: list[dict] = []
    if previous is not None:
        before = previous.get("densities", {})
        if (before.get("model"), before.get("budget")) != (label, float(config.budget)):
            raise UserError(f"--append: the existing results are of {before.get('model')} at budget {before.get('budget')}, "
                            f"not {label} at {config.budget:g}")
        rows = list(before.get("documents", []))
    done = {(r["kind"], r["source"], r["tokens"]) for r in rows}
    native = int(json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"])
    if max(lengths) > native * rope_factor:
        raise UserError(f"--lengths {max(lengths)}: above the {native} x {rope_factor:g} positions of the scaled model; "
                        f"raise --rope-factor to {max(lengths) / native:g}")
    model, tokenizer = load_scaled_model(Path(model_dir), rope_factor, max(lengths))
    stdlib = stdlib or default_stdlib()
    say(f"reading {stdlib} (code, documentation, prose, templated)")
    sections = library_sections(stdlib, length_function(tokenizer))
    start = time.perf_counter()
    for length, n in zip(lengths, per_kind):
        left = None if time_limit is None else time_limit - (time.perf_counter() - start)
        if left is not None and left <= 0:
            say(f"{length} tokens: skipped, time limit reached")
            continue
        docs = [d for d in documents_at(sections, tokenizer, length, n) if (d.kind, d.source, d.tokens) not in done]
        say(f"{length} tokens: {len(docs)} documents to measure ({', '.join(dict.fromkeys(d.kind for d in docs))})")

        def progress(i, doc, density, t0=time.perf_counter()):
            say(f"  {doc.kind:13s} {doc.tokens} tokens {doc.source[:40]:40s} density {density:.3f} "
                f"({time.perf_counter() - t0:.0f} s so far)")

        measured = measure_densities(model, docs, config, left, progress)
        rows += [{**row, "rope_factor": rope_factor} for row in measured]
    by_length = {str(L): summarize([r for r in rows if r["tokens"] == L], KINDS) for L in lengths}
    return {
        "format": "sparsebalance-ft/long-densities", "version": 1,
        "setup": {"model": str(model_dir), "native_positions": native,
                  "rope": {"rope_type": "linear", "factor": rope_factor}, "lengths": lengths,
                  "documents_per_kind": per_kind, "stdlib": str(stdlib), "time_limit_s": time_limit,
                  "seconds": time.perf_counter() - start + (previous or {}).get("setup", {}).get("seconds", 0.0)},
        "densities": {"budget": float(config.budget), "block_size": int(config.block_size),
                      "model": label, "selection": config.selection,
                      "documents": rows, "summary": summarize(rows, KINDS), "by_length": by_length},
    }
