"""Selection curves on a real model: kept density, exact recall and loss, sparse against dense, per budget.

For each (selection rule, kind of text, length, budget) the model reads the first `length` tokens of the
text once with the sparse attention at that budget, and once dense (budget 1.0, exact) on the same tokens:

- density: kept / causal blocks over every layer and key-value head (the attention's own report);
- recall: the share of the exact dense softmax mass that falls in the kept blocks, for the probed layer,
  computed here from the layer's query and key (`bench.selection.block_mass`), not by the kernel; the
  attention's own sampled recall (`reported_recall`, a few query blocks per layer) is listed beside it;
- loss: mean next-token cross-entropy, and its gap to dense in percent.

`flat_steps` then names every budget interval over which the density does not move: where the knob, which
the balancer turns, would buy nothing.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..attention.budget import SparseAttentionController
from ..attention.config import SparsityConfig
from ..errors import UserError
from .real_probe import probe_attention, selection_of
from .selection import block_mass, kept_mask

PROSE_DIR = Path("/usr/share/common-licenses")
CODE_FILES = ("argparse.py", "typing.py", "inspect.py")
PROSE_FILES = ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "GFDL-1.3")
FULL_BUDGETS = tuple(round(0.1 * i, 1) for i in range(1, 11))
QUICK_BUDGETS = (0.1, 0.3, 0.5, 0.7, 0.9)


def default_texts() -> dict[str, str]:
    """{"code": standard-library sources, "prose": licence texts}, each long enough for 8K tokens."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = {"code": "\n\n".join((stdlib / n).read_text(errors="replace") for n in CODE_FILES if (stdlib / n).is_file())}
    prose = [PROSE_DIR / n for n in PROSE_FILES if (PROSE_DIR / n).is_file()]
    if prose:
        texts["prose"] = "\n\n".join(p.read_text(errors="replace") for p in prose)
    return texts


def _loss(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(ids, labels=ids).loss)


def _point(model, controller, ids, budget: float, dense: float, probe: int) -> dict:
    """One budget's density, exact and reported recall, loss and gap, on one text."""
    controller.set_budget(budget)
    recalls: list[float] = []

    def on_layer(layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        if layer != probe:
            return
        got = selection_of(controller, layer, q, k)
        if got is None:
            recalls.append(1.0)
            return
        sel, layout = got
        mass = block_mass(q, k, layout, q.shape[-1] ** -0.5)
        recalls.append(float((mass * kept_mask(sel)).sum(-1).mean()))

    with probe_attention(model, on_layer):
        loss = _loss(model, ids)
    report = controller.pop_report()
    return {"budget": budget, "density": report.mean_density, "exact_recall": recalls[0] if recalls else None,
            "reported_recall": report.mean_recall, "loss": loss, "loss_gap_pct": 100.0 * (loss - dense) / dense}


def selection_curves(
    model,
    tokenizer,
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
    texts: dict[str, str] | None = None,
    lengths: Sequence[int] | None = None,
    budgets: Sequence[float] | None = None,
    rules: Sequence[str] | None = None,
    config: SparsityConfig | None = None,
) -> dict:
    """Per (rule, kind, length, budget): density, exact and reported recall, sparse and dense loss.

    Full: both rules, code and prose, 2K/4K/8K tokens, budgets 0.1..1.0. Quick: the default rule at 4K,
    five budgets. The middle layer's recall is computed exactly."""
    config = config or SparsityConfig()
    texts = texts or default_texts()
    lengths = list(lengths or ((4096,) if quick else (2048, 4096, 8192)))
    budgets = list(budgets or (QUICK_BUDGETS if quick else FULL_BUDGETS))
    rules = list(rules or ((config.selection,) if quick else ("mass", "anchor")))
    say = progress or (lambda _msg: None)
    ids_by_kind = {kind: tokenizer(text, add_special_tokens=False)["input_ids"] for kind, text in texts.items()}
    for kind, ids in ids_by_kind.items():
        if len(ids) < max(lengths):
            raise UserError(f"the {kind} text holds {len(ids)} tokens, fewer than the longest length {max(lengths)}")
    probe = model.config.num_hidden_layers // 2
    result: dict[str, Any] = {
        "setup": {"config": config.model_dump(), "lengths": lengths, "budgets": budgets, "rules": rules,
                  "probe_layer": probe, "texts": sorted(texts), "loss": "mean next-token cross-entropy",
                  "exact_recall": "dense softmax mass in the kept blocks, mean over kv heads, query blocks, their "
                                  "query heads and tokens, probed layer"},
        "dense_loss": {}, "curves": {}, "flat_steps": {},
    }
    for kind, all_ids in ids_by_kind.items():
        for length in lengths:
            ids = torch.tensor([all_ids[:length]])
            controller = SparseAttentionController.attach(model, config)
            controller.set_budget(1.0)
            dense = _loss(model, ids)
            controller.pop_report()
            result["dense_loss"][f"{kind}/{length}"] = dense
            for rule in rules:
                controller = SparseAttentionController.attach(model, config.model_copy(update={"selection": rule}))
                points = []
                for b in budgets:
                    point = _point(model, controller, ids, b, dense, probe)
                    points.append(point)
                    say(f"  selection {rule} {kind} {length}: budget {b:g} density {point['density']:.3f} "
                        f"recall {point['exact_recall']:.3f} loss {point['loss_gap_pct']:+.2f}%")
                result["curves"].setdefault(rule, {}).setdefault(kind, {})[str(length)] = points
                result["flat_steps"].setdefault(rule, {}).setdefault(kind, {})[str(length)] = flat_steps(points)
    SparseAttentionController.attach(model, config)
    return result


def flat_steps(points: list[dict], key: str = "density", tolerance: float = 0.005) -> list[list[float]]:
    """Budget intervals wider than one grid step over which `key` rises by less than `tolerance`: where the
    knob does nothing. Points sorted by budget."""
    steps = []
    start = 0
    for i in range(1, len(points) + 1):
        if i == len(points) or points[i][key] - points[start][key] >= tolerance:
            if i - 1 > start:
                steps.append([points[start]["budget"], points[i - 1]["budget"]])
            start = i
    return steps


def save_curve_png(section: dict, path: str | Path) -> None:
    """Density and loss gap against budget, one line per (rule, kind, length): the colour names the text and
    length, the line style the rule, so the rules compare at a glance on the same text."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    texts = sorted({(kind, int(length)) for kinds in section["curves"].values() for kind, by_len in kinds.items()
                    for length in by_len})
    colour = {text: plt.cm.tab10(i % 10) for i, text in enumerate(texts)}
    for r, rule in enumerate(sorted(section["curves"], key=lambda name: name != "mass")):
        for kind, by_len in sorted(section["curves"][rule].items()):
            for length, points in sorted(by_len.items(), key=lambda item: int(item[0])):
                b = [p["budget"] for p in points]
                style = dict(marker="o", ms=3, linestyle=("-", "--", ":")[r % 3], color=colour[(kind, int(length))],
                             label=f"{rule} {kind} {int(length) // 1024}K")
                ax1.plot(b, [p["density"] for p in points], **style)
                ax2.plot(b, [p["loss_gap_pct"] for p in points], **style)
    ax1.set(xlabel="budget", ylabel="kept density", title="kept density (all layers)")
    ax2.set(xlabel="budget", ylabel="loss vs dense (%)", title="loss gap, sparse vs dense", yscale="symlog")
    ax1.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
