"""`sbft profile --validate`: how well a profile predicts what it did not measure.

Two sets of whole-model forward+backward measurements (the training loss, the model as it
trains), neither of which the profile contains:

- held-out grid points: single documents at the geometric midpoints between profiled lengths and
  at the midpoints between profiled densities;
- random packed micro-batches: mixed document lengths (log-uniform), packed up to a random share
  of the token cap with position_ids restarting per document, batch size 1, at a random forced
  density.

Each is compared with `ProfiledCostModel.micro_batch_time`; the absolute percentage errors are
summarised (median, p90, max) as JSON, and a PNG plots predicted against measured time.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ..cost.model import ProfiledCostModel
from .profiler import (
    Cell,
    DensityDriver,
    Workloads,
    _progress_bar,
    _threads,
    load_for_timing,
    measure_cells,
    model_config,
    random_micro_batches,
)


def ape_summary(predicted: np.ndarray, measured: np.ndarray) -> dict[str, float]:
    predicted, measured = np.asarray(predicted, float), np.asarray(measured, float)
    if predicted.size == 0:
        return {"n": 0}
    ape = np.abs(predicted - measured) / np.maximum(measured, 1e-12)
    return {
        "n": int(ape.size),
        "median_ape": float(np.median(ape)),
        "p90_ape": float(np.percentile(ape, 90)),
        "max_ape": float(ape.max()),
        "mean_signed_error": float(np.mean((predicted - measured) / np.maximum(measured, 1e-12))),
    }


def held_out_points(profile: ProfiledCostModel) -> list[tuple[int, float]]:
    L = profile.lengths
    D = profile.densities
    mids_L = [int(round(np.sqrt(a * b))) for a, b in zip(L[:-1], L[1:])]
    mids_D = [float((a + b) / 2) for a, b in zip(D[:-1], D[1:])] or [float(D[0])]
    points = []
    for i, n in enumerate(mids_L):
        for j, d in enumerate(mids_D):
            if (i + j) % 2 == 0 or len(mids_D) == 1:  # a checkerboard keeps the run short
                points.append((n, round(d, 3)))
    if profile.dense_attn is not None:  # the separate exact-dense path
        points += [(n, 1.0) for n in mids_L[::2]]
    return points


def validate_model(
    model,
    driver: DensityDriver,
    profile: ProfiledCostModel,
    max_len: int,
    token_cap: int,
    micro_batches: int = 24,
    warmup: int = 1,
    repeats: int = 5,
    seed: int = 1,
    threads: int | None = None,
    clock: str | None = None,
    statistic: str | None = None,
    dense_layers: list[int] | None = None,
    mixed_precision: str = "no",
    progress: bool = True,
    loss_mode: str = "auto",
) -> dict[str, Any]:
    """Measure held-out points and random packed micro-batches; return the error report."""
    settings = profile.meta.get("settings", {})
    clock = clock or settings.get("clock", "wall")
    statistic = statistic or settings.get("statistic", "median")
    threads = threads if threads is not None else settings.get("threads")
    model.train()
    work = Workloads(model, driver, list(dense_layers or []), mixed_precision, seed, loss_mode)
    densities = [float(d) for d in profile.densities]
    cases: list[dict[str, Any]] = []
    for n, d in held_out_points(profile):
        cases.append({"kind": "held_out", "lengths": [n], "density": d})
    dense_share = 0.15 if profile.dense_attn is not None else 0.0
    for docs, d in random_micro_batches(micro_batches, max_len, token_cap, densities, seed, dense_share=dense_share):
        cases.append({"kind": "micro_batch", "lengths": docs, "density": d})
    cells = [Cell((c["kind"], i), work.model_run(c["lengths"], c["density"])) for i, c in enumerate(cases)]
    with _threads(threads), _progress_bar(len(cells) * (warmup + repeats), progress, "validate") as bar:
        measure_cells(cells, work.device, warmup, repeats, bar, clock)
    driver.force(None)
    work.clear_grads()
    for case, cell in zip(cases, cells):
        case["measured"] = cell.value(statistic)
        case["predicted"] = profile.micro_batch_time(np.array(case["lengths"]), case["density"])
        case["samples"] = cell.samples
    report: dict[str, Any] = {"clock": clock, "statistic": statistic, "threads": threads}
    for kind in ("held_out", "micro_batch"):
        sel = [c for c in cases if c["kind"] == kind]
        report[kind] = ape_summary(np.array([c["predicted"] for c in sel]), np.array([c["measured"] for c in sel]))
    report["all"] = ape_summary(np.array([c["predicted"] for c in cases]), np.array([c["measured"] for c in cases]))
    mb = report["micro_batch"]
    report["acceptance"] = {
        "median_ape_max": 0.10, "p90_ape_max": 0.20,
        "passed": bool(mb.get("n", 0) and mb["median_ape"] <= 0.10 and mb["p90_ape"] <= 0.20),
    }
    report["cases"] = cases
    return report


def plot_report(report: dict[str, Any], path: str | Path, title: str = "latency predictor") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    every = [c for c in report["cases"]]
    lo = min(min(c["measured"], c["predicted"]) for c in every) * 0.8
    hi = max(max(c["measured"], c["predicted"]) for c in every) * 1.25
    xs = np.geomspace(lo, hi, 50)
    ax.plot(xs, xs, color="black", lw=1, label="exact")
    ax.fill_between(xs, xs * 0.9, xs * 1.1, color="green", alpha=0.15, label="±10%")
    ax.fill_between(xs, xs * 0.8, xs * 1.2, color="green", alpha=0.07, label="±20%")
    styles = {"held_out": ("o", "tab:blue", "held-out grid points"), "micro_batch": ("s", "tab:orange", "packed micro-batches")}
    for kind, (marker, color, label) in styles.items():
        sel = [c for c in every if c["kind"] == kind]
        if sel:
            summary = report[kind]
            ax.scatter([c["measured"] for c in sel], [c["predicted"] for c in sel], marker=marker, color=color,
                       label=f"{label} (median APE {summary['median_ape']:.1%}, p90 {summary['p90_ape']:.1%})")
    from matplotlib.ticker import NullFormatter

    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(f"measured forward+backward seconds ({report.get('clock', 'wall')} clock)")
    ax.set_ylabel("predicted seconds")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def validate_recipe(recipe: Any, profile_path: str | Path, out_json: str | Path | None = None,
                    out_png: str | Path | None = None, micro_batches: int = 24, repeats: int = 5,
                    seed: int = 1, progress: bool = True, **kwargs: Any) -> dict[str, Any]:
    """Load the recipe's model and the profile (warning on mismatch), validate, write JSON and PNG."""
    profile_path = Path(profile_path)
    model, driver, mixed = load_for_timing(recipe)
    profile = ProfiledCostModel.load(profile_path, recipe=recipe, model_config=model_config(model), extrapolate="allow")
    report = validate_model(model, driver, profile, recipe.data.max_seq_len, recipe.token_cap,
                            micro_batches=micro_batches, repeats=repeats, seed=seed,
                            dense_layers=list(recipe.sparsity.dense_layers), mixed_precision=mixed,
                            loss_mode=recipe.training.loss,
                            progress=progress, **kwargs)
    report["profile"] = str(profile_path)
    out_json = Path(out_json) if out_json else profile_path.with_suffix(".validation.json")
    out_png = Path(out_png) if out_png else out_json.with_suffix(".png")
    report["plot"] = str(out_png)
    out_json.write_text(json.dumps(report, indent=1))
    plot_report(report, out_png, title=f"{profile_path.name}: predicted vs measured")
    return report


__all__ = ["validate_model", "validate_recipe", "ape_summary", "random_micro_batches", "held_out_points", "plot_report"]
