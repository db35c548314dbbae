"""Per-rank memory of what training holds (parameters, gradients, optimizer state), from the tensors themselves.

Taken once, after the run's first optimizer step and before its gradients are freed: the first
moment when all three exist (AdamW creates its state lazily). A sharded tensor counts its
rank-local part only, so the figures show what sharding saves rather than what it promises.
Every rank's figures are gathered; rank 0 prints one line per rank and writes them to
`OUTPUT_DIR/memory.json`. Activations are not counted: they live only inside a step.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

KINDS = ("parameters", "trainable", "gradients", "optimizer")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(_local(t).numel() * t.element_size() for t in tensors)


def rank_memory(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """Bytes this rank holds of each kind (`trainable`: the trainable share of `parameters`)."""
    params = list(model.parameters())
    state = getattr(optimizer, "optimizer", optimizer).state  # accelerate wraps the optimizer
    return {
        "parameters": tensor_bytes(params),
        "trainable": tensor_bytes(p for p in params if p.requires_grad),
        "gradients": tensor_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": tensor_bytes(v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)),
    }


def gather_memory(mine: dict[str, int], device: torch.device) -> list[dict[str, int]]:
    local = torch.tensor([mine[k] for k in KINDS], dtype=torch.float64, device=device)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        rows = [local]
    else:
        rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, local)
    return [dict(zip(KINDS, (int(v) for v in row.tolist()))) for row in rows]


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def report_memory(model: torch.nn.Module, optimizer, device: torch.device, output_dir: str | Path, is_main: bool,
                  log: Callable[[str], None]) -> list[dict[str, int]]:
    """Gather (over the process group's `device`), print (rank 0) and save every rank's figures; every rank must call it."""
    ranks = gather_memory(rank_memory(model, optimizer), device)
    if is_main:
        for rank, m in enumerate(ranks):
            log(f"memory rank {rank}: parameters {_mib(m['parameters'])} (trainable {_mib(m['trainable'])}), "
                f"gradients {_mib(m['gradients'])}, optimizer state {_mib(m['optimizer'])}")
        Path(output_dir, "memory.json").write_text(json.dumps({"ranks": ranks}, indent=1) + "\n")
    return ranks
