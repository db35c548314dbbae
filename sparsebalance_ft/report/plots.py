"""PNG figures of a run (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .metrics import loss_series, num, rank_series  # noqa: E402

MAX_LEGEND = 8


def _legend(ax, count: int) -> None:
    if 0 < count <= MAX_LEGEND:
        ax.legend(fontsize=7, loc="best")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} recorded", ha="center", va="center", transform=ax.transAxes, color="gray")


def plot_timeline(records: list[dict], steps: list[int], path: Path) -> Path:
    """Per chosen step, one bar per rank: compute time, then the wait for the slowest rank."""
    by_step = {r["step"]: r for r in records}
    steps = [s for s in steps if s in by_step]
    fig, axes = plt.subplots(len(steps), 1, figsize=(9.5, 0.9 + (0.8 + 0.3 * min(_max_ranks(records), 64)) * len(steps)), squeeze=False)
    for ax, step in zip(axes[:, 0], steps):
        record = by_step[step]
        entries = sorted(record.get("ranks") or [], key=lambda e: e.get("rank", 0))
        ranks = [e.get("rank", i) for i, e in enumerate(entries)]
        compute = [max(num(e.get("compute_time")), 0.0) if math.isfinite(num(e.get("compute_time"))) else 0.0 for e in entries]
        wait = [max(num(e.get("wait_time")), 0.0) if math.isfinite(num(e.get("wait_time"))) else 0.0 for e in entries]
        ax.barh(ranks, compute, color="tab:blue", label="compute")
        ax.barh(ranks, wait, left=compute, color="tab:orange", hatch="//", alpha=0.7, label="wait")
        predicted = [num(e.get("predicted_time")) for e in entries]
        if any(math.isfinite(p) for p in predicted):
            ax.plot(predicted, ranks, "k|", markersize=14, label="predicted compute")
        bubble = num(record.get("bubble"))
        title = f"step {step}"
        if math.isfinite(bubble):
            title += f"  bubble {100 * bubble:.1f}%"
        budgets = [num(e.get("budget")) for e in entries]
        if any(math.isfinite(b) for b in budgets):
            title += "  budgets " + " ".join("-" if not math.isfinite(b) else f"{b:.2f}" for b in budgets[:MAX_LEGEND])
        ax.set_title(title, fontsize=9)
        ax.set_yticks(ranks)
        ax.set_yticklabels([f"rank {r}" for r in ranks], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("seconds")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def _max_ranks(records: list[dict]) -> int:
    return max((len(r.get("ranks") or []) for r in records), default=1) or 1


def plot_budgets(records: list[dict], path: Path) -> Path:
    """Budget, achieved density and sampled recall over steps, one line per rank."""
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    for ax, key, label in zip(axes, ("budget", "density", "recall"), ("budget", "density", "recall")):
        series = rank_series(records, key)
        drawn = 0
        for rank, (steps, values) in series.items():
            if any(math.isfinite(v) for v in values):
                ax.plot(steps, values, marker=".", markersize=3, linewidth=1, label=f"rank {rank}")
                drawn += 1
        if not drawn:
            _no_data(ax, label)
        ax.set_ylabel(label)
        _legend(ax, drawn)
    axes[-1].set_xlabel("step")
    axes[0].set_title("budget, density and recall per rank")
    return _save(fig, path)


def plot_bubble_loss(records: list[dict], path: Path) -> Path:
    """Bubble share, step time and loss (training, and validation where the run ran it) over steps."""
    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    panels = (
        ("bubble", "bubble share (%)", lambda r: 100 * num(r.get("bubble"))),
        ("step_time", "step time (s)", lambda r: num(r.get("step_time"))),
    )
    for ax, (key, label, get) in zip(axes, panels):
        values = [get(r) for r in records]
        if any(math.isfinite(v) for v in values):
            ax.plot(steps, values, marker=".", markersize=3, linewidth=1)
        else:
            _no_data(ax, key)
        ax.set_ylabel(label)
    _plot_losses(axes[2], records)
    imbalance = [num(r.get("imbalance")) for r in records]
    if any(math.isfinite(v) for v in imbalance):
        twin = axes[0].twinx()
        twin.plot(steps, imbalance, color="tab:red", linewidth=0.8, alpha=0.6)
        twin.set_ylabel("imbalance (max/mean)", color="tab:red")
    axes[-1].set_xlabel("step")
    axes[0].set_title("bubble, step time and loss")
    return _save(fig, path)


def _plot_losses(ax, records: list[dict]) -> None:
    series = loss_series(records)
    train_steps, train_values = series["train"]
    eval_steps, eval_values = series["eval"]
    if train_steps:
        ax.plot(train_steps, train_values, marker=".", markersize=3, linewidth=1, label="train")
    if eval_steps:
        ax.plot(eval_steps, eval_values, marker="s", markersize=4, linewidth=1.2, color="tab:green", label="eval")
    if not train_steps and not eval_steps:
        _no_data(ax, "loss")
    elif eval_steps:
        ax.legend(fontsize=7, loc="best")
    ax.set_ylabel("loss")
