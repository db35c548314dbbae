"""`sbft eval RECIPE --task passkey|kv|needle|longbench`: long-context evaluation of a trained model."""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import List, Optional

import typer

from .common import as_rank, console, refuse_single_process_of_many, run_on_ranks, user_errors
from .synth import parse_depths, parse_numbers


def register(app: typer.Typer) -> None:
    @app.command("eval")
    @user_errors
    def eval_command(
        recipe_path: Path = typer.Argument(..., metavar="RECIPE", help="Recipe YAML file (model, tokenizer, sparsity)."),
        task: str = typer.Option(..., "--task", "-t", help="passkey, kv, needle or longbench."),
        checkpoint: Optional[Path] = typer.Option(
            None, "--checkpoint", "-c", help="Adapter folder, training output folder or checkpoint-N; default: the base model."
        ),
        attention: str = typer.Option("dense", "--attention", help="dense, or sparse (the recipe's sparse attention)."),
        out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output folder (default: <training.output_dir>/eval)."),
        overrides: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe key: a.b=value (repeatable)."),
        lengths: Optional[List[str]] = typer.Option(None, "--lengths", help="Prompt lengths in tokens (default: the context and its halvings)."),
        depths: Optional[List[str]] = typer.Option(None, "--depths", help="Answer depths, 0..1 or 0..100%."),
        samples: Optional[int] = typer.Option(None, "--samples", min=1, help="Examples per (length, depth) cell."),
        seed: int = typer.Option(1234, "--seed", help="Seed of the generated prompts."),
        batch_size: int = typer.Option(8, "--batch-size", min=1, help="Prompts generated together."),
        max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1, help="Tokens to generate (default per task)."),
        max_length: Optional[int] = typer.Option(
            None, "--max-length", min=64, help="Context limit (default: data.max_seq_len capped by the model's positions)."
        ),
        budget: Optional[float] = typer.Option(None, "--budget", min=0.0, max=1.0, help="Sparse attention budget (default: the recipe's)."),
        haystack: Optional[List[Path]] = typer.Option(
            None, "--haystack", help="Needle: text files or folders for the haystack (default /usr/share/doc)."
        ),
        data: Optional[Path] = typer.Option(None, "--data", help="LongBench: a local .jsonl file or folder of them."),
        datasets: Optional[str] = typer.Option(None, "--datasets", help="LongBench: comma-separated dataset names to keep."),
        limit: Optional[int] = typer.Option(None, "--limit", min=1, help="LongBench: at most this many examples per dataset."),
        chat_template: bool = typer.Option(False, "--chat-template", help="LongBench: wrap prompts in the tokenizer's chat template."),
        nll: bool = typer.Option(False, "--nll", help="Retrieval tasks: also score the answer's teacher-forced NLL."),
        nproc: int = typer.Option(1, "--nproc", min=1, help="Shard the examples over this many local ranks."),
    ) -> None:
        """Passkey / key-value retrieval, needle in a haystack, or LongBench-format tasks; writes JSON (+ heatmap)."""
        from sparsebalance_ft.eval.errors import EvalOptionError
        from sparsebalance_ft.recipe import load_recipe
        from sparsebalance_ft.train.launch import inside_launcher

        refuse_single_process_of_many()
        recipe = load_recipe(recipe_path, overrides or [], check_paths=False)
        from sparsebalance_ft.eval.api import TASKS

        if task not in TASKS:
            raise EvalOptionError(f"--task: unknown task {task!r}; choose one of {', '.join(TASKS)}")
        if attention not in ("dense", "sparse"):
            raise EvalOptionError(f"--attention: expected dense or sparse, got {attention!r}")
        if nproc > 1 and not inside_launcher():
            argv = ["eval", str(recipe_path), "--task", task, "--attention", attention, "--seed", str(seed)]
            argv += ["--batch-size", str(batch_size), "--out", str(out or Path(recipe.training.output_dir) / "eval")]
            for flag, value in (
                ("--checkpoint", checkpoint), ("--samples", samples), ("--max-new-tokens", max_new_tokens),
                ("--max-length", max_length), ("--budget", budget), ("--data", data), ("--datasets", datasets),
                ("--limit", limit),
            ):
                if value is not None:
                    argv += [flag, str(value)]
            for flag, values in (("--set", overrides), ("--lengths", lengths), ("--depths", depths), ("--haystack", haystack)):
                for value in values or []:
                    argv.append(f"{flag}={value}")
            if chat_template:
                argv.append("--chat-template")
            if nll:
                argv.append("--nll")
            run_on_ranks(nproc, argv)
            return

        from sparsebalance_ft.eval.api import evaluate
        from sparsebalance_ft.eval.distributed import distributed_session

        out_dir = out or Path(recipe.training.output_dir) / "eval"
        # as one rank of a group, a failure is a log file and the launcher's one line
        with as_rank(out_dir / "logs") if inside_launcher() else nullcontext(), distributed_session() as rank:
            result = evaluate(
                recipe,
                task,
                checkpoint=checkpoint,
                attention=attention,  # type: ignore[arg-type]
                out_dir=out_dir,
                lengths=parse_numbers(lengths, int, "--lengths") or None,
                depths=parse_depths(depths),
                samples=samples,
                seed=seed,
                batch_size=batch_size,
                max_new_tokens=max_new_tokens,
                max_length=max_length,
                budget=budget,
                haystack=haystack,
                data=data,
                datasets=[d.strip() for d in datasets.split(",") if d.strip()] if datasets else None,
                limit=limit,
                chat_template=chat_template,
                answer_nll=nll,
                show_progress=True,
            )
            if rank == 0:
                _print_result(result)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _print_result(result: dict) -> None:
    from rich.table import Table

    recall = result.get("mean_recall")
    extra = f", mean recall {recall:.3f}" if recall is not None else ""
    if result["task"] == "longbench":
        table = Table(title=f"LongBench ({result['attention']} attention)")
        for column in ("dataset", "metric", "n", "score"):
            table.add_column(column)
        for name, row in result["datasets"].items():
            table.add_row(name, row["metric"], str(row["n"]), f"{row['score']:.2f}")
        console.print(table)
        console.print(f"average {_fmt(result['average'])}{extra}")
    else:
        table = Table(title=f"{result['task']} accuracy ({result['attention']} attention)")
        table.add_column("length")
        table.add_column("accuracy")
        for length, accuracy in result["by_length"].items():
            table.add_row(length, _fmt(accuracy))
        console.print(table)
        if result.get("answer_nll") is not None:
            extra += f", answer NLL {result['answer_nll']:.3f} nats/token"
        console.print(f"overall {_fmt(result['accuracy'])} over {result['n']} prompts{extra}")
    files = result.get("files") or {}
    if files:
        console.print(f"wrote [bold]{files['result']}[/]" + (f" and [bold]{files['heatmap']}[/]" if "heatmap" in files else ""))
