"""The next-token loss from hidden states, without materialising logits for every token.

A causal LM's forward builds `[tokens, vocab]` logits; at 128K tokens and a 128K vocabulary
those (and their float32 copy and gradient) outweigh the whole model. So the model is run
without its LM head (`split_causal_lm`: the decoder and the head, through peft wrappers, tied
embeddings and `modules_to_save` alike) and the head is applied inside the loss:

- `full`: the head on every token at once (the plain path; smallest compute);
- `chunked`: the head on chunks of tokens, each chunk's logits freed before the next; with
  gradients, each chunk is checkpointed, so backward recomputes that chunk's logits alone. Works
  with any head module (a LoRA-wrapped or trainable `modules_to_save` head trains as usual);
- `fused`: liger-kernel's fused linear cross-entropy (Triton, CUDA only), which never writes
  the logits to memory at all; it needs the head's weight, so not a LoRA-wrapped head;
- `auto`: `fused` on CUDA when liger-kernel is installed and the head allows it, else `chunked`.

The trainer, the profiler and evaluation all call this module, so they compute one loss.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..errors import UserError

LOSS_MODES = ("auto", "full", "chunked", "fused")
IGNORE_INDEX = -100
# Float32 logits per chunk. Bounds the loss's working memory whatever the vocabulary
# (about 680 tokens at 49K entries, 260 at 128K) while keeping each matmul large.
CHUNK_LOGIT_BYTES = 128 * 2**20


class LossConfigError(UserError):
    """`training.loss` asks for a loss this model or machine cannot compute."""


class CausalLMParts(NamedTuple):
    decoder: torch.nn.Module  # input ids -> last hidden states
    head: torch.nn.Module  # hidden states -> logits (the LM head, possibly wrapped by peft)
    vocab_size: int
    softcap: float | None  # Gemma 2's final-logit soft-capping
    logit_transform: Callable[[torch.Tensor], torch.Tensor] | None  # scaling / soft-capping the model applies


def _logit_transform(config) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What some families do to logits after the head (Gemma 2 soft-capping, Cohere / Granite scaling)."""
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        return lambda x: torch.tanh(x / cap) * cap
    scale = getattr(config, "logit_scale", None)
    if scale not in (None, 1, 1.0):
        return lambda x: x * scale
    divisor = getattr(config, "logits_scaling", None)
    if divisor not in (None, 1, 1.0):
        return lambda x: x / divisor
    return None


def split_causal_lm(model: torch.nn.Module) -> CausalLMParts:
    """The decoder (run for hidden states) and the LM head of a Hugging Face causal LM or its peft wrapper."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = causal_lm.get_output_embeddings() if hasattr(causal_lm, "get_output_embeddings") else None
    if head is None:
        raise LossConfigError(f"{type(causal_lm).__name__} has no LM head (get_output_embeddings() is None)")
    config = getattr(causal_lm, "config", None)
    config = getattr(config, "text_config", None) or config
    return CausalLMParts(causal_lm.get_decoder(), head, int(config.vocab_size),
                         getattr(config, "final_logit_softcapping", None) or None, _logit_transform(config))


def hidden_states(parts: CausalLMParts, **inputs) -> torch.Tensor:
    """The decoder's last hidden states `[batch, tokens, hidden]`.

    use_cache=False matters: with a cache, transformers skips packed-sequence detection and
    packed documents would attend to each other.
    """
    return parts.decoder(**inputs, use_cache=False).last_hidden_state


def _logits(parts: CausalLMParts, hidden: torch.Tensor) -> torch.Tensor:
    logits = parts.head(hidden)
    return parts.logit_transform(logits) if parts.logit_transform is not None else logits


def _cross_entropy(parts: CausalLMParts, hidden: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    # float32 whatever the compute dtype: log-softmax over a large vocabulary needs its range
    return F.cross_entropy(_logits(parts, hidden).float(), targets, ignore_index=IGNORE_INDEX, reduction=reduction)


def chunk_tokens(vocab_size: int) -> int:
    return max(1, CHUNK_LOGIT_BYTES // (4 * max(int(vocab_size), 1)))


def _chunked(parts: CausalLMParts, hidden: torch.Tensor, targets: torch.Tensor, reduction: str,
             chunk: int) -> torch.Tensor:
    if hidden.shape[0] <= chunk:  # one chunk: recomputing it would save no memory, only time
        return _cross_entropy(parts, hidden, targets, reduction)
    recompute = torch.is_grad_enabled()
    pieces = []
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        if recompute:
            pieces.append(checkpoint(_cross_entropy, parts, h, t, reduction, use_reentrant=False))
        else:
            pieces.append(_cross_entropy(parts, h, t, reduction))
    return torch.stack(pieces).sum() if reduction == "sum" else torch.cat(pieces)


@functools.lru_cache(maxsize=None)
def _liger_loss():
    """liger-kernel's loss class, or None (looked up once: a failed import is not cached by Python)."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return LigerFusedLinearCrossEntropyLoss


