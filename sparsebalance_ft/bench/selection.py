"""The two selection rules (mass threshold, anchor margin) compared at matched density.

Both rules keep a prefix of the same ranking of key blocks per (key-value head, query block); they differ
only in how long each prefix is. So the question is which rule spends a given density where the attention
mass is: for each rule the budget is swept, every budget gives one (density, recall) point averaged over
layers and sequences, and recall is interpolated at densities both rules reach. Caps are lifted (k_max
without limit) so that the rule alone sets the density; the cap and the k_min floor would act alike on both.

Recall here is exact, not sampled: the dense softmax mass of the kept blocks, averaged over every (key-value
head, query block) pair, its query heads and its query tokens, the quantity `sampled_recall` estimates from
a few pairs. Exact recall keeps sampling noise out of a comparison between rules that may differ little.

Two sources of q/k:

- text: real documents (the Python standard library sources) through the tiny model of `init-tiny`. That
  model is randomly initialised, so its attention is close to flat and says little about a trained model.
- planted: random q/k with known structure. Every key block has its own orthogonal direction; each query
  block is pointed at a random few earlier blocks (and, in `planted`, at the sink) with random logit
  boosts, so which blocks matter is known. Besides recall it reports the share of planted blocks kept.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from ..attention.budget import NO_CAP, SparseAttentionController, budget_params
from ..attention.config import SparsityConfig
from ..attention.selection import Layout, Selection, make_layout
from ..errors import UserError

RULES = ("mass", "anchor")
# planted sources by the sink's logit boost: with a strong sink the anchors set a clear bar, without one the
# anchor reference is a noise-level block
PLANTED = {"planted": 3.0, "planted-nosink": 0.0}
_CAPTURE = "sbft_capture"


def block_mass(q: torch.Tensor, k: torch.Tensor, layout: Layout, scale: float) -> torch.Tensor:
    """[Hkv, nb, nb] exact causal softmax mass of each key block, averaged over the query block's tokens and
    the group's query heads. q: [Hq, L, D], k: [Hkv, L, D], one document filling whole blocks."""
    hq, length, _ = q.shape
    hkv, nb, bs = k.shape[0], layout.num_blocks, layout.block_size
    if layout.doc_lengths != [length] or length % bs:
        raise ValueError("block_mass: one document of whole blocks")
    g = hq // hkv
    future = torch.ones(length, length, dtype=torch.bool).triu_(1)
    mass = torch.zeros(hkv, nb, nb)
    for h in range(hq):
        logits = torch.matmul(q[h].float(), k[h // g].float().T).mul_(scale).masked_fill_(future, -math.inf)
        prob = torch.softmax(logits, -1)
        mass[h // g] += prob.view(nb, bs, nb, bs).sum(-1).mean(1) / g
    return mass


def kept_mask(sel: Selection) -> torch.Tensor:
    """[Hkv, nb, nb] bool: the blocks a selection keeps."""
    slot = torch.arange(sel.indices.shape[-1])
    valid = (slot[None, None, :] < sel.counts[..., None]).float()
    nb = sel.indices.shape[1]
    return torch.zeros(*sel.indices.shape[:2], nb).scatter_add_(-1, sel.indices, valid) > 0


def _sweep(cases: list[dict], layout: Layout, config: SparsityConfig, budgets: list[float], scale: float) -> list[dict]:
    """(budget, density, recall[, planted kept]) per budget, averaged over the cases (layers, sequences)."""
    points = []
    controller = SparseAttentionController(config)
    for b in budgets:
        threshold, _ = budget_params(config, b)
        dens, rec, hit = [], [], []
        for case in cases:
            sel = controller.select(case["q"], case["k"], layout, b, scale)
            kept = kept_mask(sel)
            dens.append(sel.density)
            rec.append(float((case["mass"] * kept).sum(-1).mean()))
            if "planted" in case:
                hit.append(float((kept & case["planted"]).sum() / case["planted"].sum()))
        point = {"budget": round(b, 4), "threshold": threshold, "density": float(np.mean(dens)),
                 "recall": float(np.mean(rec))}
        if hit:
            point["planted_kept"] = float(np.mean(hit))
        points.append(point)
    return points


def _interp(d: np.ndarray, r: np.ndarray, x: float, max_gap: float) -> float | None:
    """Recall at density x between the two measured points around it; None when they lie more than `max_gap`
    apart (a density jump of the rule: a straight line across it would be a guess, not a measurement)."""
    j = int(np.searchsorted(d, x))
    if d[j] == x:
        return float(r[j])
    return None if d[j] - d[j - 1] > max_gap else float(np.interp(x, d, r))


def matched_recall(curves: dict[str, list[dict]], densities: list[float], max_gap: float = 0.1) -> list[dict]:
    """Recall of each rule interpolated (linearly in density) at the given densities both rules reach."""
    lines = {}
    for rule, points in curves.items():
        d = np.array([p["density"] for p in points])
        r = np.array([p["recall"] for p in points])
        lines[rule] = np.unique(d), np.array([r[d == x].max() for x in np.unique(d)])
    lo = max(d[0] for d, _ in lines.values())
    hi = min(d[-1] for d, _ in lines.values())
    return [{"density": x, **{rule: _interp(d, r, x, max_gap) for rule, (d, r) in lines.items()}}
            for x in densities if lo <= x <= hi]


def _compare(cases: list[dict], layout: Layout, config: SparsityConfig, budgets: list[float], scale: float,
             densities: list[float]) -> dict:
    curves = {rule: _sweep(cases, layout, config.model_copy(update={"selection": rule}), budgets, scale)
              for rule in RULES}
    return {"curves": curves, "matched": matched_recall(curves, densities)}


def planted_qk(length: int = 4096, block_size: int = 64, heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
               heavy: int = 4, boost: tuple[float, float] = (2.0, 6.0), sink: float = 3.0, seed: int = 0):
    """(q [Hq, L, D], k [Hkv, L, D], planted [Hkv, nb, nb] bool) with known heavy blocks.

    Key block j carries direction e_j (head_dim >= blocks); query block i of a key-value head group carries
    boost_ij * sqrt(D) * e_j for 0..`heavy` random earlier blocks j (a different count per query block), plus
    `sink` on block 0, so the planted pairs' logits rise by boost_ij above unit-variance noise.
    """
    nb = length // block_size
    if head_dim < nb:
        raise ValueError(f"planted_qk: head_dim ({head_dim}) must be at least the block count ({nb})")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, length, head_dim, generator=g)
    k = torch.randn(kv_heads, length, head_dim, generator=g)
    k += torch.eye(nb, head_dim).repeat_interleave(block_size, 0)  # block j carries e_j
    boosts = torch.zeros(kv_heads, nb, nb)
    boosts[:, 1:, 0] = sink
    for h in range(kv_heads):
        for i in range(3, nb):
            n = int(torch.randint(0, heavy + 1, (1,), generator=g))
            js = torch.randperm(i - 2, generator=g)[:n] + 1  # never the sink or the local blocks
            boosts[h, i, js] = torch.empty(len(js)).uniform_(*boost, generator=g)
    pull = boosts.repeat_interleave(block_size, 1) * math.sqrt(head_dim)  # [Hkv, L, nb]
    q += torch.nn.functional.pad(pull, (0, head_dim - nb)).repeat_interleave(heads // kv_heads, 0)
    return q, k, boosts > 0


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA that also leaves the rotated query and key on the module, for the comparison to read."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module._sbft_qk = (query[0].detach(), key[0].detach())
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def text_qk(model_dir: str | Path, length: int, sequences: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict]:
    """Per-layer (q, k) of the first `sequences` stdlib files holding at least `length` tokens, each file's
    first `length` tokens run through the tiny model (written by `init_tiny` when `model_dir` has none)."""
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    from ..modeling.tiny import default_text_files, init_tiny

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        init_tiny(model_dir)
    AttentionInterface.register(_CAPTURE, _capture_attention)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=_CAPTURE, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    qks, files = [], []
    for path in default_text_files():
        ids = tokenizer(path.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
        if len(ids) < length:
            continue
        with torch.no_grad():
            model(torch.tensor([ids[:length]]))
        qks += [m._sbft_qk for m in model.modules() if hasattr(m, "_sbft_qk")]
        files.append(path.name)
        if len(files) == sequences:
            break
    if not files:
        raise UserError(f"no standard-library source holds {length} tokens: choose a shorter length")
    return qks, {"model": str(model_dir), "files": files, "layers": model.config.num_hidden_layers}


def compare_selection_rules(
    model_dir: str | Path = "runs/tiny-llama",
    length: int = 4096,
    sequences: int = 2,
    config: SparsityConfig | None = None,
    budgets: list[float] | None = None,
    densities: list[float] | None = None,
    out: str | Path | None = "bench_results/selection.json",
    sources: tuple[str, ...] = ("text", *PLANTED),
) -> dict:
    """Recall at matched density of the mass and anchor rules on `sources`; writes JSON to `out` if given."""
    config = config or SparsityConfig(k_max=NO_CAP)
    # the anchor margin is 0 at budget 0: near-flat attention reaches full density within a tiny margin
    budgets = budgets or [float(b) for b in sorted({*np.linspace(0, 1, 41)[:-1].round(4),
                                                    *np.geomspace(1e-5, 0.1, 21).round(7)})]
    densities = densities or [0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    layout = make_layout([length], config.block_size)
    result = {
        "setup": {"length": length, "block_size": config.block_size, "sink_blocks": config.sink_blocks,
                  "local_blocks": config.local_blocks, "k_min": config.k_min, "k_max": "none", "tau": config.tau,
                  "anchor_margin": config.anchor_margin, "default_budget": config.budget, "budgets": budgets,
                  "recall": "exact dense mass of the kept blocks, mean over every (kv head, query block)"},
        "sources": {},
    }
    if "text" in sources:
        qks, about = text_qk(model_dir, length, sequences)
        scale = qks[0][0].shape[-1] ** -0.5
        cases = [{"q": q, "k": k, "mass": block_mass(q, k, layout, scale)} for q, k in qks]
        result["sources"]["text"] = {
            **about, "note": "randomly initialised tiny model: near-flat attention, not a trained model's",
            **_compare(cases, layout, config, budgets, scale, densities)}
    for name, sink in PLANTED.items():
        if name not in sources:
            continue
        q, k, planted = planted_qk(length, config.block_size, head_dim=max(64, layout.num_blocks), sink=sink)
        scale = q.shape[-1] ** -0.5
        case = {"q": q, "k": k, "planted": planted, "mass": block_mass(q, k, layout, scale)}
        result["sources"][name] = {
            "note": f"synthetic q/k: 0-4 heavy earlier blocks per query block (logit boost 2-6), sink boost {sink:g}",
            **_compare([case], layout, config, budgets, scale, densities)}
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2))
    return result
