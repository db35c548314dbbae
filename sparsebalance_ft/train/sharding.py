"""FSDP2 sharding of the trained model (`training.sharding: fsdp`): what changes when no rank holds it whole.

`shard_model` applies torch's `fully_shard` by hand, as torchtitan does: each decoder layer is one
group, then the root takes what is left (embeddings, final norm, LM head, `modules_to_save` copies
outside the layers). Every parameter becomes a DTensor whose rank-local part is a 1/N slice of dim
0; the frozen base weights too, so the base model's memory divides by the rank count. Not through
accelerate's FSDP plugin: on a CPU run it falls back to replication without a word, and sbft would
then hold the whole model on every rank while believing it sharded.

What the rest of the trainer does differently under sharding:
- each layer all-gathers its weights before its forward and reduce-scatters its gradients in
  backward, so the step does no gradient all-reduce of its own (`step.py`);
- every rank must run every layer the same number of times: a rank with fewer micro-batches (or
  validation batches) runs one-token padding forwards (`padding_batch`);
- a gradient norm over DTensor shards is a partial result (`clip_grad_norm_`);
- checkpoints hold each rank's shards through torch distributed checkpoint, and the adapter and
  `trainable_weights.pt` are gathered whole (`gather_trainable_state`): never one rank's slice.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
# Imported here, before any process group exists: importing torch.distributed.fsdp only after a gloo
# group was made lets a rank abort at exit ("terminate called without an active exception") in about
# one run of five with torch 2.13 (reproduced with `is_sharded` importing it inside the first step).
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
                                    register_fsdp_forward_method)
from torch.distributed.tensor import DTensor

from ..errors import UserError
from ..recipe import Recipe

SHARDED_STATE_DIR = "sharded"  # inside a checkpoint folder: torch distributed checkpoint files, one per rank
_ACCELERATE_FSDP = "ACCELERATE_USE_FSDP"
_ACCELERATE_DEEPSPEED = "ACCELERATE_USE_DEEPSPEED"


class ShardingError(UserError):
    """A sharding setting that cannot run as asked."""


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def check_launch(recipe: Recipe) -> None:
    """Refuse launcher settings that would shard nothing while looking as if they did (one line each).

    sbft never hands its model to accelerate's `prepare`, so an accelerate FSDP or DeepSpeed config
    would be ignored: the run would replicate the model on every rank."""
    if _env_true(_ACCELERATE_DEEPSPEED):
        raise ShardingError(
            "accelerate launch with DeepSpeed: sbft does not run DeepSpeed (ZeRO-3); launch without the DeepSpeed "
            "config and set training.sharding: fsdp to shard the model over the ranks"
        )
    if _env_true(_ACCELERATE_FSDP):
        wanted = "it is already set" if recipe.training.sharding == "fsdp" else "set it instead"
        raise ShardingError(
            "accelerate launch with an FSDP config: sbft shards with training.sharding: fsdp itself "
            f"({wanted}); launch without --use_fsdp / the FSDP config"
        )


def sharding_active(recipe: Recipe, world_size: int) -> bool:
    """Whether this run shards: `fsdp` over two ranks or more (one rank has nothing to shard over)."""
    return recipe.training.sharding == "fsdp" and world_size > 1


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's layers of a Hugging Face causal LM (peft-wrapped or not): the FSDP units."""
    from .loss import split_causal_lm

    layers = getattr(split_causal_lm(model).decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ShardingError(f"training.sharding: fsdp: found no decoder layers in {type(model).__name__}")
    return list(layers)


def shard_model(model: torch.nn.Module, recipe: Recipe, mixed_precision: str, device: torch.device) -> None:
    """Shard `model` in place over every rank of the default process group (layers, then the root).

    `mixed_precision` is the resolved `training.mixed_precision`: with bf16 the layers gather and
    compute in bf16 while gradients are reduced in float32. Gradients are reduced as sums, not means:
    the trainer divides each micro-batch's loss by the step's global target count already."""
    from .loss import SHARDED_LOSS_METHOD, unsharded_micro_batch_loss

    training = recipe.training
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    precision = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                 if mixed_precision == "bf16" else MixedPrecisionPolicy())
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if training.fsdp_cpu_offload else OffloadPolicy()
    options = dict(mesh=mesh, reshard_after_forward=training.fsdp_reshard_after_forward, mp_policy=precision,
                   offload_policy=offload)
    units = [*decoder_layers(model), model]
    for unit in units:
        fully_shard(unit, **options)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    # The trainer calls the loss, not model.forward: make the loss the root's forward (see loss.py).
    setattr(model, SHARDED_LOSS_METHOD, functools.partial(unsharded_micro_batch_loss, model))
    register_fsdp_forward_method(model, SHARDED_LOSS_METHOD)


def padding_batch(device: torch.device) -> dict[str, torch.Tensor]:
    """A one-token micro-batch that predicts nothing: it takes a rank through every layer's collectives
    (and the sparse attention's dense path, so into no attention report) at no loss."""
    one = torch.zeros((1, 1), dtype=torch.long, device=device)
    return {"input_ids": one, "position_ids": one, "labels": torch.full_like(one, -100)}


def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip by the global norm: over DTensor shards the norm is a partial sum, made whole once."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def gather_trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter at full shape, on the CPU of rank 0 ({} elsewhere); all ranks must call it.

    Keys are the model's own parameter names (as `model.state_dict()` has them)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return get_model_state_dict(model, options=options)


def _sharded_options(strict: bool = True):
    return StateDictOptions(ignore_frozen_params=True, strict=strict)


def save_sharded_state(model: torch.nn.Module, optimizer, folder: Path) -> None:
    """Each rank writes its shards of the trainable weights and their optimizer state into `folder`."""
    weights, optim = get_state_dict(model, optimizer, options=_sharded_options())
    dcp.save({"model": weights, "optimizer": optim}, checkpoint_id=str(folder))


def load_sharded_state(model: torch.nn.Module, optimizer, folder: Path) -> None:
    """Read `folder` (written by any number of ranks: DCP reshards) into this rank's shards."""
    weights, optim = get_state_dict(model, optimizer, options=_sharded_options())
    state = {"model": weights, "optimizer": optim}
    dcp.load(state, checkpoint_id=str(folder))
    # not strict: the frozen weights are not in it by design (dcp.load above already failed on any
    # trainable tensor the checkpoint lacks)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_sharded_options(strict=False))
