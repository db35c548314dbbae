"""Atomic, verified, pruned checkpoints on top of accelerate's `save_state`.

Every rank writes into `checkpoint-N.tmp` (accelerate stores each rank's RNG state there, and
each rank adds its own `rank_state_R.pt`: balancer and sampler state differ per rank); after a
barrier the main process adds the trainable weights and a completion marker listing every
file's size, and renames the folder to `checkpoint-N`. A crash mid-write therefore leaves only a
`.tmp` folder, which is ignored; a file truncated later is found by its size before anything
loads, and resuming falls back to the newest intact checkpoint.

A sharded model (`training.sharding: fsdp`) adds `sharded/`, where every rank writes its shards
of the trainable weights and their optimizer state with torch distributed checkpoint (which
would reshard on load; the batch sampler, though, resumes only on the rank count it was saved
with); `trainable_weights.pt` is then gathered whole, so evaluation reads it as from any run.

Checkpoints assume a filesystem that every rank shares (rank 0 writes the marker after every
rank has written its files into the same folder).
"""
from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import UserError
from .rope import RopeSetting, write_rope_record
from .sharding import SHARDED_STATE_DIR, gather_trainable_state, is_sharded, load_sharded_state, save_sharded_state

COMPLETE_MARKER = "COMPLETE"
ADAPTER_WEIGHTS = "trainable_weights.pt"
_NAME = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(UserError):
    """A checkpoint that cannot be resumed: truncated, missing, or not visible from a rank."""


class CheckpointMismatchError(CheckpointError):
    """Saved trainable weights that the recipe's model does not have (different LoRA settings?)."""


def rank_state_file(rank: int) -> str:
    return f"rank_state_{rank}.pt"


def checkpoint_step(path: Path) -> int:
    match = _NAME.match(path.name)
    if not match:
        raise CheckpointError(f"{path}: not a checkpoint folder (expected checkpoint-N)")
    return int(match.group(1))


def checkpoint_dirs(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first by step number (checkpoint-10 after checkpoint-9)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in root.iterdir() if _NAME.match(p.name) and (p / COMPLETE_MARKER).is_file()]
    return [path for _, path in sorted(found)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    dirs = checkpoint_dirs(output_dir)
    return dirs[-1] if dirs else None


def _manifest(path: Path) -> dict[str, int]:
    return {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file() and f.name != COMPLETE_MARKER}


def checkpoint_problem(path: Path) -> str | None:
    """The first missing or truncated file of a checkpoint, as a phrase; None when it is intact.

    Markers written before sizes were recorded hold only the step number: nothing to compare, so intact."""
    try:
        marker = json.loads((path / COMPLETE_MARKER).read_text())
    except FileNotFoundError:
        return f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker)"
    except ValueError:
        return f"{path / COMPLETE_MARKER} is damaged"
    if not isinstance(marker, dict):
        return None
    for name, size in marker.get("files", {}).items():
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        actual = file.stat().st_size
        if actual != size:
            return f"{file} is truncated ({actual} of {size} bytes)"
    return None


def choose_checkpoint(output_dir: str | Path, requested: str | Path | None = None) -> Path | None:
    """The checkpoint to resume: `requested` if intact, else the newest intact one in `output_dir`.

    A damaged newest checkpoint is skipped with a warning naming its bad file; a damaged requested
    one, or no intact one at all, is a `CheckpointError` (one line)."""
    if requested is not None:
        path = Path(requested)
        if not path.is_dir():
            raise CheckpointError(f"--resume: checkpoint not found: {path}")
        problem = checkpoint_problem(path)
        if problem:
            raise CheckpointError(f"--resume: {problem}")
        return path
    candidates = checkpoint_dirs(output_dir)
    for newer, path in enumerate(reversed(candidates)):
        problem = checkpoint_problem(path)
        if problem is None:
            if newer:
                warnings.warn(f"resuming from {path.name}, the newest intact checkpoint", stacklevel=2)
            return path
        warnings.warn(f"skipping a damaged checkpoint: {problem}", stacklevel=2)
    if candidates:
        raise CheckpointError(f"--resume: no intact checkpoint in {output_dir}: {checkpoint_problem(candidates[-1])}")
    return None


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Only what trains: peft's adapter state (LoRA and modules_to_save) keeps a checkpoint of an 8B
    model small. Without LoRA (full fine-tuning) peft has no say, so it is every trainable parameter.

    A sharded model's tensors are gathered whole: every rank must call it, and only rank 0 gets them."""
    from peft import PeftModel, get_peft_model_state_dict

    if is_sharded(model):
        full = gather_trainable_state(model)
        if not full:  # not rank 0
            return {}
        return get_peft_model_state_dict(model, state_dict=full) if isinstance(model, PeftModel) else full
    if isinstance(model, PeftModel):
        return {name: t.detach().cpu().clone() for name, t in get_peft_model_state_dict(model).items()}
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters() if p.requires_grad}


