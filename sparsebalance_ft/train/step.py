"""One optimizer step on one rank: local micro-batches, then the one gradient all-reduce.

Gradients are summed across ranks by a single explicit all-reduce after all local
micro-batches, rather than by DDP hooks during backward. That costs little for LoRA (its
gradients are small) and makes the quantity SparseBalance minimises observable: the time a
rank spends waiting for the slowest one (`wait_time`) is measured on its own, before the
gradient transfer (`comm_time`).

A sharded model (`train/sharding.py`) reduce-scatters its gradients layer by layer during
backward, so there is no all-reduce here; a rank then also runs `padding` one-token forwards
for the micro-batches it lacks, since every rank must meet every layer's collectives. Its
`wait_time` is what is left of the wait after the last layer (the layers' own collectives have
already made it wait inside `compute_time`).
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .loss import micro_batch_loss
from .sharding import is_sharded, padding_batch


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on the CPU, where every call blocks."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_collective(run: Callable[[], None], device: torch.device) -> float:
    """Seconds until a collective has completed, not merely been queued.

    On CUDA, NCCL collectives return to the host as soon as they are enqueued; only a device
    synchronize waits for the slowest rank to arrive. On CPU (gloo) the call itself blocks.
    """
    start = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - start


@dataclass
class LocalStep:
    compute_time: float
    wait_time: float
    comm_time: float
    loss_sum: float
    target_tokens: int
    tokens: int


def all_reduce_gradients(params: list[torch.nn.Parameter]) -> None:
    """Sum the trainable gradients over ranks in one flat buffer (one collective, any parameter count)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(p).to(p.dtype)
        offset += n


def run_local_step(accelerator, model, batches: list[dict], global_target_tokens: int, params,
                   loss_mode: str = "auto", after_micro_batches=None, padding: int = 0,
                   padding_context=nullcontext) -> LocalStep:
    """`padding` (sharded models only): forwards and backwards with nothing to predict, each inside
    `padding_context()`, after the real micro-batches."""
    device = accelerator.device
    sharded = is_sharded(model)
    start = time.perf_counter()
    loss_sum, target_tokens, tokens = 0.0, 0, 0
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        with accelerator.autocast():
            loss, count = micro_batch_loss(model, batch, loss_mode)
        accelerator.backward(loss / max(global_target_tokens, 1))
        loss_sum += float(loss.detach())
        target_tokens += count
        tokens += int(batch["input_ids"].numel())
    for _ in range(padding):
        with padding_context(), accelerator.autocast():
            loss, _count = micro_batch_loss(model, padding_batch(device), "full")
        accelerator.backward(loss)  # zero, through every layer: the gradient reductions still run
    if after_micro_batches is not None:  # e.g. layer-level DST: join the exchanges of micro-batches this rank lacks
        after_micro_batches()
    synchronize(device)
    compute_time = time.perf_counter() - start

    wait_time = comm_time = 0.0
    if _distributed():
        # completes when the slowest rank arrives
        wait_time = timed_collective(lambda: dist.all_reduce(torch.zeros(1, device=device)), device)
        if not sharded:
            comm_time = timed_collective(lambda: all_reduce_gradients(params), device)
    return LocalStep(compute_time, wait_time, comm_time, loss_sum, target_tokens, tokens)
