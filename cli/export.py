"""`sbft export`: merge a trained adapter into the base model, as a plain Hugging Face checkpoint."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .common import console, user_errors


def register(app: typer.Typer) -> None:
    @app.command("export")
    @user_errors
    def export_command(
        recipe_path: Path = typer.Argument(..., metavar="RECIPE", help="The recipe the adapter was trained with."),
        out_dir: Path = typer.Option(..., "--out", help="Directory for the merged model."),
        adapter: Optional[Path] = typer.Option(None, help="Adapter directory (default: OUTPUT_DIR/adapter)."),
        overrides: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe key: a.b=value."),
    ) -> None:
        """Write base model + LoRA merged into one checkpoint that loads with from_pretrained."""
        from sparsebalance_ft.recipe import load_recipe
        from sparsebalance_ft.train.export import export_merged

        recipe = load_recipe(recipe_path, overrides or [], check_paths=False)
        adapter = adapter or Path(recipe.training.output_dir) / "adapter"
        with console.status("merging the adapter"):
            out = export_merged(recipe, adapter, out_dir)
        console.print(f"merged model written to [bold]{out}[/]")
