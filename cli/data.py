"""`sbft data long-docs OUT.jsonl`: long documents (16K-128K tokens) from the Python standard library.

A JSONL file rather than a new `data.format`: a recipe points at it as at any corpus (`data.path`,
`data.eval_path`), the file can be read, filtered by `kind` and checked, and the user's own long corpus
then replaces it in the same recipe with nothing else changed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import console, user_errors

data_app = typer.Typer(help="Build data files.", no_args_is_help=True)


@data_app.command("long-docs")
@user_errors
def long_docs(
    out: Path = typer.Argument(..., metavar="OUT.jsonl", help="JSONL file to write (fields text, kind, split, sources, tokens)."),
    tokenizer: Path = typer.Option(..., "--tokenizer", help="Tokenizer or model folder whose tokens --min-tokens/--max-tokens count."),
    split: str = typer.Option("train", "--split", help="train, heldout (sources never in train) or all."),
    min_tokens: int = typer.Option(16384, "--min-tokens", min=1, help="Shortest document."),
    max_tokens: int = typer.Option(131072, "--max-tokens", min=2, help="Longest document (at least twice --min-tokens)."),
    stdlib: Optional[Path] = typer.Option(None, "--stdlib", help="Standard library folder [default: this Python's]."),
) -> None:
    """Write long documents of code, documentation, prose and templated text, split by source into train and held-out."""
    from sparsebalance_ft.data.long_documents import default_stdlib, long_document_records
    from sparsebalance_ft.data.synthetic import write_jsonl
    from sparsebalance_ft.errors import UserError

    if not tokenizer.exists():
        raise UserError(f"--tokenizer: path not found: {tokenizer}")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(tokenizer)
    except (OSError, ValueError) as error:
        raise UserError(f"--tokenizer: cannot load a tokenizer from {tokenizer}: {str(error).splitlines()[0]}") from None
    root = stdlib or default_stdlib()
    with console.status(f"reading and tokenizing {root}"):
        records, summary = long_document_records(root, tok, split, min_tokens, max_tokens)
    if not records:
        raise UserError(f"{root}: no {split} document reaches --min-tokens {min_tokens}")
    written = write_jsonl(records, out)
    for name, row in summary["by_kind"].items():
        console.print(f"  {name:24s} {row['documents']:4d} documents {row['tokens']:>10,d} tokens", highlight=False)
    dropped = summary["dropped_short"]
    console.print(f"wrote {written} documents to [bold]{out}[/] ({dropped['documents']} leftovers under --min-tokens, "
                  f"{dropped['tokens']:,} tokens, dropped)")


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")
