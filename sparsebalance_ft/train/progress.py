"""Progress on the main process: a rich bar (on a terminal) plus one printed line every `log_every` steps."""
from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class StepProgress:
    def __init__(self, total: int, start: int, enabled: bool, console: Console):
        self.enabled = enabled
        self.console = console
        self.live = enabled and console.is_terminal
        self._bar = None
        if self.live:
            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s  bubble {task.fields[bubble]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=console,
            )
            self._task = self._bar.add_task("train", total=total, completed=start, loss="-", tps="-", bubble="-")

    def __enter__(self) -> "StepProgress":
        if self._bar is not None:
            self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def update(self, step: int, metrics: dict, every: int) -> None:
        if not self.enabled:
            return
        loss = f"{metrics['loss']:.4f}" if metrics["loss"] is not None else "-"
        tps = f"{metrics['tokens_per_s']:.0f}" if metrics["tokens_per_s"] else "-"
        bubble = f"{metrics['bubble']:.0%}" if metrics["bubble"] is not None else "-"
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=loss, tps=tps, bubble=bubble)
        if step % every == 0:
            self.console.print(f"step {step}: loss {loss}  {tps} tok/s  bubble {bubble}", highlight=False)
