"""Optimizer and learning-rate schedule from the recipe's `training:` section."""
from __future__ import annotations

import math

import torch

from ..recipe import TrainingConfig


def build_optimizer(cfg: TrainingConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, momentum=0.9)
    return torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)


def lr_factor(step: int, total_steps: int, warmup_steps: int, kind: str) -> float:
    """Linear warm-up, then constant, linear or cosine decay to zero at `total_steps`."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(cfg: TrainingConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, cfg.warmup_steps, cfg.lr_scheduler)
    )
