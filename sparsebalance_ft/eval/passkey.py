"""Passkey retrieval evaluation (LongLoRA style): exact match of the greedily decoded key."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from ..data.synthetic import make_kv, make_passkey
from .engine import EvalExample

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass
class RetrievalOptions:
    """Grid of a synthetic retrieval evaluation; `lengths` default to fractions of the context."""

    lengths: list[int] | None = None
    depths: list[float] = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    samples: int = 2
    seed: int = 1234
    max_new_tokens: int = 12


def encode(tokenizer, text: str) -> list[int]:
    """Prompt token ids the way the tokenizer encodes a fresh input (its own special tokens included)."""
    return list(tokenizer(text)["input_ids"])


def special_overhead(tokenizer) -> int:
    """Tokens the tokenizer adds around any text (a BOS for most models, none for the tiny one)."""
    return len(encode(tokenizer, "a")) - len(tokenizer("a", add_special_tokens=False)["input_ids"])


def default_lengths(context: int, smallest: int = 256) -> list[int]:
    """Up to five lengths: the context and its halvings, no shorter than `smallest`."""
    lengths = []
    length = context
    while length >= smallest and len(lengths) < 5:
        lengths.append(length)
        length //= 2
    return sorted(lengths) or [context]


def build_retrieval_examples(tokenizer, options: RetrievalOptions, task: str = "passkey") -> list[EvalExample]:
    """`samples` examples per (length, depth) cell; each prompt is at most `length` tokens long."""
    assert options.lengths, "lengths must be resolved before building examples"
    rng = random.Random(options.seed)
    extra = special_overhead(tokenizer)
    make = make_passkey if task == "passkey" else make_kv
    examples = []
    for length in options.lengths:
        for depth in options.depths:
            for s in range(options.samples):
                record = make(length - extra, depth, rng, tokenizer=tokenizer, fit="prompt")
                ids = encode(tokenizer, record["prompt"])
                examples.append(
                    EvalExample(
                        id=f"{task}-{length}-{depth:g}-{s}",
                        input_ids=ids,
                        answers=[record["answer"]],
                        metric="retrieval_exact",
                        max_new_tokens=options.max_new_tokens,
                        continuation=record["text"][len(record["prompt"]) :].rstrip("."),
                        meta={
                            "length": length,
                            "depth": depth,
                            "actual_depth": record["depth"],
                            "prompt_tokens": len(ids),
                        },
                    )
                )
    return examples


def resolve_lengths(options: RetrievalOptions, context: int, minimum: int = 96) -> RetrievalOptions:
    lengths = options.lengths or default_lengths(context)
    bad = [length for length in lengths if length < minimum]
    if bad:
        from .errors import EvalOptionError

        raise EvalOptionError(f"--lengths: {bad[0]} is too short for a retrieval prompt (at least {minimum} tokens)")
    options.lengths = sorted(set(lengths))
    return options

