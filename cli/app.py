"""The `sbft` application: each verb lives in its own module and registers itself here."""
from __future__ import annotations

import typer

from . import export, init_tiny, train

app = typer.Typer(
    name="sbft",
    help="Long-context LoRA fine-tuning with load-balanced dynamic sparse attention (SparseBalance).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

for command in (init_tiny, train, export):
    command.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
