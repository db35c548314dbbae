"""The `sbft` application: each verb lives in its own module and registers itself here."""
from __future__ import annotations

import warnings

import typer

from . import bench, eval, export, init_model, init_tiny, profile, report, simulate, synth, train

# peft asks transformers a deprecated question on every LoRA wrap; the warning is not the user's to act on.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

app = typer.Typer(
    name="sbft",
    help="Long-context LoRA fine-tuning with load-balanced dynamic sparse attention (SparseBalance).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

for command in (init_tiny, init_model, synth, train, export, profile, simulate, bench, eval, report):
    command.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
