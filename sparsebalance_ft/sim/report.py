"""Simulation output: a rich table per world size, JSON, and PNG plots."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .simulator import SimResult


def results_json(results: Sequence[SimResult], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"format": "sparsebalance-ft/simulation", "version": 1,
                           "runs": [r.to_dict() for r in results]}
    if extra:
        out.update(extra)
    return out


def write_json(path: str | Path, results: Sequence[SimResult], extra: dict[str, Any] | None = None) -> None:
    def clean(x: Any) -> Any:
        if isinstance(x, float) and not np.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        if isinstance(x, np.generic):
            return clean(x.item())
        return x

    Path(path).write_text(json.dumps(clean(results_json(results, extra)), indent=1))


def _fmt_s(x: float) -> str:
    if x >= 100:
        return f"{x:.0f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def table(result: SimResult, title: str | None = None):
    from rich.table import Table

    cfg = result.config
    title = title or (f"{cfg.world_size} ranks, {result.num_docs} documents, {cfg.docs_per_rank} per rank per step, "
                      f"{result.rows[0].steps if result.rows else 0} steps, density knowledge: {cfg.knowledge}; "
                      f"speedup vs the best fair peer at look-ahead {cfg.lookahead_steps} with the same tuning")
    t = Table(title=title)
    for name, justify in (("policy", "left"), ("look-ahead", "right"), ("tuning", "left"), ("step time (s)", "right"),
                          ("imbalance", "right"), ("bubble", "right"), ("vs peer", "right"), ("peer", "left"),
                          ("vs random", "right"), ("mean budget", "right"), ("budget spread", "right"), ("mean density", "right"),
                          ("attention share", "right"), ("plan (s)", "right")):
        t.add_column(name, justify=justify)
    best = min((r.imbalance for r in result.rows if r.tuning == "none"), default=None)
    for r in result.rows:
        imb = f"{r.imbalance:.3f}"
        if best is not None and r.tuning == "none" and r.imbalance == best:
            imb = f"[bold green]{imb}[/]"
        t.add_row(r.policy, str(r.lookahead), r.tuning, _fmt_s(r.step_time), imb, f"{100 * r.bubble:.1f}%",
                  f"{r.vs_peer:.3f}x", r.peer, f"{r.vs_random:.2f}x", f"{r.mean_budget:.3f}", f"{r.budget_spread:.3f}", f"{r.mean_density:.3f}",
                  f"{100 * r.attention_share:.1f}%", f"{r.plan_seconds:.2f}")
    return t


def markdown(result: SimResult) -> str:
    lines = ["| policy | look-ahead | tuning | step time (s) | imbalance | bubble | vs best peer | mean budget | budget spread | mean density |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result.rows:
        lines.append(f"| {r.policy} | {r.lookahead} | {r.tuning} | {_fmt_s(r.step_time)} | {r.imbalance:.3f} "
                     f"| {100 * r.bubble:.1f}% | {r.vs_peer:.3f}x ({r.peer}) | {r.mean_budget:.3f} | {r.budget_spread:.3f} "
                     f"| {r.mean_density:.3f} |")
    return "\n".join(lines)


def against_peer_markdown(results: Sequence[SimResult], policy: str = "sparsebalance") -> str:
    """One line per (ranks, documents per rank, knowledge, tuning): `policy` against the best fair peer."""
    lines = ["| ranks | docs/rank | knowledge | tuning | look-ahead | step time (s) | best peer | peer step time (s) "
             "| speedup vs peer | vs peer untuned | budget (ours / peer) | budget spread (ours / peer) | bubble (ours / peer) "
             "| attention share |",
             "|---:|---:|---|---|---:|---:|---|---:|---:|---:|---|---|---|---:|"]
    for res in results:
        cfg = res.config
        for r in res.rows:
            if r.policy != policy or not r.peer:
                continue
            p = res.row(r.peer, r.tuning)
            lines.append(f"| {cfg.world_size} | {cfg.docs_per_rank} | {cfg.knowledge} | {r.tuning} | {r.lookahead} "
                         f"| {_fmt_s(r.step_time)} | {p.policy} | {_fmt_s(p.step_time)} | **{r.vs_peer:.3f}x** "
                         f"| {r.vs_peer_untuned:.3f}x "
                         f"| {r.mean_budget:.3f} / {p.mean_budget:.3f} | {r.budget_spread:.3f} / {p.budget_spread:.3f} "
                         f"| {100 * r.bubble:.1f}% / {100 * p.bubble:.1f}% | {100 * r.attention_share:.1f}% |")
    return "\n".join(lines)


def plot_rank_load(result: SimResult, path: str | Path, steps: int = 4) -> None:
    """Per-rank compute time for the first `steps` steps, one row per policy (bars untuned; dashed: tuned max)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(r.policy for r in result.rows))
    untuned = {r.policy: r for r in result.rows if r.tuning == "none"}
    tuned = {r.policy: r for r in result.rows if r.tuning != "none"}
    n_steps = max((len(r.rank_loads) for r in result.rows), default=0)
    n_steps = max(1, min(steps, n_steps))
    fig, axes = plt.subplots(len(policies), n_steps, figsize=(3.2 * n_steps, 1.8 * len(policies) + 0.6),
                             squeeze=False)
    for i, policy in enumerate(policies):
        for s in range(n_steps):
            ax = axes[i][s]
            base = untuned.get(policy) or tuned.get(policy)
            if base is not None and s < len(base.rank_loads):
                loads = np.asarray(base.rank_loads[s])
                ax.bar(np.arange(loads.size), loads, width=1.0, color="#4c72b0", linewidth=0)
                ax.axhline(loads.mean(), color="black", linewidth=0.8, linestyle=":")
            tr = tuned.get(policy)
            if tr is not None and s < len(tr.rank_loads):
                t_loads = np.asarray(tr.rank_loads[s])
                ax.plot(np.arange(t_loads.size), t_loads, color="#dd8452", linewidth=0.8, marker="." if t_loads.size <= 64 else None)
            if i == 0:
                ax.set_title(f"step {s}", fontsize=9)
            if s == 0:
                ax.set_ylabel(policy, fontsize=8)
            ax.tick_params(labelsize=7)
    fig.suptitle(f"per-rank compute (s), {result.config.world_size} ranks, first steps of each policy's epoch "
                 "(windows differ by policy): bars untuned, dotted their mean, orange tuned",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_speedup(results: Sequence[SimResult], path: str | Path) -> None:
    """Speedup over the best fair peer (same tuning) against world size, one line per policy and tuning mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [r.config.world_size for r in results]
    keys = list(dict.fromkeys((row.policy, row.tuning) for r in results for row in r.rows))
    fig, ax = plt.subplots(figsize=(7.0, 4.6))
    policies = list(dict.fromkeys(p for p, _ in keys))
    colors = {p: f"C{i % 10}" for i, p in enumerate(policies)}
    styles = {"none": "-", "straggler-only": ":", "bidirectional": "--", "layer": "-."}
    for policy, tuning in keys:
        ys = []
        for r in results:
            try:
                ys.append(r.row(policy, tuning).vs_peer)
            except KeyError:
                ys.append(np.nan)
        ax.plot(ranks, ys, marker="o", color=colors[policy], linestyle=styles.get(tuning, "-."),
                label=f"{policy} / {tuning}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ranks)
    ax.set_xticklabels([str(x) for x in ranks])
    ax.set_xlabel("ranks")
    ax.set_ylabel("speedup over the best fair peer (same tuning)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def each_peer_markdown(results: Sequence[SimResult], policy: str = "sparsebalance", tuned: str = "layer") -> str:
    """One line per (ranks, documents per rank, knowledge): `policy` untuned against every peer untuned, and
    `policy` under `tuned` against the best of them untuned (DST is the method's own; the peer has none)."""
    peers = results[0].config.peers if results else ()
    lines = ["| ranks | docs/rank | knowledge | look-ahead | " + " | ".join(f"vs {p}" for p in peers)
             + f" | {policy} + {tuned} vs best peer untuned | bubble: best peer / {policy} / + {tuned} | attention share |",
             "|---:|---:|---|---:|" + "---:|" * len(peers) + "---:|---|---:|"]
    for res in results:
        cfg = res.config
        try:
            ours, ours_tuned = res.row(policy), res.row(policy, tuned)
            others = [res.row(p) for p in peers]
        except KeyError:
            continue
        best = min(others, key=lambda r: r.epoch_time)
        cells = " | ".join(f"{p.epoch_time / ours.epoch_time:.3f}x" for p in others)
        lines.append(f"| {cfg.world_size} | {cfg.docs_per_rank} | {cfg.knowledge} | {ours.lookahead} | {cells} "
                     f"| **{best.epoch_time / ours_tuned.epoch_time:.3f}x** | {100 * best.bubble:.1f}% / "
                     f"{100 * ours.bubble:.1f}% / {100 * ours_tuned.bubble:.1f}% | {100 * ours.attention_share:.1f}% |")
    return "\n".join(lines)
