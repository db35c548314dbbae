"""The training loop: accelerate for processes, precision, trackers and checkpoints; one step at a time.

Per optimizer step every rank (1) takes its micro-batches from the step's plan, which every
rank computes identically, (2) asks the balancer for its attention budget, (3) runs its
micro-batches, (4) waits for the slowest rank and sums gradients, (5) steps the optimizer and
(6) reports timings and densities, which feed the density statistics for the next plan.

With `training.sharding: fsdp` (two ranks or more) the model is sharded after loading
(`sharding.py`): its gradients are reduce-scattered inside (3), and its optimizer and checkpoint
state are each rank's shards rather than accelerate's.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..data import load_corpus, pack_documents
from ..recipe import Recipe, describe_setup, dump_recipe
from .balancing import build_balancing
from .checkpoint import choose_checkpoint, load_checkpoint, save_adapter, save_checkpoint
from .memory_report import report_memory
from .metrics import MetricsWriter, RankRecord, gather_records, step_metrics
from .model import check_model_dir, full_training_summary, load_model, load_tokenizer, resolve_mixed_precision
from .output_dir import RunLock, check_output_dir, clear_output_dir
from .optim import build_optimizer, build_scheduler
from .progress import StepProgress
from .rope import check_rope_record, recipe_rope, write_rope_record
from .sharding import check_launch, clip_grad_norm_, shard_model, sharding_active
from .step import run_local_step
from .trackers import tracker_names
from .validation import build_validation

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Counters restored on `--resume` (registered with accelerate's checkpointing, so saved by rank 0:
    they are equal on every rank; per-rank balancer state goes to each rank's own file)."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.epoch, self.step_in_epoch = state["step"], state["epoch"], state["step_in_epoch"]


def make_accelerator(recipe: Recipe, cpu: bool | None = None):
    """The run's Accelerator; `cpu` forces the CPU (or, False, the GPU), by default the GPU when there is one."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

    out = recipe.training.output_dir
    return Accelerator(
        cpu=not torch.cuda.is_available() if cpu is None else cpu,
        mixed_precision=resolve_mixed_precision(recipe.training.mixed_precision),
        log_with=tracker_names(recipe.training) or None,
        project_config=ProjectConfiguration(project_dir=out, logging_dir=str(Path(out) / "tensorboard")),
        # A rank that stops answering fails the others' next collective after this long, instead of never.
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=recipe.training.collective_timeout))],
    )


def preflight(recipe: Recipe, resume: bool | str | Path = False, overwrite: bool = False) -> None:
    """Every check that needs no process group: launcher, precision, model folder, output folder (one line each)."""
    check_launch(recipe)
    resolve_mixed_precision(recipe.training.mixed_precision)
    check_model_dir(recipe)
    check_output_dir(recipe.training.output_dir, resume, overwrite)


def _resume_checkpoint(accelerator, out: Path, resume: bool | str | Path):
    """Rank 0 picks the checkpoint (warning about damaged ones it skips); every rank gets its path."""
    from accelerate.utils import broadcast_object_list

    chosen = [None]
    if accelerator.is_main_process:
        path = choose_checkpoint(out, None if resume is True else resume)
        chosen = [None if path is None else str(path)]
    if accelerator.num_processes > 1:
        broadcast_object_list(chosen, from_process=0)
    return None if chosen[0] is None else Path(chosen[0])


