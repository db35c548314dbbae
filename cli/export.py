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
        verify_tokens: int = typer.Option(
            0, "--verify-tokens", min=0,
            help="Then check the export against the trained model on this many tokens (e.g. data.max_seq_len): "
                 "max |logit diff| and the float32 rounding floor, also written to export_check.json. 0: no check."),
    ) -> None:
        """Write base model + LoRA merged into one checkpoint that loads with from_pretrained."""
        import json

        from sparsebalance_ft.recipe import load_recipe
        from sparsebalance_ft.train.export import export_merged
        from sparsebalance_ft.train.export_check import check_export

        recipe = load_recipe(recipe_path, overrides or [], check_paths=False)
        adapter = adapter or Path(recipe.training.output_dir) / "adapter"
        with console.status("merging the adapter"):
            out = export_merged(recipe, adapter, out_dir)
        console.print(f"merged model written to [bold]{out}[/]")
        if verify_tokens:
            with console.status(f"checking the export on {verify_tokens} tokens (float32 and float64 forwards)"):
                check = check_export(recipe, adapter, out, verify_tokens)
            (out / "export_check.json").write_text(json.dumps(check.record(), indent=1) + "\n")
            console.print(check.describe(), highlight=False)
