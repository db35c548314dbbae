"""Aggregation of scored examples into accuracy tables, and the length-by-depth heatmap."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

from .engine import Scored


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def group_mean(records: Sequence[Scored], key: str) -> dict[str, float]:
    """Mean score per value of `meta[key]`, keys as strings sorted numerically when they are numbers."""
    groups: dict[Any, list[float]] = defaultdict(list)
    for record in records:
        groups[record.meta.get(key)].append(record.score)
    ordered = sorted(groups, key=lambda k: (not isinstance(k, (int, float)), k if isinstance(k, (int, float)) else str(k)))
    return {_label(k): sum(groups[k]) / len(groups[k]) for k in ordered}


def grid(records: Sequence[Scored], row_key: str = "depth", col_key: str = "length") -> dict[str, Any]:
    """Mean score per (row, column) cell: `{"rows": [...], "cols": [...], "accuracy": [[...]], "count": [[...]]}`."""
    rows = sorted({r.meta[row_key] for r in records})
    cols = sorted({r.meta[col_key] for r in records})
    sums = {(a, b): [0.0, 0] for a in rows for b in cols}
    for record in records:
        cell = sums[(record.meta[row_key], record.meta[col_key])]
        cell[0] += record.score
        cell[1] += 1
    accuracy = [[(sums[(a, b)][0] / sums[(a, b)][1]) if sums[(a, b)][1] else None for b in cols] for a in rows]
    counts = [[sums[(a, b)][1] for b in cols] for a in rows]
    return {"row_key": row_key, "col_key": col_key, "rows": rows, "cols": cols, "accuracy": accuracy, "count": counts}


def retrieval_summary(records: Sequence[Scored]) -> dict[str, Any]:
    """Accuracy overall (and the graded `position_accuracy`), by length, by depth, and the depth x length grid."""
    from .metrics import position_accuracy

    partial = [max((position_accuracy(r.prediction, a) for a in r.answers), default=0.0) for r in records]
    return {
        "accuracy": mean([r.score for r in records]),
        "position_accuracy": mean(partial),
        "answer_nll": mean([r.meta["answer_nll"] for r in records if "answer_nll" in r.meta]),
        "answer_nll_by_length": _nll_by(records, "length"),
        "n": len(records),
        "by_length": group_mean(records, "length"),
        "by_depth": group_mean(records, "depth"),
        "grid": grid(records, "depth", "length"),
    }


def heatmap(grid_data: dict[str, Any], path: str | Path, title: str) -> Path:
    """Write the accuracy grid as a PNG: context length on x, needle depth (%) on y, 0..1 colour scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows, cols = grid_data["rows"], grid_data["cols"]
    values = np.array([[np.nan if v is None else v for v in row] for row in grid_data["accuracy"]], dtype=float)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(cols) + 2), max(3.0, 0.45 * len(rows) + 1.5)))
    image = ax.imshow(values, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto", origin="upper")
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(rows)), [f"{100 * float(r):.0f}%" for r in rows])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title)
    for i in range(len(rows)):
        for j in range(len(cols)):
            if not np.isnan(values[i, j]):
                ax.text(j, i, f"{values[i, j]:.2f}", ha="center", va="center", fontsize=7)
    fig.colorbar(image, ax=ax, label="accuracy")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _nll_by(records: Sequence[Scored], key: str) -> dict[str, float]:
    groups: dict[Any, list[float]] = defaultdict(list)
    for record in records:
        if "answer_nll" in record.meta:
            groups[record.meta.get(key)].append(record.meta["answer_nll"])
    return {_label(k): sum(v) / len(v) for k, v in sorted(groups.items())}


def _label(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