def _broadcast_trainable(params: list[torch.nn.Parameter]) -> None:
    """Start every rank from rank 0's adapter weights, whatever each rank's RNG did."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        for p in params:
            dist.broadcast(p.data, src=0)


def _injected_failure(rank: int, step: int) -> None:
    """`SBFT_FAIL_AT=RANK:STEP` makes that rank raise at that step: how tests check that a dying rank stops all."""
    spec = os.environ.get("SBFT_FAIL_AT")
    if spec and spec == f"{rank}:{step}":
        raise RuntimeError(f"injected failure on rank {rank} at step {step} (SBFT_FAIL_AT)")


def _tracker_config(recipe: Recipe) -> dict:
    flat = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}{key}.", item)
        elif isinstance(value, (int, float, str, bool)):
            flat[prefix[:-1]] = value
        else:
            flat[prefix[:-1]] = str(value)

    walk("", recipe.model_dump(mode="json"))
    return flat


def train(recipe: Recipe, resume: bool | str | Path = False, console=None, overwrite: bool = False) -> dict:
    """Run the recipe; returns a summary (steps, final loss, wall time, output paths).

    `resume` is True (the newest intact checkpoint of the output dir) or a checkpoint folder; a fresh
    run refuses a non-empty output dir unless `overwrite`, which clears it first. Rank 0 holds the
    output dir's lock for the whole run."""
    preflight(recipe, resume, overwrite)  # every rank, before any rank writes
    accelerator = make_accelerator(recipe)
    out = Path(recipe.training.output_dir)
    accelerator.wait_for_everyone()
    lock = RunLock(out)
    if accelerator.is_main_process:
        lock.acquire()
    try:
        return _train(recipe, accelerator, resume, overwrite, console)
    finally:
        lock.release()


