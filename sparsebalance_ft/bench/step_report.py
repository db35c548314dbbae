"""The step bench's figure and table (`sbft bench step`): step time and speedup against dense per length,
beside each budget's Amdahl ceiling.

`python -m sparsebalance_ft.bench.step_report STEP.json` prints the table and writes the PNG of a run,
also of one stopped before its end (the JSON keeps every finished repeat; `repeats` says how many). For a
`--loss-only` run it prints the loss table alone.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _arms(result: dict) -> list[str]:
    return list(dict.fromkeys(row["arm"] for row in result["rows"]))


def save_step_png(result: dict, path: Path) -> Path:
    """Left: median step time per arm against length. Right: speedup over dense per budget (solid) and its
    Amdahl ceiling from the measured attention share and kept density (dashed)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, arm in enumerate(_arms(result)):
        rows = sorted((r for r in result["rows"] if r["arm"] == arm), key=lambda r: r["length"])
        lengths = [r["length"] for r in rows]
        color = f"C{i}"
        left.plot(lengths, [r["step_s"] for r in rows], "o-", color=color, label=arm)
        if arm == "dense":
            continue
        right.plot(lengths, [r["speedup_vs_dense"] for r in rows], "o-", color=color, label=f"budget {arm}")
        right.plot(lengths, [r["amdahl_ceiling"] for r in rows], "x--", color=color, alpha=0.6)
    right.plot([], [], "x--", color="gray", alpha=0.6, label="Amdahl ceiling")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    left.set_yscale("log")
    left.set_ylabel("median step time (s)")
    right.axhline(1.0, color="gray", lw=0.8)
    right.set_ylabel("speedup over dense SDPA (x)")
    setup = result["setup"]
    fig.suptitle(f"one LoRA training step, {setup['device']}, backend {setup['backend']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def step_table_markdown(result: dict) -> str:
    """The rows as a Markdown table (length, arm, step, speedup, ceiling, loss gap, density, shares)."""
    f = lambda x, fmt: "-" if x is None else format(x, fmt)  # noqa: E731
    lines = ["| tokens | arm | repeats | step s | speedup | Amdahl ceiling | of ceiling | loss gap | kept density | "
             "attention share | selection / attention | syncs / step |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(result["rows"], key=lambda r: (r["length"], r["arm"] != "dense", r["arm"])):
        lines.append(f"| {r['length']:,} | {r['arm']} | {r['repeats']} | {r['step_s']:.2f} | {f(r['speedup_vs_dense'], '.2f')}x | "
                     f"{f(r['amdahl_ceiling'], '.2f')}x | {f(r['share_of_ceiling'], '.0%')} | "
                     f"{f(r['loss_gap'], '+.2%')} | {r['kept_density']:.3f} | {f(r['attention_share'], '.0%')} | "
                     f"{f(r['selection_share_of_attention'], '.1%')} | {f(r['host_syncs_per_step'], '.0f')} |")
    return "\n".join(lines)


def loss_table_markdown(result: dict) -> str:
    """A `--loss-only` run's rows as a Markdown table (length, arm, loss, gap to dense, density, recall)."""
    f = lambda x, fmt: "-" if x is None else format(x, fmt)  # noqa: E731
    lines = ["| tokens | arm | loss | loss gap | kept density | recall | forward s |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in sorted(result["rows"], key=lambda r: (r["length"], r["arm"] != "dense", r["arm"])):
        lines.append(f"| {r['length']:,} | {r['arm']} | {r['loss']:.4f} | {f(r['loss_gap'], '+.2%')} | "
                     f"{r['kept_density']:.3f} | {f(r['recall'], '.3f')} | {r['forward_s']:.1f} |")
    return "\n".join(lines)


def is_loss_only(result: dict) -> bool:
    return bool(result["rows"]) and "step_s" not in result["rows"][0]


def main(argv: list[str] | None = None) -> None:
    path = Path((argv if argv is not None else sys.argv[1:])[0])
    result = json.loads(path.read_text())
    if is_loss_only(result):
        print(loss_table_markdown(result))
        return
    print(step_table_markdown(result))
    print(f"wrote {save_step_png(result, path.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
