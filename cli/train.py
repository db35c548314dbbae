"""`sbft train RECIPE`: validate the recipe, then train on this process or on N ranks it starts."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .common import console, err_console, run_on_ranks, user_errors


def register(app: typer.Typer) -> None:
    @app.command("train")
    @user_errors
    def train_command(
        recipe_path: Path = typer.Argument(..., metavar="RECIPE", help="Recipe YAML file."),
        overrides: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe key: a.b=value (repeatable)."),
        resume: bool = typer.Option(False, "--resume", help="Continue from the latest checkpoint in the output dir."),
        nproc: int = typer.Option(1, "--nproc", min=1, help="Start this many ranks here (torch elastic launcher)."),
    ) -> None:
        """Fine-tune the recipe's model with LoRA. Works as is under torchrun and accelerate launch."""
        from sparsebalance_ft.recipe import load_recipe
        from sparsebalance_ft.train.launch import inside_launcher

        recipe = load_recipe(recipe_path, overrides or [])
        if nproc > 1 and not inside_launcher():
            argv = ["train", str(recipe_path), *[f"--set={item}" for item in overrides or []]]
            if resume:
                argv.append("--resume")
            run_on_ranks(nproc, argv)
            console.print(f"done: {nproc} ranks finished; outputs in [bold]{recipe.training.output_dir}[/]")
            return

        from sparsebalance_ft.train.loop import train

        summary = train(recipe, resume=resume, console=err_console)
        if summary["world_size"] == 1 or _is_main():
            console.print(
                f"done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
                f"{summary['wall_time']:.1f}s; adapter in [bold]{summary['adapter_dir']}[/]"
            )


def _is_main() -> bool:
    import os

    return os.environ.get("RANK", "0") == "0"
