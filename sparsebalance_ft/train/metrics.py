"""Per-step metrics: every rank's timings gathered to all, written once to metrics.jsonl and trackers.

`imbalance` is max/mean of per-rank compute time and `bubble` is 1 - mean/max: the share of
the slowest rank's time that the others spend waiting at the gradient all-reduce.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass
class RankRecord:
    """What one rank did in one optimizer step; NaN stands for 'not measured' (e.g. density under dense attention)."""

    compute_time: float
    wait_time: float
    predicted_time: float = math.nan
    budget: float = math.nan
    density: float = math.nan
    recall: float = math.nan
    tokens: float = 0.0
    docs: float = 0.0
    loss_sum: float = 0.0
    target_tokens: float = 0.0


_FIELDS = [f.name for f in fields(RankRecord)]


def gather_records(record: RankRecord, device: torch.device) -> list[RankRecord]:
    """One small all_gather so that every rank holds every rank's record (world size 1: no collective)."""
    local = torch.tensor([getattr(record, name) for name in _FIELDS], dtype=torch.float64, device=device)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        rows = [local]
    else:
        rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, local)
    return [RankRecord(**dict(zip(_FIELDS, row.tolist()))) for row in rows]


def _finite_or_none(value: float):
    return value if math.isfinite(value) else None


def step_metrics(step: int, epoch: int, lr: float, step_time: float, records: list[RankRecord]) -> dict:
    compute = [r.compute_time for r in records]
    slowest, mean = max(compute), sum(compute) / len(compute)
    target = sum(r.target_tokens for r in records)
    tokens = sum(r.tokens for r in records)
    return {
        "step": step,
        "epoch": epoch,
        "loss": sum(r.loss_sum for r in records) / target if target else None,
        "lr": lr,
        "tokens": int(tokens),
        "step_time": step_time,
        "tokens_per_s": tokens / step_time if step_time > 0 else None,
        "imbalance": slowest / mean if mean > 0 else None,
        "bubble": 1.0 - mean / slowest if slowest > 0 else None,
        "ranks": [
            {"rank": rank, **{k: _finite_or_none(v) for k, v in asdict(r).items() if k not in ("loss_sum", "target_tokens")}}
            for rank, r in enumerate(records)
        ],
    }


class MetricsWriter:
    """Appends one JSON line per step (main process only) and mirrors scalars to accelerate's trackers."""

    def __init__(self, accelerator, output_dir: str | Path, resume_step: int = 0):
        self.accelerator = accelerator
        self.path = Path(output_dir) / "metrics.jsonl"
        if accelerator.is_main_process:
            self._truncate_after(resume_step)

    def _truncate_after(self, step: int) -> None:
        """On resume, drop lines of steps the checkpoint does not cover, so no step is logged twice."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, metrics: dict) -> None:
        if not self.accelerator.is_main_process:
            return
        with self.path.open("a") as handle:
            handle.write(json.dumps(metrics) + "\n")
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k not in ("step", "epoch")}
        for rank in metrics["ranks"]:
            for key in ("compute_time", "wait_time", "predicted_time", "budget", "density", "recall"):
                if rank[key] is not None:
                    scalars[f"rank{rank['rank']}/{key}"] = rank[key]
        self.accelerator.log(scalars, step=metrics["step"])


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
