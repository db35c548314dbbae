"""One optimizer step on one rank: local micro-batches, then the one gradient all-reduce.

Gradients are summed across ranks by a single explicit all-reduce after all local
micro-batches, rather than by DDP hooks during backward. That costs little for LoRA (its
gradients are small) and makes the quantity SparseBalance minimises observable: the time a
rank spends waiting for the slowest one (`wait_time`) is measured on its own, before the
gradient transfer (`comm_time`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class LocalStep:
    compute_time: float
    wait_time: float
    comm_time: float
    loss_sum: float
    target_tokens: int
    tokens: int


def micro_batch_loss(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy of a packed micro-batch and the number of predicted tokens.

    Labels are -100 at each document's first token, so no document is predicted from the one
    packed before it; the caller divides by the step's global target count, which makes the
    gradient equal to that of the mean loss over every token of the step on every rank.
    """
    # use_cache=False matters: with a cache, transformers skips packed-sequence detection and
    # packed documents would attend to each other.
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    targets = batch["labels"][:, 1:]
    loss = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum"
    )
    return loss, int((targets != -100).sum())


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
                   after_micro_batches=None) -> LocalStep:
    device = accelerator.device
    start = time.perf_counter()
    loss_sum, target_tokens, tokens = 0.0, 0, 0
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        with accelerator.autocast():
            loss, count = micro_batch_loss(model, batch)
        accelerator.backward(loss / max(global_target_tokens, 1))
        loss_sum += float(loss.detach())
        target_tokens += count
        tokens += int(batch["input_ids"].numel())
    if after_micro_batches is not None:  # e.g. layer-level DST: join the exchanges of micro-batches this rank lacks
        after_micro_batches()
    _synchronize(device)
    compute_time = time.perf_counter() - start

    wait_time = comm_time = 0.0
    if _distributed():
        arrived = time.perf_counter()
        dist.all_reduce(torch.zeros(1, device=device))  # returns when the slowest rank arrives
        wait_time = time.perf_counter() - arrived
        sent = time.perf_counter()
        all_reduce_gradients(params)
        _synchronize(device)
        comm_time = time.perf_counter() - sent
    return LocalStep(compute_time, wait_time, comm_time, loss_sum, target_tokens, tokens)
