"""The `sbft` application: each verb lives in its own module and registers itself here."""
from __future__ import annotations

import typer

app = typer.Typer(
    name="sbft",
    help="Long-context LoRA fine-tuning with load-balanced dynamic sparse attention (SparseBalance).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def main() -> None:
    app()
