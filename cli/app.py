"""The `sbft` application: each verb lives in its own module and registers itself here."""
from __future__ import annotations

import warnings

import typer

from . import bench, data, eval, export, init_model, init_tiny, profile, report, simulate, synth, train
from .common import exit_without_teardown

# peft asks transformers a deprecated question on every LoRA wrap; the warning is not the user's to act on.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

app = typer.Typer(
    name="sbft",
    help="Long-context LoRA fine-tuning with load-balanced dynamic sparse attention (SparseBalance).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

for command in (init_tiny, init_model, synth, data, train, export, profile, simulate, bench, eval, report):
    command.register(app)


def _show_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"sbft {version('sparsebalance-ft')}")
        raise typer.Exit()


@app.callback()
def _options(
    show_version: bool = typer.Option(False, "--version", is_eager=True, callback=_show_version, help="Print the version and exit."),
) -> None:
    """Long-context LoRA fine-tuning with load-balanced dynamic sparse attention (SparseBalance)."""


def main() -> None:
    import sys

    sys.argv[1:] = train.optional_resume_value(sys.argv[1:])
    try:
        app()
    except SystemExit as done:
        exit_without_teardown(done.code)


if __name__ == "__main__":
    main()
