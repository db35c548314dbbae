"""Needle in a haystack over real local text: a magic number hidden at a sentence boundary.

The haystack is text from files the user names (default: the text files under
/usr/share/doc, else the Python standard library sources). Prompts are assembled in token space
so that each one is exactly the requested length: special prefix, haystack tokens before the
needle, the needle, the rest of the haystack, the question. The needle goes at the last
sentence boundary at or before the requested depth, and the record keeps the achieved depth.
"""
from __future__ import annotations

import gzip
import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from .engine import EvalExample
from .errors import EvalDataError, EvalOptionError
from .passkey import encode, special_overhead

NEEDLE = "The special magic number is {number}."
QUESTION = "\n\nQuestion: What is the special magic number mentioned in the text above?\nAnswer: The special magic number is"

DEFAULT_DEPTHS = tuple(i / 10 for i in range(11))
SKIP_SUFFIXES = {
    ".html", ".htm", ".js", ".css", ".json", ".xml", ".svg", ".png", ".jpg", ".jpeg", ".gif", ".ico",
    ".pdf", ".zip", ".bz2", ".xz", ".so", ".pyc", ".bin", ".db", ".woff", ".woff2", ".ttf",
}
_MAX_FILE_BYTES = 4_000_000
_BOUNDARY_ENDINGS = (".", "!", "?", "\n")


def default_haystack_paths() -> list[Path]:
    docs = Path("/usr/share/doc")
    if docs.is_dir():
        return [docs]
    return [Path(sysconfig.get_paths()["stdlib"])]


@dataclass
class NeedleOptions:
    lengths: list[int] | None = None
    depths: list[float] = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    samples: int = 1
    seed: int = 1234
    max_new_tokens: int = 12
    haystack: list[Path] | None = None


def _read_text(path: Path) -> str | None:
    try:
        if path.stat().st_size > _MAX_FILE_BYTES:
            return None
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    if b"\x00" in raw[:4096]:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _candidate_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink() and p.suffix.lower() not in SKIP_SUFFIXES)


def load_haystack(paths: Sequence[str | Path], max_chars: int) -> str:
    """Concatenated text of the readable text files under `paths` (sorted), up to `max_chars` characters."""
    pieces: list[str] = []
    used = 0
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise EvalDataError(f"{path}: haystack path not found")
        for file in _candidate_files(path):
            text = _read_text(file)
            if not text or not text.strip():
                continue
            text = text.strip() + "\n\n"
            pieces.append(text[: max_chars - used])
            used += len(pieces[-1])
            if used >= max_chars:
                return "".join(pieces)
    if not pieces:
        raise EvalDataError(f"{', '.join(str(p) for p in paths)}: no readable UTF-8 text files for the haystack")
    return "".join(pieces)


def _boundary_ids(tokenizer, ids: Sequence[int]) -> set[int]:
    unique = sorted(set(ids))
    texts = tokenizer.batch_decode([[i] for i in unique])
    return {i for i, text in zip(unique, texts) if text.rstrip(" ").endswith(_BOUNDARY_ENDINGS)}


def nearest_boundary(window: Sequence[int], target: int, boundaries: set[int]) -> int:
    """The insertion point nearest `target` that follows a sentence end (0 and len(window) always qualify)."""
    size = len(window)
    for offset in range(size + 1):
        for position in (target - offset, target + offset):
            if position == 0 or position == size:
                return position
            if 0 < position < size and window[position - 1] in boundaries:
                return position
    return target


def build_needle_examples(tokenizer, options: NeedleOptions) -> list[EvalExample]:
    """`samples` prompts per (length, depth) cell, each exactly `length` tokens."""
    assert options.lengths, "lengths must be resolved before building examples"
    longest = max(options.lengths)
    paths = options.haystack or default_haystack_paths()
    text = load_haystack(paths, max_chars=longest * 8 + 10_000)
    hay = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not hay:
        raise EvalDataError(f"{paths[0]}: the haystack text tokenizes to nothing")
    boundaries = _boundary_ids(tokenizer, hay)
    extra = special_overhead(tokenizer)
    prefix = encode(tokenizer, "a")[:extra] if extra else []
    question = list(tokenizer(QUESTION, add_special_tokens=False)["input_ids"])
    rng = random.Random(options.seed)
    examples = []
    for length in options.lengths:
        for depth in options.depths:
            for s in range(options.samples):
                number = str(rng.randint(1_000_000, 9_999_999))
                needle = list(tokenizer(" " + NEEDLE.format(number=number), add_special_tokens=False)["input_ids"])
                room = length - len(prefix) - len(needle) - len(question)
                if room < 16:
                    raise EvalOptionError(f"--lengths: {length} leaves no room for a haystack (needle and question take {length - room})")
                # Repeat the haystack if the files hold fewer tokens than the longest prompt.
                while len(hay) < room + 1:
                    hay = hay + hay
                start = rng.randrange(0, len(hay) - room + 1)
                window = hay[start : start + room]
                position = nearest_boundary(window, round(depth * room), boundaries)
                ids = prefix + window[:position] + needle + window[position:] + question
                examples.append(
                    EvalExample(
                        id=f"needle-{length}-{depth:g}-{s}",
                        input_ids=ids,
                        answers=[number],
                        metric="retrieval_exact",
                        max_new_tokens=options.max_new_tokens,
                        continuation=f" {number}",
                        meta={
                            "length": length,
                            "depth": depth,
                            "actual_depth": position / room,
                            "needle_token_start": len(prefix) + position,
                            "needle_token_end": len(prefix) + position + len(needle),
                            "prompt_tokens": len(ids),
                        },
                    )
                )
    return examples
