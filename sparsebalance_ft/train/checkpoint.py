"""Atomic, pruned checkpoints on top of accelerate's `save_state`.

Every rank writes into `checkpoint-N.tmp` (accelerate stores each rank's RNG state there);
after a barrier the main process adds the LoRA adapter and a completion marker and renames the
folder to `checkpoint-N`. A crash mid-write therefore leaves only a `.tmp` folder, which
`latest_checkpoint` ignores, never a checkpoint that loads wrong.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

from ..errors import UserError

COMPLETE_MARKER = "COMPLETE"
ADAPTER_WEIGHTS = "trainable_weights.pt"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_dirs(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _NAME.match(path.name)
        if match and (path / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    dirs = checkpoint_dirs(output_dir)
    return dirs[-1] if dirs else None


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Only the parameters that train (LoRA and modules_to_save): a checkpoint of an 8B model stays small."""
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(accelerator, model: torch.nn.Module, output_dir: str | Path, step: int, keep: int) -> Path:
    final = Path(output_dir) / f"checkpoint-{step}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if accelerator.is_main_process:
        torch.save(trainable_state(model), tmp / ADAPTER_WEIGHTS)
        (tmp / COMPLETE_MARKER).write_text(f"{step}\n")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in checkpoint_dirs(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


class CheckpointMismatchError(UserError):
    """Saved trainable weights that the recipe's model does not have (different LoRA settings?)."""


def restore_trainable(model: torch.nn.Module, path: Path) -> None:
    """Copy weights saved by `trainable_state` back into `model`, refusing names it lacks."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    params = dict(model.named_parameters())
    missing = [name for name in saved if name not in params]
    if missing:
        raise CheckpointMismatchError(
            f"{path}: holds weights the recipe's model lacks (e.g. {missing[0]}); check the lora settings"
        )
    with torch.no_grad():
        for name, value in saved.items():
            params[name].copy_(value)


def load_checkpoint(accelerator, model: torch.nn.Module, path: Path) -> None:
    """Restore optimizer, scheduler, RNG and registered objects, then the trainable weights."""
    accelerator.load_state(str(path))
    restore_trainable(model, path / ADAPTER_WEIGHTS)