def _train(recipe: Recipe, accelerator, resume: bool | str | Path, overwrite: bool, console) -> dict:
    from accelerate.utils import set_seed
    from rich.console import Console

    console = console or Console(stderr=True)
    rank, world = accelerator.process_index, accelerator.num_processes
    out = Path(recipe.training.output_dir)
    if accelerator.is_main_process:
        if overwrite and not resume:
            clear_output_dir(out)
        dump_recipe(recipe, out / "recipe.yaml")
    set_seed(recipe.training.seed)

    tokenizer = load_tokenizer(recipe)
    with accelerator.main_process_first():  # the first rank tokenizes, the others reuse its cache
        corpus = load_corpus(recipe.data, tokenizer)
        corpus, validation = build_validation(recipe, corpus, tokenizer, rank, world, console.print if accelerator.is_main_process else None)
    if accelerator.is_main_process:
        console.print(f"data: {corpus.describe()}", highlight=False)
        for line in describe_setup(recipe):
            console.print(line, highlight=False, markup=False, soft_wrap=True)
    if not accelerator.is_main_process:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one "Loading weights" bar, not one per rank
    rope = recipe_rope(recipe)
    model, _ = load_model(recipe)
    if accelerator.is_main_process:
        for line in (rope and rope.describe(), full_training_summary(model)):
            if line:
                console.print(line, highlight=False)
    sharded = sharding_active(recipe, world)
    if not sharded:
        model.to(accelerator.device)
    _broadcast_trainable([p for p in model.parameters() if p.requires_grad])
    if sharded:  # after the broadcast: each rank keeps its slice of rank 0's weights
        shard_model(model, recipe, accelerator.mixed_precision, accelerator.device)
    params = [p for p in model.parameters() if p.requires_grad]

    balancing = build_balancing(recipe, model, corpus.lengths, world, documents=corpus)
    steps_per_epoch = balancing.sampler.steps_per_epoch
    if steps_per_epoch == 0:
        raise RuntimeError("the dataset has fewer documents than one step needs; lower training.docs_per_rank")
    total_steps = recipe.training.max_steps or recipe.training.epochs * steps_per_epoch

    optimizer = build_optimizer(recipe.training, params)
    if not sharded:  # sharded optimizer state is saved by each rank (checkpoint.py), not by accelerate's rank 0
        optimizer = accelerator.prepare(optimizer)
    scheduler = build_scheduler(recipe.training, optimizer, total_steps)
    accelerator.register_for_checkpointing(scheduler)
    state = TrainState()
    accelerator.register_for_checkpointing(state)

    if resume:
        checkpoint = _resume_checkpoint(accelerator, out, resume)
        if checkpoint is None:
            if accelerator.is_main_process:
                console.print(f"resume: no checkpoint in {out}, starting from scratch")
        else:
            check_rope_record(checkpoint, rope, "--resume")
            balancing.load_state_dict(load_checkpoint(accelerator, model, checkpoint, optimizer))
            if accelerator.is_main_process:
                console.print(f"resumed from {checkpoint} at step {state.step}")
    if recipe.training.sharding == "fsdp" and not sharded and accelerator.is_main_process:
        console.print("note: training.sharding: fsdp on one rank has nothing to shard over: training unsharded")
    finished_before = bool(resume) and state.step >= total_steps
    writer = MetricsWriter(accelerator, out, resume_step=state.step)
    accelerator.init_trackers("sbft", config=_tracker_config(recipe))  # no-op with report_to: none

    model.train()
    start_step = state.step
    started = time.perf_counter()
    last_loss = math.nan
    progress = StepProgress(total_steps, state.step, enabled=accelerator.is_main_process, console=console)
    with progress:
        while state.step < total_steps:
            step_start = time.perf_counter()
            _injected_failure(rank, state.step)
            plan = balancing.sampler.plan(state.epoch, state.step_in_epoch)
            mine = plan.micro_batches[rank]
            decision = balancing.before_step(mine)
            batches = [pack_documents(corpus, mb) for mb in mine if mb]
            padding = len(mine) - len(batches) if sharded else 0
            global_targets = int(sum(corpus.target_tokens[i] for ranks in plan.micro_batches for mb in ranks for i in mb))
            local = run_local_step(accelerator, model, batches, global_targets, params, recipe.training.loss,
                                   after_micro_batches=balancing.finish_micro_batches, padding=padding,
                                   padding_context=lambda: balancing.padding_forward(model))
            if recipe.training.max_grad_norm and sharded:
                clip_grad_norm_(params, recipe.training.max_grad_norm)
            elif recipe.training.max_grad_norm:
                accelerator.clip_grad_norm_(params, recipe.training.max_grad_norm)
            optimizer.step()
            if state.step == start_step:  # gradients and optimizer state exist now, until zero_grad
                report_memory(model, optimizer, accelerator.device, out, accelerator.is_main_process, console.print)
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            attention = balancing.after_step(local.compute_time, local.wait_time)

            record = RankRecord(
                compute_time=local.compute_time,
                wait_time=local.wait_time,
                predicted_time=decision.predicted_time,
                budget=decision.budget,
                density=attention.density,
                recall=attention.recall,
                tokens=local.tokens,
                docs=sum(len(mb) for mb in mine),
                loss_sum=local.loss_sum,
                target_tokens=local.target_tokens,
            )
            records = gather_records(record, accelerator.device)
            state.step += 1
            state.step_in_epoch += 1
            if state.step_in_epoch >= steps_per_epoch:
                state.epoch, state.step_in_epoch = state.epoch + 1, 0
            metrics = step_metrics(
                state.step, state.epoch, scheduler.get_last_lr()[0], time.perf_counter() - step_start, records
            )
            metrics.update(balancing.step_metrics())
            last_loss = metrics["loss"]
            if validation is not None and validation.due(state.step, total_steps):
                metrics.update(validation.evaluate(accelerator, model, state.step, balancing.controller))
            writer.write(metrics)
            progress.update(state.step, metrics, every=recipe.training.log_every)

            every = recipe.training.checkpoint_every
            if every and (state.step % every == 0 or state.step == total_steps):
                save_checkpoint(accelerator, model, out, state.step, recipe.training.keep_checkpoints,
                                rank_state=balancing.state_dict(), rope=rope, optimizer=optimizer)

    adapter_dir = out / "adapter"
    if not (finished_before and adapter_dir.is_dir()):
        save_adapter(model, adapter_dir, tokenizer, accelerator.is_main_process)
        if accelerator.is_main_process:
            write_rope_record(adapter_dir, rope)
    summary = balancing.service.warnings_summary() if balancing.service is not None else None
    if summary:
        log.warning(summary)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return {
        "steps": state.step,
        "final_loss": last_loss,
        "wall_time": time.perf_counter() - started,
        "output_dir": str(out),
        "adapter_dir": str(adapter_dir),
        "world_size": world,
        "finished_before": finished_before,
        "total_steps": total_steps,
    }