def _head_linear(head: torch.nn.Module) -> torch.nn.Linear | None:
    """The plain linear layer behind the head (the trained copy under peft's `modules_to_save`), if any."""
    copies = getattr(head, "modules_to_save", None)
    if copies is not None:
        active = getattr(head, "active_adapter", None)
        active = active[0] if isinstance(active, (list, tuple)) else active
        head = copies[active] if active in copies else getattr(head, "original_module", head)
    return head if type(head) is torch.nn.Linear else None


def fused_unavailable(parts: CausalLMParts, device: torch.device) -> str | None:
    """Why the fused loss cannot run here (None when it can)."""
    if device.type != "cuda":
        return f"the fused loss runs on CUDA only (device is {device.type})"
    if _liger_loss() is None:
        return "the fused loss needs liger-kernel (pip install liger-kernel)"
    if _head_linear(parts.head) is None:
        return f"the fused loss needs a plain linear LM head, not {type(parts.head).__name__} (LoRA on lm_head?)"
    if parts.logit_transform is not None and parts.softcap is None:
        return "the fused loss cannot apply this model's logit scaling"
    return None


def resolve_mode(mode: str, parts: CausalLMParts, device: torch.device) -> str:
    """The concrete loss of `training.loss` on this model and device; one-line error if impossible."""
    if mode not in LOSS_MODES:
        raise LossConfigError(f"training.loss: expected one of {', '.join(LOSS_MODES)}, got {mode!r}")
    if mode in ("auto", "fused"):
        why_not = fused_unavailable(parts, device)
        if why_not is None:
            return "fused"
        if mode == "fused":
            raise LossConfigError(f"training.loss: fused: {why_not}")
        return "chunked"
    return mode


def _fused(parts: CausalLMParts, hidden: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    linear = _head_linear(parts.head)
    loss = _liger_loss()(ignore_index=IGNORE_INDEX, reduction=reduction, softcap=parts.softcap)
    return loss(linear.weight, hidden, targets, linear.bias)


def token_loss(parts: CausalLMParts, hidden: torch.Tensor, targets: torch.Tensor, mode: str = "auto",
               reduction: str = "sum") -> torch.Tensor:
    """Cross-entropy of `targets [n]` given `hidden [n, hidden]` (positions -100 count zero).

    `reduction="sum"` gives a scalar, `"none"` the per-token losses.
    """
    mode = resolve_mode(mode, parts, hidden.device)
    if mode == "fused":
        return _fused(parts, hidden, targets, reduction)
    if mode == "chunked":
        return _chunked(parts, hidden, targets, reduction, chunk_tokens(parts.vocab_size))
    return _cross_entropy(parts, hidden, targets, reduction)


# A sharded model's root (train/sharding.py) carries the loss below as an FSDP forward method under
# this name: the loss runs the decoder and the head itself rather than the model's forward, so that is
# where the root must gather the weights it owns (embeddings, norm, head) and hook their gradients.
SHARDED_LOSS_METHOD = "sbft_micro_batch_loss"


def micro_batch_loss(model, batch: dict[str, torch.Tensor], mode: str = "auto") -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy of a packed micro-batch and the number of predicted tokens.

    Labels are -100 at each document's first token, so no document is predicted from the one
    packed before it; the caller divides by the step's global target count, which makes the
    gradient equal to that of the mean loss over every token of the step on every rank.
    """
    sharded = getattr(model, SHARDED_LOSS_METHOD, None)
    if sharded is not None:
        return sharded(batch, mode)
    return unsharded_micro_batch_loss(model, batch, mode)


def unsharded_micro_batch_loss(model, batch: dict[str, torch.Tensor], mode: str = "auto") -> tuple[torch.Tensor, int]:
    """`micro_batch_loss` itself, without the sharded root's weight gathering around it."""
    parts = split_causal_lm(model)
    hidden = hidden_states(parts, input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    targets = batch["labels"][:, 1:]
    loss = token_loss(parts, hidden[:, :-1].flatten(0, 1), targets.flatten(), mode)
    return loss, int((targets != IGNORE_INDEX).sum())


__all__ = ["LOSS_MODES", "LossConfigError", "CausalLMParts", "split_causal_lm", "hidden_states", "token_loss",
           "micro_batch_loss", "unsharded_micro_batch_loss", "SHARDED_LOSS_METHOD", "resolve_mode", "fused_unavailable", "chunk_tokens"]
