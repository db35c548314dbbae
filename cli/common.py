"""Helpers every command shares: the console and the one-line error contract."""
from __future__ import annotations

import functools
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, TypeVar

import typer
from rich.console import Console

from sparsebalance_ft.errors import UserError


def _width(stream) -> int | None:
    """Rich's own width on a terminal; piped, wide enough that tables and messages are not cut at 80."""
    return None if stream.isatty() else int(os.environ.get("COLUMNS", 0)) or 250


console = Console(width=_width(sys.stdout))
err_console = Console(stderr=True, width=_width(sys.stderr))


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """A warning is a line for the user, not the source line that raised it."""
    return f"warning: {message}\n"


warnings.formatwarning = _one_line_warning

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
        except KeyboardInterrupt:
            err_console.print("[bold red]interrupted[/] (Ctrl-C)", highlight=False)
            raise typer.Exit(code=130) from None

    return wrapper  # type: ignore[return-value]


def run_on_ranks(nproc: int, argv: list[str]) -> None:
    """Run `sbft *argv` on `nproc` local ranks; a failed rank becomes one red line and its exit code."""
    from sparsebalance_ft.train.launch import RankFailed, launch_ranks

    try:
        launch_ranks(nproc, argv)
    except RankFailed as failure:
        err_console.print(f"[bold red]error:[/] {failure}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=failure.exit_code) from None


@contextmanager
def as_rank(log_dir: str | Path):
    """Run the body as one rank of a launch group: it dies with its launcher, and a failure becomes
    `LOG_DIR/rank-R.log` plus the launcher's one line (see `sparsebalance_ft.train.launch`)."""
    from sparsebalance_ft.train.launch import die_with_launcher, rank_errors

    die_with_launcher()
    with rank_errors(log_dir):
        yield


def exit_without_teardown(code: int | str | None) -> None:
    """End the `sbft` process as `sys.exit(code)` would, less the interpreter's teardown: exit handlers run
    and output is flushed, but freeing torch's objects one by one took 2-3 s after a training run (its
    work already saved and closed); a failing rank already leaves this way (`train.launch.rank_errors`)."""
    import atexit

    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def refuse_single_process_of_many() -> None:
    """`accelerate launch --num_processes N` without --multi_gpu starts ONE process on a CPU machine: say so."""
    from sparsebalance_ft.train.launch import single_process_of_many

    if single_process_of_many():
        raise UserError(
            "accelerate launch asked for several processes but started one (it does on machines without GPUs); "
            "use `accelerate launch --multi_gpu --num_processes N -m sbft_cli.app ...` or `sbft train RECIPE --nproc N`"
        )
