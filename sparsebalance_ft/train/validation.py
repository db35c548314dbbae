"""Validation loss during training: held-out documents, sharded over ranks, mean loss per token.

    corpus, validation = build_validation(recipe, corpus, tokenizer, rank, world, log)
    ...
    if validation is not None and validation.due(step, total_steps):
        metrics.update(validation.evaluate(accelerator, model, step, controller))

The documents come from `data.eval_path` (loaded like `data.path`, with the same fields and
length policy) or from `data.eval_split`, a share of the training documents chosen by
`training.seed` and removed from the training corpus, so never trained on. Rank r takes every
world-th document (r, r + world, ...), packs them under the training token cap and sums loss
and predicted tokens; one all-reduce adds the ranks' sums, and the loss is their ratio: the
mean over every predicted token, the same on every rank whatever the rank count.

The model runs with the run's attention as configured. Under sparse attention every rank uses
the recipe's default budget (`sparsity.budget`), not the balancer's per-rank one, and no layer
tuner moves it, so that the figure does not depend on which rank a document landed on (nor do
ranks with different batch counts wait in the tuner's exchanges); the attention report of these
forwards is discarded and the rank's budget restored. A sharded model needs every rank in every
layer's collectives: a rank with fewer batches runs one-token padding forwards.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from ..batching.packing import first_fit_decreasing
from ..data import TokenizedCorpus, load_corpus
from ..data.packing import pack_documents
from ..errors import UserError
from ..recipe import Recipe
from .sharding import is_sharded, padding_batch
from .step import micro_batch_loss


def split_for_eval(corpus: TokenizedCorpus, share: float, seed: int) -> tuple[TokenizedCorpus, TokenizedCorpus]:
    """(training, held-out) documents: a `share` of them drawn by `seed`, each part in corpus order."""
    count = int(round(share * len(corpus)))
    if count < 1 or count >= len(corpus):
        raise UserError(
            f"data.eval_split {share} of {len(corpus)} documents holds out {count}: it must leave at least one"
            " document for validation and one for training"
        )
    order = np.random.default_rng(seed).permutation(len(corpus))
    return corpus.subset(np.sort(order[count:])), corpus.subset(np.sort(order[:count]))


class Validation:
    """This rank's share of the validation documents, packed once into micro-batches."""

    def __init__(self, corpus: TokenizedCorpus, token_cap: int, every: int | None, rank: int, world: int,
                 budget: float | None = None, log: Callable[[str], None] | None = None):
        self.corpus = corpus
        self.every = every
        self.budget = budget
        self.log = log
        shares = [np.arange(r, len(corpus), world) for r in range(world)]
        counts = [len(first_fit_decreasing(corpus.lengths[share], token_cap)) for share in shares]
        mine = shares[rank]
        self.micro_batches = [mine[b].tolist() for b in first_fit_decreasing(corpus.lengths[mine], token_cap)]
        self.padding = max(counts) - len(self.micro_batches)  # forwards a sharded model runs for batches it lacks

    def due(self, step: int, total_steps: int) -> bool:
        return step == total_steps or (self.every is not None and step % self.every == 0)

    def local_sums(self, accelerator, model) -> tuple[float, int]:
        """Summed loss and predicted-token count over this rank's documents (no gradients, eval mode)."""
        was_training = model.training
        model.eval()
        loss_sum, count = 0.0, 0
        try:
            with torch.no_grad():
                for indices in self.micro_batches:
                    batch = pack_documents(self.corpus, indices)
                    batch = {k: v.to(accelerator.device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
                    with accelerator.autocast():
                        loss, n = micro_batch_loss(model, batch)  # the trainer's loss: one call, one place
                    loss_sum += float(loss)
                    count += n
                for _ in range(self.padding if is_sharded(model) else 0):
                    with accelerator.autocast():
                        micro_batch_loss(model, padding_batch(accelerator.device), "full")
        finally:
            model.train(was_training)
        return loss_sum, count

    def evaluate(self, accelerator, model, step: int, controller=None) -> dict:
        """`eval_loss` (mean per predicted token over all ranks' documents) and `eval_tokens`; every rank must call it."""
        saved = tuner = None
        if controller is not None:
            saved, tuner = controller.budgets, getattr(controller, "layer_tuner", None)
            controller.set_budget(self.budget)
            controller.layer_tuner = None
        try:
            loss_sum, count = self.local_sums(accelerator, model)
        finally:
            if controller is not None:
                controller.pop_report()  # not a training step's attention: keep it out of the density statistics
                controller.set_budget(saved)
                controller.layer_tuner = tuner
        totals = torch.tensor([loss_sum, count], dtype=torch.float64, device=accelerator.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(totals)
        loss_sum, count = totals.tolist()
        result = {"eval_loss": loss_sum / count if count else None, "eval_tokens": int(count)}
        if self.log is not None and result["eval_loss"] is not None:
            self.log(f"step {step}: eval loss {result['eval_loss']:.4f} over {int(count):,} tokens")
        return result


def build_validation(recipe: Recipe, corpus: TokenizedCorpus, tokenizer, rank: int, world: int,
                     log: Callable[[str], None] | None = None) -> tuple[TokenizedCorpus, Validation | None]:
    """The training corpus (without a held-out split) and the validation, or None when the recipe has no eval data."""
    data = recipe.data
    if data.eval_path is not None:
        held_out = load_corpus(data.model_copy(update={"path": data.eval_path, "eval_path": None}), tokenizer)
    elif data.eval_split is not None:
        corpus, held_out = split_for_eval(corpus, data.eval_split, recipe.training.seed)
    else:
        return corpus, None
    if log is not None:
        log(f"validation: {len(held_out):,} documents, {held_out.total_tokens:,} tokens")
    budget = recipe.sparsity.budget if recipe.model.attn_implementation == "sparsebalance" else None
    return corpus, Validation(held_out, recipe.token_cap, recipe.training.eval_every, rank, world, budget, log)
