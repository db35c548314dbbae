"""Helpers every command shares: the console and the one-line error contract."""
from __future__ import annotations

import functools
from typing import Callable, TypeVar

import typer
from rich.console import Console

from sparsebalance_ft.errors import UserError

console = Console()
err_console = Console(stderr=True)

F = TypeVar("F", bound=Callable)


def user_errors(fn: F) -> F:
    """Turn a `UserError` into one red line on stderr and exit status 2 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as error:
            err_console.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)
            raise typer.Exit(code=2) from None

    return wrapper  # type: ignore[return-value]


def run_on_ranks(nproc: int, argv: list[str]) -> None:
    """Run `sbft *argv` on `nproc` local ranks; a failed rank becomes one red line and its exit code."""
    from sparsebalance_ft.train.launch import RankFailed, launch_ranks

    try:
        launch_ranks(nproc, argv)
    except RankFailed as failure:
        err_console.print(f"[bold red]error:[/] {failure}", highlight=False)
        raise typer.Exit(code=failure.exit_code) from None
