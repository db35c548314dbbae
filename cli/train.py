"""`sbft train RECIPE`: validate the recipe, then train on this process or on N ranks it starts."""
from __future__ import annotations

import re
from pathlib import Path
from typing import List, Optional

import typer

from sparsebalance_ft.errors import UserError

from .common import as_rank, console, err_console, refuse_single_process_of_many, run_on_ranks, user_errors

LATEST = "latest"  # what a bare `--resume` means


def optional_resume_value(argv: list[str]) -> list[str]:
    """Let `--resume` take an optional CHECKPOINT: bare, it becomes `--resume=latest`.

    The next word is its value only when it names a checkpoint (an existing folder, or `checkpoint-N`),
    so `sbft train --resume RECIPE` still reads RECIPE as the recipe."""
    out = list(argv)
    for i, word in enumerate(out):
        if word != "--resume":
            continue
        following = out[i + 1] if i + 1 < len(out) else None
        names_checkpoint = following is not None and (
            Path(following).is_dir() or re.search(r"checkpoint-\d+/?$", following) is not None
        )
        if not names_checkpoint:
            out[i] = f"--resume={LATEST}"
    return out


def register(app: typer.Typer) -> None:
    @app.command("train")
    @user_errors
    def train_command(
        recipe_path: Path = typer.Argument(..., metavar="RECIPE", help="Recipe YAML file."),
        overrides: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe key: a.b=value (repeatable)."),
        resume: Optional[str] = typer.Option(
            None, "--resume", metavar="[CHECKPOINT]",
            help="Continue from the newest intact checkpoint in the output dir, or from CHECKPOINT.",
        ),
        overwrite: bool = typer.Option(False, "--overwrite", help="Clear a non-empty output dir and start afresh."),
        nproc: int = typer.Option(1, "--nproc", min=1, help="Start this many ranks here (torch elastic launcher)."),
    ) -> None:
        """Fine-tune the recipe's model with LoRA. Also runs under torchrun and accelerate launch --multi_gpu."""
        from sparsebalance_ft.recipe import load_recipe
        from sparsebalance_ft.train.launch import inside_launcher
        from sparsebalance_ft.train.loop import preflight

        refuse_single_process_of_many()
        recipe = load_recipe(recipe_path, overrides or [])
        resume_from: bool | str = True if resume == LATEST else (resume or False)
        if resume and overwrite:
            raise UserError("--resume and --overwrite exclude each other: resume keeps the run, overwrite deletes it")
        if nproc > 1 and not inside_launcher():
            preflight(recipe, resume_from, overwrite)  # one line here, before any rank starts
            argv = ["train", str(recipe_path), *[f"--set={item}" for item in overrides or []]]
            if resume:
                argv.append(f"--resume={resume}")
            if overwrite:
                argv.append("--overwrite")
            run_on_ranks(nproc, argv)
            console.print(f"done: {nproc} ranks finished; outputs in [bold]{recipe.training.output_dir}[/]")
            return

        from sparsebalance_ft.train.loop import train

        if inside_launcher():
            with as_rank(Path(recipe.training.output_dir) / "logs"):
                summary = train(recipe, resume=resume_from, console=err_console, overwrite=overwrite)
        else:
            summary = train(recipe, resume=resume_from, console=err_console, overwrite=overwrite)
        if summary["world_size"] == 1 or _is_main():
            _print_summary(summary)


def _print_summary(summary: dict) -> None:
    if summary["finished_before"]:
        console.print(
            f"already finished: {summary['steps']} of {summary['total_steps']} steps; nothing to do "
            f"(raise training.max_steps to train further); adapter in [bold]{summary['adapter_dir']}[/]"
        )
        return
    console.print(
        f"done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
        f"{summary['wall_time']:.1f}s; adapter in [bold]{summary['adapter_dir']}[/]"
    )


def _is_main() -> bool:
    import os

    return os.environ.get("RANK", "0") == "0"
