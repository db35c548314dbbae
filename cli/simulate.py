"""`sbft simulate`: replay an epoch of every batching policy on a simulated cluster, with and without tuning."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import console, user_errors


def _int_list(text: str, option: str) -> list[int]:
    from sparsebalance_ft.sim import SimInputError

    try:
        values = [int(p) for p in text.replace(" ", "").split(",") if p]
    except ValueError:
        raise SimInputError(f"{option} {text!r}: expected comma-separated integers, e.g. 8,64,512") from None
    if not values or any(v < 1 for v in values):
        raise SimInputError(f"{option} {text!r}: expected positive integers")
    return values


def _name_list(text: str, option: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    from sparsebalance_ft.sim import SimInputError

    names = tuple(p for p in text.replace(" ", "").split(",") if p)
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise SimInputError(f"{option}: unknown {bad[0] if bad else '(empty)'!r}; choose from {', '.join(allowed)}")
    return names


def register(app: typer.Typer) -> None:
    @app.command("simulate")
    @user_errors
    def simulate_command(
        lengths_file: Optional[Path] = typer.Option(None, "--lengths", help="Document token lengths: JSON list (or {\"lengths\": [...]}) or numbers in text."),
        text_dir: Optional[Path] = typer.Option(None, "--from-text-dir", help="Measure the token lengths of the text files in DIR."),
        glob: str = typer.Option("**/*", "--glob", help="Files of --from-text-dir to read."),
        bytes_per_token: float = typer.Option(3.6, "--bytes-per-token", help="Length estimate of --from-text-dir without --tokenizer."),
        min_bytes: int = typer.Option(1, "--min-bytes", help="Skip smaller files of --from-text-dir."),
        tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="Tokenizer dir: count --from-text-dir tokens exactly (slow)."),
        recipe: Optional[Path] = typer.Option(None, "--recipe", help="Take lengths from this recipe's dataset (tokenized and cached by the data loader)."),
        synthetic: Optional[int] = typer.Option(None, "--synthetic", help="N lognormal lengths (see --median, --sigma)."),
        long_tail: Optional[int] = typer.Option(None, "--long-tail", help="N lengths of a long-tail mix: 70% 1-4K, 25% 4-32K, 5% 32-128K tokens."),
        median: float = typer.Option(12288, "--median", help="Median of --synthetic lengths."),
        sigma: float = typer.Option(1.0, "--sigma", help="Log-sigma of --synthetic lengths."),
        max_len: int = typer.Option(131072, "--max-len", help="Cap on document length (data.max_seq_len)."),
        too_long: str = typer.Option("truncate", "--too-long", help="Over --max-len: truncate, drop or error."),
        token_cap: Optional[int] = typer.Option(None, "--token-cap", help="Micro-batch token cap; default --max-len."),
        profile: Optional[Path] = typer.Option(None, "--profile", help="Latency profile from `sbft profile` (default: analytic model)."),
        model: str = typer.Option("llama-8b", "--model", help="Analytic preset (llama-8b) when no --profile/--hf-config."),
        hf_config: Optional[Path] = typer.Option(None, "--hf-config", help="Analytic model from a HF config.json or model dir."),
        flops_per_s: float = typer.Option(4.0e14, "--flops-per-s", help="Achieved FLOP/s of the analytic model."),
        density_mean: Optional[float] = typer.Option(None, "--density-mean", help="Mean attention density at the default budget [default: 0.3, or --density-from's]."),
        density_sigma: Optional[float] = typer.Option(None, "--density-sigma", help="Log-sigma of per-document density around the mean [default: 0.5, or --density-from's]."),
        length_exponent: Optional[float] = typer.Option(None, "--length-exponent", help="Density ~ length^-x (longer documents sparser) [default: 0, or --density-from's]."),
        density_stats: Optional[Path] = typer.Option(None, "--density-stats", help="Saved DensityStats state (JSON) as the mean density."),
        density_from: Optional[Path] = typer.Option(None, "--density-from", help="Calibrate mean, spread, length exponent and predictability from a real model's measured densities (bench_results/real/real.json); --density-mean/--density-sigma/--length-exponent/--predicted-r2 given as well override one figure of it (a what-if)."),
        predicted_r2: Optional[float] = typer.Option(None, "--predicted-r2", help="Share of per-document density variance the feature predictor explains (knowledge predicted) [default: 0, or --density-from's]."),
        knowledge: str = typer.Option("none", "--knowledge", help="What batching and the tuner know of each document's density, comma-separated levels: none (length and budget only), predicted (from cheap features, unseen documents), remembered (observed in an earlier epoch)."),
        ranks: str = typer.Option("8,64,512", "--ranks", help="World sizes to simulate, comma-separated (2..4096)."),
        docs_per_rank: str = typer.Option("4", "--docs-per-rank", help="Documents per rank per step (comma-separated: each is simulated)."),
        steps: Optional[int] = typer.Option(None, "--steps", help="Replay only this many steps (default: one epoch)."),
        seed: int = typer.Option(0, "--seed"),
        policies: str = typer.Option("random,tokens,kk-length,kk-flops,length-grouped,verl,sparsebalance", "--policies",
                                     help="Batching policies: random, tokens, kk-length, kk-flops (one-step references), length-grouped and verl (the fair peers: same look-ahead) and sparsebalance."),
        tuning: str = typer.Option("none,bidirectional,layer", "--tuning", help="Tuning modes: none, straggler-only, bidirectional, layer (per-step bidirectional, then layer-level DST on the measured work)."),
        default_budget: float = typer.Option(0.5, "--default-budget"),
        min_budget: float = typer.Option(0.1, "--min-budget"),
        max_budget: float = typer.Option(0.9, "--max-budget"),
        target: str = typer.Option("mean", "--target", help="Tuner target rule: mean, fastest or fill."),
        tolerance: float = typer.Option(0.05, "--tolerance", min=0.0, max=0.99,
                                        help="Ranks within this share above T* are not cut (balance.tolerance)."),
        grid_points: int = typer.Option(17, "--grid-points"),
        peers: Optional[str] = typer.Option(None, "--peers", help="Policies whose fastest (same look-ahead, knowledge and tuning) is the fair peer every speedup is quoted against; add tokens,kk-length for token-balanced packing. Each must be in --policies [default: length-grouped,verl among them]."),
        lookahead_steps: int = typer.Option(32, "--lookahead-steps", min=1, help="Steps every look-ahead policy (length-grouped, verl, sparsebalance) regroups together; 1: none."),
        out: Optional[Path] = typer.Option(None, "--out", help="Write simulation.json, rank_load.png and speedup_vs_ranks.png here."),
        plot_steps: int = typer.Option(4, "--plot-steps", help="Steps shown in rank_load.png."),
        scale_check: bool = typer.Option(False, "--scale-check", help="Also time partitioning 100,000 documents over 1,024 ranks."),
        markdown: bool = typer.Option(False, "--markdown", help="Print the tables as Markdown too (and write them to --out's tables.md)."),
    ) -> None:
        """Replay an epoch of every batching policy over simulated ranks; report step time, imbalance, bubble, and speedup vs the best fair peer (by default length-grouped or verl at the same look-ahead and tuning; see --peers)."""
        import numpy as np

        from sparsebalance_ft.batching import POLICIES
        from sparsebalance_ft.sim import (
            KNOWLEDGE, DensityModel, SimConfig, SimInputError, TUNING_MODES, apply_cap, lengths_from_recipe,
            lengths_from_text_dir, load_calibration, long_tail_lengths, load_density_stats, load_lengths, simulate, synthetic_lengths,
            time_partition,
        )
        from sparsebalance_ft.sim import report as rep

        sources = [x for x in (lengths_file, text_dir, recipe, synthetic, long_tail) if x is not None]
        if len(sources) != 1:
            raise SimInputError("give exactly one of --lengths, --from-text-dir, --recipe, --synthetic, --long-tail")
        if too_long not in ("truncate", "drop", "error"):
            raise SimInputError(f"--too-long {too_long!r}: choose truncate, drop or error")
        levels = _name_list(knowledge, "--knowledge", KNOWLEDGE)
        from sparsebalance_ft.balancer.tuner import TARGETS

        if target not in TARGETS:
            raise SimInputError(f"--target {target!r}: choose one of {', '.join(TARGETS)}")
        if not 0.0 <= min_budget <= default_budget <= max_budget <= 1.0 or default_budget >= 1.0:
            raise SimInputError(f"budgets must satisfy 0 <= min ({min_budget}) <= default ({default_budget}) <= max ({max_budget}) <= 1, default < 1")
        world_sizes = _int_list(ranks, "--ranks")
        if any(r < 1 or r > 65536 for r in world_sizes):
            raise SimInputError(f"--ranks {ranks!r}: world sizes must be between 1 and 65536")
        per_rank = _int_list(docs_per_rank, "--docs-per-rank")
        policy_names = _name_list(policies, "--policies", POLICIES)
        modes = _name_list(tuning, "--tuning", TUNING_MODES)
        from sparsebalance_ft.batching import PEERS

        peer_names = _name_list(peers, "--peers", POLICIES) if peers else tuple(p for p in PEERS if p in policy_names)
        missing = [name for name in peer_names if name not in policy_names]
        if missing:
            raise SimInputError(f"--peers {missing[0]!r} is not among --policies; add it there")

        if lengths_file is not None:
            L, source = load_lengths(lengths_file), str(lengths_file)
        elif text_dir is not None:
            L, _ = lengths_from_text_dir(text_dir, glob, bytes_per_token, str(tokenizer) if tokenizer else None, min_bytes)
            source = f"{text_dir} ({glob})"
        elif recipe is not None:
            L, source = lengths_from_recipe(recipe), f"recipe {recipe}"
        elif long_tail is not None:
            L, source = long_tail_lengths(long_tail, seed), "long-tail mix (70% 1-4K, 25% 4-32K, 5% 32-128K)"
        else:
            if synthetic < 1:
                raise SimInputError("--synthetic needs a positive document count")
            L, source = synthetic_lengths(synthetic, median, sigma, max_len, seed), f"lognormal(median {median:g}, sigma {sigma:g})"
        L = apply_cap(L, max_len, too_long, source)  # type: ignore[arg-type]
        if L.size == 0:
            raise SimInputError(f"{source}: no documents left after --too-long {too_long}")
        cap = token_cap or max_len
        from sparsebalance_ft.batching import BatchSampler

        BatchSampler(L, 1, "random", cap, 1)  # checks every document fits the cap (one-line error otherwise)

        cost = _cost_model(profile, model, hf_config, flops_per_s)
        stats = load_density_stats(density_stats) if density_stats else None
        calibration = load_calibration(density_from) if density_from else None
        # each figure: given on the command line, else the calibration's, else DensityModel's assumption
        figures = ({"mean": calibration.mean, "sigma": calibration.sigma, "length_exponent": calibration.length_exponent,
                    "predicted_r2": calibration.predicted_r2, "ref_length": calibration.ref_length}
                   if calibration is not None else {})
        given = {"--density-mean": ("mean", density_mean), "--density-sigma": ("sigma", density_sigma),
                 "--length-exponent": ("length_exponent", length_exponent),
                 "--predicted-r2": ("predicted_r2", predicted_r2)}
        figures.update({name: value for name, value in given.values() if value is not None})
        dm = DensityModel(L, default_budget=default_budget, seed=seed, stats=stats, **figures)
        if calibration is not None:
            overridden = [flag for flag, (_, value) in given.items() if value is not None]
            console.print(f"density calibrated on {calibration.documents} documents of {calibration.model} at budget "
                          f"{calibration.budget:g}: mean {dm.mean:.3f} at {calibration.ref_length:.0f} tokens, "
                          f"log-sigma {dm.sigma:.3f}, length exponent {dm.length_exponent:.3f}, "
                          f"feature predictor R^2 {dm.predicted_r2:.3f}"
                          + (f" (given on the command line: {', '.join(overridden)})" if overridden else ""),
                          highlight=False)
        p = np.percentile(L, [50, 90, 99])
        console.print(f"{L.size} documents from {source}: median {p[0]:.0f}, p90 {p[1]:.0f}, p99 {p[2]:.0f}, "
                      f"max {L.max()} tokens; cost model {getattr(cost, 'name', type(cost).__name__)}", highlight=False)
        base = SimConfig(world_size=world_sizes[0], docs_per_rank=per_rank[0], token_cap=cap, seed=seed,
                         policies=policy_names, tuning=modes, knowledge=levels[0],  # type: ignore[arg-type]
                         default_budget=default_budget, min_budget=min_budget, max_budget=max_budget,
                         grid_points=grid_points, target=target, tolerance=tolerance, steps=steps,
                         lookahead_steps=lookahead_steps, peers=peer_names, record_steps=plot_steps)
        from dataclasses import replace

        results, tables = [], []
        for R, dpr, level in [(R, d, k) for R in world_sizes for d in per_rank for k in levels]:
            res = simulate(L, cost, dm, replace(base, world_size=R, docs_per_rank=dpr, knowledge=level))
            results.append(res)
            console.print(rep.table(res))
            if markdown:
                tables.append(f"### {R} ranks, {dpr} documents per rank, knowledge {level}, look-ahead {lookahead_steps}\n\n"
                              + rep.markdown(res))
                console.print(rep.markdown(res), highlight=False, markup=False)
        if len(results) > 1 and "sparsebalance" in policy_names:
            tables.append("### sparsebalance against the best fair peer\n\n" + rep.against_peer_markdown(results))
            console.print(rep.against_peer_markdown(results), highlight=False, markup=False)
            if markdown and "layer" in modes and peer_names:
                tables.append("### sparsebalance against each peer (untuned), and with layer DST against the best\n\n"
                              + rep.each_peer_markdown(results))
        extra = {"source": source, "density_model": {"mean": dm.mean, "sigma": dm.sigma,
                 "length_exponent": dm.length_exponent, "predicted_r2": dm.predicted_r2,
                 "calibration": calibration.to_dict() if calibration else None}, "lengths_summary": {"count": int(L.size), "median": float(p[0]), "p90": float(p[1]),
                                                       "p99": float(p[2]), "max": int(L.max())}}
        if scale_check:
            timing = time_partition(cost=cost)
            extra["scale_check"] = {"num_docs": 100_000, "world_size": 1024, "seconds": timing}
            for policy, row in timing.items():
                console.print(f"scale: {policy:14s} 100,000 docs over 1,024 ranks: epoch of {row['epoch_steps']:.0f} steps "
                              f"{row['epoch']:.2f} s, one window {row['one_window']:.2f} s", highlight=False)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            rep.write_json(out / "simulation.json", results, extra)
            if tables:
                (out / "tables.md").write_text(f"{L.size} documents from {source}\n\n" + "\n\n".join(tables) + "\n")
            rep.plot_rank_load(results[0], out / "rank_load.png", steps=plot_steps)
            first = [r for r in results if r.config.docs_per_rank == per_rank[0] and r.config.knowledge == levels[0]]
            rep.plot_speedup(first, out / "speedup_vs_ranks.png")
            console.print(f"wrote {out / 'simulation.json'}, {out / 'rank_load.png'}, {out / 'speedup_vs_ranks.png'}",
                          highlight=False)


def _cost_model(profile: Optional[Path], model: str, hf_config: Optional[Path], flops_per_s: float):
    from sparsebalance_ft.cost.model import AnalyticCostModel, ProfiledCostModel
    from sparsebalance_ft.sim import SimInputError

    if profile is not None:
        return ProfiledCostModel.load(profile, check=False, extrapolate="allow")
    if hf_config is not None:
        import json

        path = hf_config / "config.json" if hf_config.is_dir() else hf_config
        if not path.is_file():
            raise SimInputError(f"{hf_config}: no config.json found")
        try:
            return AnalyticCostModel.from_hf_config(json.loads(path.read_text()), flops_per_s=flops_per_s)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            raise SimInputError(f"{path}: not a usable HF config ({error})") from None
    if model != "llama-8b":
        raise SimInputError(f"--model {model!r}: the only preset is llama-8b (or give --hf-config / --profile)")
    return AnalyticCostModel.llama_8b(flops_per_s=flops_per_s)
