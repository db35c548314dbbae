"""`sbft init-tiny DIR`: write a tiny model and a locally trained tokenizer (no download)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import console, user_errors


def register(app: typer.Typer) -> None:
    @app.command("init-tiny")
    @user_errors
    def init_tiny_command(
        out_dir: Path = typer.Argument(..., help="Directory to write the model and tokenizer into."),
        family: str = typer.Option("llama", help="Model family: llama, qwen2 or mistral."),
        vocab_size: int = typer.Option(4096, help="Tokenizer vocabulary size."),
        hidden_size: int = typer.Option(128, help="Hidden size."),
        layers: int = typer.Option(4, help="Decoder layers."),
        heads: int = typer.Option(4, help="Query heads."),
        kv_heads: int = typer.Option(2, help="Key/value heads (GQA)."),
        max_positions: int = typer.Option(65536, help="max_position_embeddings."),
        seed: int = typer.Option(0, help="Seed of the random weights."),
        text: Optional[Path] = typer.Option(
            None, help="File or folder of text to train the tokenizer on (default: the Python stdlib sources)."
        ),
    ) -> None:
        """Write a small random decoder and a tokenizer built from local text, loadable with from_pretrained."""
        from sparsebalance_ft.modeling.tiny import init_tiny

        with console.status("training the tokenizer and writing the model"):
            out = init_tiny(out_dir, family=family, vocab_size=vocab_size, seed=seed, text_source=text,
                            hidden_size=hidden_size, layers=layers, heads=heads, kv_heads=kv_heads,
                            max_position_embeddings=max_positions)
        console.print(f"wrote a tiny {family} model and tokenizer to [bold]{out}[/]")