def save_adapter(model: torch.nn.Module, adapter_dir: Path, tokenizer, is_main: bool) -> None:
    """The run's final adapter (or, without LoRA, model) as `save_pretrained` writes it; every rank must
    call it. A sharded model's tensors are gathered whole first: a rank's slice is never saved."""
    state = gather_trainable_state(model) if is_sharded(model) else None
    if is_main:
        model.save_pretrained(adapter_dir, state_dict=state)
        tokenizer.save_pretrained(adapter_dir)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def restore_trainable(model: torch.nn.Module, path: Path) -> None:
    """Load weights saved by `trainable_state` back into `model`, refusing names it lacks."""
    from peft import PeftModel, set_peft_model_state_dict

    saved = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(model, PeftModel):
        unexpected = set_peft_model_state_dict(model, saved).unexpected_keys
    else:
        unexpected = [name for name in saved if name not in dict(model.named_parameters())]
        if not unexpected:
            model.load_state_dict(saved, strict=False)
    if unexpected:
        raise CheckpointMismatchError(
            f"{path}: holds weights the recipe's model lacks (e.g. {unexpected[0]}); check the lora settings"
        )


def _prune(output_dir: str | Path, step: int, keep: int) -> None:
    """Keep the `keep` newest checkpoints up to `step`; never one of a later step (it is not this run's to delete)."""
    mine = [path for path in checkpoint_dirs(output_dir) if checkpoint_step(path) <= step]
    for old in mine[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(
    accelerator, model: torch.nn.Module, output_dir: str | Path, step: int, keep: int, rank_state: dict | None = None,
    rope: RopeSetting | None = None,
    optimizer=None,
) -> Path:
    """`optimizer`: needed for a sharded model, whose optimizer is not accelerate's to save."""
    final = Path(output_dir) / f"checkpoint-{step}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    tmp.mkdir(parents=True, exist_ok=True)
    torch.save(rank_state or {}, tmp / rank_state_file(accelerator.process_index))
    if is_sharded(model):
        save_sharded_state(model, optimizer, tmp / SHARDED_STATE_DIR)
    weights = trainable_state(model)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(weights, tmp / ADAPTER_WEIGHTS)
        write_rope_record(tmp, rope)  # a resume with another rope setting is refused against it
        (tmp / COMPLETE_MARKER).write_text(json.dumps({"step": step, "files": _manifest(tmp)}, indent=1) + "\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _prune(output_dir, step, keep)
    accelerator.wait_for_everyone()
    return final


def _require_visible(path: Path, rank: int) -> None:
    if not (path / COMPLETE_MARKER).is_file():
        raise CheckpointError(
            f"rank {rank} cannot see {path}: checkpoints need a filesystem that every rank shares"
        )


def _require_same_sharding(path: Path, sharded: bool) -> None:
    saved = (path / SHARDED_STATE_DIR).is_dir()
    if saved != sharded:
        was, now = ("sharded", "unsharded") if saved else ("unsharded", "sharded")
        raise CheckpointError(
            f"{path} was saved by a {was} run and this run is {now}: resume with the training.sharding it was"
            " saved with (fsdp shards over two ranks or more)"
        )


def load_checkpoint(accelerator, model: torch.nn.Module, path: Path, optimizer=None) -> dict:
    """Restore optimizer, scheduler, RNG and registered objects, then the trainable weights; returns
    this rank's own state (its file, or rank 0's when the run had fewer ranks before)."""
    rank = accelerator.process_index
    _require_visible(path, rank)
    _require_same_sharding(path, is_sharded(model))
    own = path / rank_state_file(rank)
    if not own.is_file():
        warnings.warn(f"{own.name} missing (the run had fewer ranks): this rank starts from rank 0's state", stacklevel=2)
        own = path / rank_state_file(0)
    try:
        accelerator.load_state(str(path))
        if is_sharded(model):
            load_sharded_state(model, optimizer, path / SHARDED_STATE_DIR)
        else:
            restore_trainable(model, path / ADAPTER_WEIGHTS)
        return torch.load(own, map_location="cpu", weights_only=False) if own.is_file() else {}
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as error:
        if isinstance(error, UserError):
            raise
        first = (str(error).splitlines() or [type(error).__name__])[0]
        raise CheckpointError(f"{path}: cannot be loaded ({type(error).__name__}: {first})") from None
