"""Does an exported model reproduce the trained one? `sbft export --verify-tokens N`.

The check users of context extension need: the merged checkpoint, read by plain
`AutoModelForCausalLM.from_pretrained` (so with whatever rope setting and positions its config.json
carries), against the trained model itself (base + adapter, unmerged), both in float32 with dense SDPA, on
N tokens, which may run past the native length. A lost scaling shows up as logits differing by whole units.

A merge cannot be bit-exact: `(W + s B A) x` and `W x + s B (A x)` round differently in float32, and the
difference grows with depth and length. So the check also measures the float32 rounding floor: the trained
model in float32 against the same model in float64. An export whose distance to the float64 model is of
the same order as the trained float32 model's own (at most twice it: two independent roundings) is as
faithful as float32 allows, whatever the absolute figure; a lost scaling is orders of magnitude above it.

Logits are compared a slice of positions at a time from the final hidden states, so a 16K-token check does
not hold three [tokens x vocabulary] tensors at once.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..recipe import Recipe, recipe_from_dict
from .model import apply_lora, load_base_model

_SLICE = 1024  # positions per logits slice


@dataclass
class ExportCheck:
    tokens: int
    export_vs_trained: float  # max |logit difference|, both float32
    trained_vs_float64: float  # the float32 rounding floor
    export_vs_float64: float
    max_abs_logit: float

    @property
    def within_floor(self) -> bool:
        """The export is about as close to exact arithmetic as the trained model is (at most twice as far)."""
        return self.export_vs_float64 <= 2.0 * self.trained_vs_float64

    def record(self) -> dict:
        return {**asdict(self), "within_floor": self.within_floor}

    def describe(self) -> str:
        verdict = "within" if self.within_floor else "ABOVE"
        return (f"export check at {self.tokens} tokens (float32, dense SDPA): max |logit diff| export vs trained "
                f"{self.export_vs_trained:.2e} (logits up to {self.max_abs_logit:.1f}); float32 rounding floor "
                f"(trained float32 vs float64) {self.trained_vs_float64:.2e}, export vs float64 "
                f"{self.export_vs_float64:.2e}: {verdict} the floor")


def _dense_float32(recipe: Recipe) -> Recipe:
    data = recipe.model_dump(mode="json")
    data["model"].update(dtype="float32", attn_implementation="sdpa", gradient_checkpointing=False)
    data["balance"]["tuning"] = "none"  # nothing to tune under dense attention (a tuning recipe would be refused)
    return recipe_from_dict(data, "export check")


def probe_ids(vocab_size: int, tokens: int, seed: int = 0) -> torch.Tensor:
    """Fixed pseudo-random token ids (no data needed at export time): the check compares two computations
    of the same function, so any input that reaches every position serves."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, tokens), generator=generator)


def _parts(model):
    """(decoder, output head) of a causal LM, through a peft wrapper if there is one."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.get_decoder(), inner.get_output_embeddings()


@torch.no_grad()
def _final_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    decoder, _ = _parts(model)
    return decoder(input_ids=ids).last_hidden_state


@torch.no_grad()
def _max_logit_diff(head_a, hidden_a: torch.Tensor, head_b, hidden_b: torch.Tensor) -> tuple[float, float]:
    """(max |head_a(hidden_a) - head_b(hidden_b)|, max |head_a(hidden_a)|), a slice of positions at a time."""
    diff, largest = 0.0, 0.0
    for start in range(0, hidden_a.shape[1], _SLICE):
        a = head_a(hidden_a[:, start:start + _SLICE]).double()
        b = head_b(hidden_b[:, start:start + _SLICE]).double()
        diff = max(diff, float((a - b).abs().max()))
        largest = max(largest, float(a.abs().max()))
    return diff, largest


def check_export(recipe: Recipe, adapter_dir: str | Path, export_dir: str | Path, tokens: int) -> ExportCheck:
    """Compare the export with the trained model on `tokens` tokens (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    dense = _dense_float32(recipe)
    trained = apply_lora(load_base_model(dense), dense, adapter_dir, trainable=False).eval()
    plain = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = probe_ids(plain.config.vocab_size, tokens)

    hidden_trained = _final_hidden(trained, ids)
    hidden_plain = _final_hidden(plain, ids)
    head_trained, head_plain = _parts(trained)[1], _parts(plain)[1]
    export_vs_trained, largest = _max_logit_diff(head_plain, hidden_plain, head_trained, hidden_trained)

    head_trained32 = copy.deepcopy(head_trained)
    trained.double()  # in place: head_trained is now the float64 head
    hidden_exact = _final_hidden(trained, ids)
    floor, _ = _max_logit_diff(head_trained32, hidden_trained, head_trained, hidden_exact)
    export_vs_exact, _ = _max_logit_diff(head_plain, hidden_plain, head_trained, hidden_exact)
    return ExportCheck(tokens, export_vs_trained, floor, export_vs_exact, largest)
