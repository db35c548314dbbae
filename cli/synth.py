"""`sbft synth passkey|kv --out FILE.jsonl`: write synthetic long-context retrieval training data."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .common import console, user_errors


def parse_numbers(values: Optional[List[str]], kind: type, option: str) -> list:
    """Numbers from repeatable, comma-separated option values (`--lengths 512,1024 --lengths 2048`)."""
    from sparsebalance_ft.errors import UserError

    out = []
    for value in values or []:
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                number = kind(float(part)) if kind is int else kind(part)
            except ValueError:
                raise UserError(f"{option}: {part!r} is not a number") from None
            if kind is int and float(part) != number:
                raise UserError(f"{option}: {part!r} is not a whole number")
            out.append(number)
    return out


def parse_depths(values: Optional[List[str]]) -> list[float] | None:
    """Depths as fractions; values above 1 are read as percentages (`50` = 0.5)."""
    from sparsebalance_ft.errors import UserError

    depths = parse_numbers(values, float, "--depths")
    if not depths:
        return None
    depths = [d / 100 if d > 1 else d for d in depths]
    bad = [d for d in depths if not 0 <= d <= 1]
    if bad:
        raise UserError(f"--depths: {bad[0]} is outside 0..1 (or 0..100%)")
    return depths


def register(app: typer.Typer) -> None:
    @app.command("synth")
    @user_errors
    def synth_command(
        task: str = typer.Argument(..., metavar="TASK", help="passkey or kv (key-value retrieval)."),
        out: Path = typer.Option(..., "--out", "-o", help="JSONL file to write (field `text` plus metadata)."),
        lengths: List[str] = typer.Option(
            ["1024,2048,4096"], "--lengths", help="Target lengths in tokens, comma-separated or repeated; records cycle over them."
        ),
        count: int = typer.Option(100, "--count", "-n", min=1, help="Number of records."),
        seed: int = typer.Option(0, "--seed", help="Random seed (same arguments, same file)."),
        depths: Optional[List[str]] = typer.Option(
            None, "--depths", help="Answer depths (0..1 or 0..100%); default uniform at random per record."
        ),
        tokenizer: Optional[Path] = typer.Option(
            None, "--tokenizer", help="Tokenizer folder for exact token lengths (default: about 4 characters a token)."
        ),
    ) -> None:
        """Generate passkey or key-value retrieval sequences at mixed lengths, for training or evaluation."""
        from sparsebalance_ft.data.synthetic import SyntheticError, generate, write_jsonl

        length_list = parse_numbers(lengths, int, "--lengths")
        depth_list = parse_depths(depths)
        tok = None
        if tokenizer is not None:
            if not tokenizer.exists():
                raise SyntheticError(f"--tokenizer: path not found: {tokenizer}")
            from transformers import AutoTokenizer

            try:
                tok = AutoTokenizer.from_pretrained(tokenizer)
            except (OSError, ValueError) as error:
                raise SyntheticError(f"--tokenizer: cannot load a tokenizer from {tokenizer}: {str(error).splitlines()[0]}") from None
        with console.status(f"generating {count} {task} records"):
            records = generate(task, length_list, count, seed=seed, depths=depth_list, tokenizer=tok)
            written = write_jsonl(records, out)
        unit = "tokens" if tok is not None else "approx. tokens"
        total = sum(r["length"] for r in records)
        console.print(
            f"wrote {written} {task} records ({total} {unit}, lengths {min(length_list)}..{max(length_list)}) to [bold]{out}[/]"
        )
