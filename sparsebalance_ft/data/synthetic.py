"""Synthetic long-context retrieval tasks: passkey and key-value retrieval.

Both generators hide one answer in a long context at a controlled *depth* (0.0 = at the very
start of the haystack, 1.0 = at its very end) and a controlled *length* (tokens when a tokenizer
is given, else an approximation of about four characters per token). Every record says exactly
where the answer is (`needle_start`/`needle_end` character offsets into `text`, `depth` as the
achieved share of haystack units before the needle), so tests and evaluations can check it.

Records are plain dicts written as JSONL. `text` is the full training sequence (prompt followed
by the answer), so `data.path` can point at the file and the normal loader trains on it; `prompt`
is the same text without the answer, which is what an evaluation feeds the model.
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Sequence

from ..errors import UserError

TaskName = Literal["passkey", "kv"]
TASKS: tuple[str, ...] = ("passkey", "kv")

# LongLoRA-style passkey layout (wording ours).
PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and remember it. I will ask you about it afterwards."
)
PASSKEY_FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key? The pass key is"

KV_INTRO = "Extract the value that belongs to the requested key from the JSON object below.\n\nJSON data:\n{"
KV_QUESTION = '}}\n\nKey: "{key}"\nThe value is:'

APPROX_CHARS_PER_TOKEN = 4.0


class SyntheticError(UserError):
    """Bad arguments to a synthetic data generator."""


def length_function(tokenizer: Any | None = None) -> Callable[[str], int]:
    """Token length of a text: exact with a tokenizer (no special tokens), else about chars / 4."""
    if tokenizer is None:
        return lambda text: int(math.ceil(len(text) / APPROX_CHARS_PER_TOKEN))

    def measure(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    return measure


def _filler(i: int) -> str:
    return PASSKEY_FILLER[i % len(PASSKEY_FILLER)]


def _fit_units(
    n_units_for: Callable[[int], str],
    target: int,
    measure: Callable[[str], int],
    unit_guess: float,
    overhead: int,
    task: str,
) -> int:
    """Largest unit count (at least 2) whose rendered text measures at most `target` tokens."""
    smallest = measure(n_units_for(2))
    if smallest > target:
        raise SyntheticError(f"length {target} is too short for the {task} task: it needs at least {smallest} tokens")
    n = max(2, int((target - overhead) / max(unit_guess, 1e-6)))
    size = measure(n_units_for(n))
    # Walk towards the target; unit sizes are near-constant so this takes a few steps.
    while size > target and n > 2:
        step = max(1, int((size - target) / max(unit_guess, 1e-6)))
        n = max(2, n - step)
        size = measure(n_units_for(n))
    while measure(n_units_for(n + 1)) <= target:
        n += 1
    return n


def make_passkey(
    length: int,
    depth: float,
    rng: random.Random,
    tokenizer: Any | None = None,
    key_digits: int = 5,
    fit: Literal["text", "prompt"] = "text",
) -> dict[str, Any]:
    """One passkey record of about `length` tokens (never more) with the key at `depth` in [0, 1].

    `fit="text"` sizes the full training text (prompt and answer), `fit="prompt"` the prompt
    alone (what an evaluation feeds the model).
    """
    _check_depth(depth)
    key = str(rng.randint(10 ** (key_digits - 1), 10**key_digits - 1))
    needle = PASSKEY_NEEDLE.format(key=key)
    answer_suffix = f" {key}."
    sized_suffix = answer_suffix if fit == "text" else ""
    measure = length_function(tokenizer)

    def render(n: int) -> tuple[str, int, int]:
        before = round(depth * n)
        parts = [PASSKEY_INTRO] + [_filler(i) for i in range(before)]
        head = " ".join(parts) + " "
        start = len(head)
        body = head + needle
        end = len(body)
        after = [_filler(i) for i in range(before, n)]
        prompt = body + (" " + " ".join(after) if after else "") + " " + PASSKEY_QUESTION
        return prompt, start, end

    unit = measure(" ".join(_filler(i) for i in range(20))) / 20
    overhead = measure(render(0)[0] + sized_suffix)
    n = _fit_units(lambda k: render(k)[0] + sized_suffix, length, measure, unit, overhead, "passkey")
    prompt, start, end = render(n)
    return _record("passkey", prompt, answer_suffix, key, depth, n, length, start, end, measure, tokenizer)


def _record(task: str, prompt: str, answer_suffix: str, answer: str, depth: float, n: int, length: int,
            start: int, end: int, measure, tokenizer) -> dict[str, Any]:
    """The record both generators return: the text, where the needle sits, and the lengths achieved."""
    text = prompt + answer_suffix
    return {
        "task": task,
        "text": text,
        "prompt": prompt,
        "answer": answer,
        "depth": round(depth * n) / n,
        "target_depth": depth,
        "length": measure(text),
        "prompt_length": measure(prompt),
        "target_length": length,
        "length_unit": "tokens" if tokenizer is not None else "approx",
        "needle_start": start,
        "needle_end": end,
        "filler_units": n,
    }


def _kv_pair(rng: random.Random) -> tuple[str, str]:
    return f"{rng.getrandbits(32):08x}", f"{rng.getrandbits(32):08x}"


def make_kv(
    length: int,
    depth: float,
    rng: random.Random,
    tokenizer: Any | None = None,
    fit: Literal["text", "prompt"] = "text",
) -> dict[str, Any]:
    """One key-value retrieval record: a JSON object of random hex pairs, the asked pair at `depth`.

    `fit` as for `make_passkey`.
    """
    _check_depth(depth)
    measure = length_function(tokenizer)
    pairs: list[tuple[str, str]] = []
    seen: set[str] = set()

    def ensure(n: int) -> None:
        while len(pairs) < n:
            k, v = _kv_pair(rng)
            if k not in seen:
                seen.add(k)
                pairs.append((k, v))

    target_key, target_value = _kv_pair(rng)
    seen.add(target_key)

    def render(n: int) -> tuple[str, int, int]:
        ensure(n)
        before = round(depth * n)
        items = [f'"{k}": "{v}"' for k, v in pairs[:n]]
        needle = f'"{target_key}": "{target_value}"'
        head_items = items[:before]
        head = KV_INTRO + "".join(item + ", " for item in head_items)
        start = len(head)
        body = head + needle
        end = len(body)
        tail = items[before:]
        prompt = body + "".join(", " + item for item in tail) + KV_QUESTION.format(key=target_key)
        return prompt, start, end

    answer_suffix = f' "{target_value}"'
    sized_suffix = answer_suffix if fit == "text" else ""
    ensure(8)
    unit = measure(", ".join(f'"{k}": "{v}"' for k, v in pairs[:8])) / 8
    overhead = measure(render(0)[0] + sized_suffix)
    n = _fit_units(lambda k: render(k)[0] + sized_suffix, length, measure, unit, overhead, "kv")
    prompt, start, end = render(n)
    record = _record("kv", prompt, answer_suffix, target_value, depth, n, length, start, end, measure, tokenizer)
    return {**record, "key": target_key}


GENERATORS: dict[str, Callable[..., dict[str, Any]]] = {"passkey": make_passkey, "kv": make_kv}


def generate(
    task: str,
    lengths: Sequence[int],
    count: int,
    seed: int = 0,
    depths: Sequence[float] | None = None,
    tokenizer: Any | None = None,
    fit: Literal["text", "prompt"] = "text",
) -> list[dict[str, Any]]:
    """`count` records of `task` at mixed lengths.

    Lengths (and, when `depths` is given, depths) cycle over their grid so that every
    combination gets an equal share; without `depths`, each record's depth is uniform in [0, 1].
    The same arguments always give the same records.
    """
    if task not in GENERATORS:
        raise SyntheticError(f"unknown synthetic task {task!r}; choose one of {', '.join(TASKS)}")
    if count < 1:
        raise SyntheticError(f"count must be at least 1, got {count}")
    if not lengths:
        raise SyntheticError("give at least one length")
    for length in lengths:
        if length < 32:
            raise SyntheticError(f"length {length} is too short for a retrieval task (at least 32 tokens)")
    for depth in depths or ():
        _check_depth(depth)
    rng = random.Random(seed)
    grid: list[tuple[int, float | None]] = (
        [(length, depth) for length in lengths for depth in depths] if depths else [(length, None) for length in lengths]
    )
    records = []
    for i in range(count):
        length, depth = grid[i % len(grid)]
        if depth is None:
            depth = rng.random()
        record = GENERATORS[task](length, depth, rng, tokenizer=tokenizer, fit=fit)
        record["id"] = f"{task}-{seed}-{i}"
        records.append(record)
    return records


def write_jsonl(records: Iterable[dict[str, Any]], path: str | Path) -> int:
    """Write records one JSON object a line; returns how many were written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            n += 1
    return n


def _check_depth(depth: float) -> None:
    if not 0.0 <= depth <= 1.0:
        raise SyntheticError(f"depth must be within [0, 1], got {depth}")
