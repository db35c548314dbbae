"""`sbft profile`: measure a latency profile of the recipe's model, or validate one."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from sparsebalance_ft.errors import UserError

from .common import console, user_errors


class ProfileArgumentError(UserError):
    """A bad `sbft profile` command line."""


def _floats(text: Optional[str], name: str) -> Optional[list[float]]:
    if not text:
        return None
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ProfileArgumentError(f"--{name}: expected comma-separated numbers, got {text!r}") from None


def register(app: typer.Typer) -> None:
    @app.command("profile")
    @user_errors
    def profile(
        recipe: Path = typer.Argument(..., help="Recipe YAML (its model, LoRA, dtype, attention and max_seq_len are profiled)."),
        out: Optional[Path] = typer.Option(None, "--out", "-o", help="Profile JSON to write (default: <training.output_dir>/profile.json)."),
        validate: Optional[Path] = typer.Option(None, "--validate", help="Validate this existing profile instead of profiling."),
        report: Optional[Path] = typer.Option(None, "--report", help="Validation JSON to write (default: PROFILE.validation.json; the PNG beside it)."),
        overrides: list[str] = typer.Option([], "--set", help="Override a recipe key, e.g. data.max_seq_len=4096 (repeatable)."),
        lengths: Optional[str] = typer.Option(None, help="Comma-separated sequence lengths (default: log-spaced up to data.max_seq_len)."),
        densities: Optional[str] = typer.Option(None, help="Comma-separated attention densities (default: 0.05..1.0; dense backends: 1.0)."),
        points_per_octave: float = typer.Option(1.0, help="Length grid points per doubling."),
        repeats: int = typer.Option(5, min=1, help="Timed repeats per point (the median is kept)."),
        warmup: int = typer.Option(1, min=0, help="Untimed warm-up passes."),
        threads: Optional[int] = typer.Option(None, min=1, help="torch threads while timing (default: as configured)."),
        clock: str = typer.Option("auto", help="wall, cpu (process CPU time; reproducible on a shared CPU with --threads 1) or auto."),
        micro_batches: int = typer.Option(24, min=1, help="Random packed micro-batches to validate on."),
        calibration_batches: int = typer.Option(12, min=0, help="Random packed micro-batches the profile fits its overheads on."),
        token_points: int = typer.Option(6, min=2, help="Token counts at which the attention-free part is timed."),
        seed: int = typer.Option(0, help="Seed of the random inputs."),
        progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
    ) -> None:
        """Time the recipe's model as it trains into a latency profile, or (--validate) check one."""
        from sparsebalance_ft.recipe import load_recipe

        if clock not in ("auto", "wall", "cpu"):
            raise ProfileArgumentError(f"--clock: expected wall, cpu or auto, got {clock!r}")
        data = load_recipe(recipe, overrides)

        if validate is not None:  # clock and threads default to the profile's own
            from sparsebalance_ft.profiling.validate import validate_recipe

            if not validate.is_file():
                raise ProfileArgumentError(f"--validate: profile file not found: {validate}")
            result = validate_recipe(data, validate, out_json=report, micro_batches=micro_batches,
                                     repeats=repeats, seed=seed + 1, progress=progress, threads=threads,
                                     clock=None if clock == "auto" else clock)
            summary = {k: result[k] for k in ("held_out", "micro_batch", "all", "acceptance", "clock")}
            console.print_json(json.dumps(summary))
            console.print(f"wrote {report or validate.with_suffix('.validation.json')} and {result['plot']}")
            return

        from sparsebalance_ft.profiling.profiler import ProfileSettings, profile_recipe, profile_warnings

        if clock == "auto":
            import torch

            clock = "cpu" if (not torch.cuda.is_available() and threads == 1) else "wall"

        settings = ProfileSettings(
            lengths=[int(x) for x in _floats(lengths, "lengths") or []] or None,
            densities=_floats(densities, "densities"),
            points_per_octave=points_per_octave, repeats=repeats, warmup=warmup, seed=seed,
            threads=threads, clock=clock, calibration_batches=calibration_batches, token_points=token_points,
        )
        if settings.lengths and max(settings.lengths) > data.data.max_seq_len:
            raise ProfileArgumentError(f"--lengths: {max(settings.lengths)} exceeds data.max_seq_len ({data.data.max_seq_len})")
        if settings.densities and not all(0.0 < d <= 1.0 for d in settings.densities):
            raise ProfileArgumentError("--densities: every density must be in (0, 1]")
        out = out or Path(data.training.output_dir) / "profile.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        import torch

        if not torch.cuda.is_available() and (threads or torch.get_num_threads()) > 1:
            console.print("[yellow]note:[/] timing with several torch threads on a CPU that other processes share is"
                          " very noisy; --threads 1 gives reproducible profiles")
        model = profile_recipe(data, settings, progress=progress)
        model.save(out)
        for problem in profile_warnings(model):
            console.print(f"[yellow]warning:[/] {problem}")
        console.print(
            f"wrote {out}: {len(model.lengths)} lengths x {len(model.densities)} densities"
            f"{' + dense path' if model.dense_attn is not None else ''},"
            f" {len(model.tokens)} token counts, {model.meta.get('profiling_seconds', 0):.0f} s"
            f" ({model.meta['hardware'].get('device_name')}, {clock} clock)"
        )
