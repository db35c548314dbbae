"""Document lengths for simulation: a lengths file, a folder of real text files, or a recipe's dataset."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..errors import UserError


class SimInputError(UserError):
    """A simulation input a user can fix (missing or malformed lengths, densities, model)."""


TooLong = Literal["truncate", "drop", "error"]


def apply_cap(lengths: np.ndarray, max_len: int | None, too_long: TooLong = "truncate", source: str = "lengths") -> np.ndarray:
    """Cap lengths at `max_len` as the data loader does (`data.too_long`)."""
    L = np.asarray(lengths, dtype=np.int64)
    if max_len is None:
        return L
    over = L > max_len
    if not over.any():
        return L
    if too_long == "truncate":
        return np.minimum(L, max_len)
    if too_long == "drop":
        return L[~over]
    i = int(np.flatnonzero(over)[0])
    raise SimInputError(f"{source}: document {i} has {int(L[i])} tokens, over the cap {max_len} (use --too-long truncate or drop)")


def load_lengths(path: str | Path) -> np.ndarray:
    """Lengths from JSON (a list, or an object with a `lengths` list) or text (numbers separated by blanks/commas)."""
    path = Path(path)
    if not path.is_file():
        raise SimInputError(f"{path}: lengths file not found")
    text = path.read_text(encoding="utf-8", errors="replace")
    data: Any
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
        tokens = text.replace(",", " ").split()
        try:
            data = [float(t) for t in tokens]
        except ValueError:
            bad = next(t for t in tokens if not _is_number(t))
            raise SimInputError(f"{path}: expected a JSON list or numbers, found {bad!r}") from None
    if isinstance(data, dict):
        if "lengths" not in data:
            raise SimInputError(f"{path}: JSON object has no 'lengths' list")
        data = data["lengths"]
    if not isinstance(data, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in data):
        raise SimInputError(f"{path}: expected a list of token counts")
    L = np.asarray(data, dtype=np.float64)
    if L.size == 0:
        raise SimInputError(f"{path}: no lengths in the file")
    if not np.all(np.isfinite(L)) or np.any(L < 1) or np.any(L != np.round(L)):
        i = int(np.flatnonzero(~np.isfinite(L) | (L < 1) | (L != np.round(L)))[0])
        raise SimInputError(f"{path}: entry {i} ({data[i]!r}) is not a positive whole token count")
    return L.astype(np.int64)


def _is_number(t: str) -> bool:
    try:
        float(t)
        return True
    except ValueError:
        return False


def lengths_from_text_dir(
    root: str | Path,
    glob: str = "**/*",
    bytes_per_token: float = 3.6,
    tokenizer: str | None = None,
    min_bytes: int = 1,
    max_files: int | None = None,
) -> tuple[np.ndarray, list[str]]:
    """Token lengths of the text files under `root` (sorted paths; binary files skipped).

    Without a tokenizer the length is `ceil(bytes / bytes_per_token)` (about 3.6 for English and
    source code with a BPE vocabulary of 32K-128K); with a tokenizer directory the files are
    tokenized (slow for large folders).
    """
    root = Path(root)
    if not root.is_dir():
        raise SimInputError(f"{root}: text folder not found")
    if bytes_per_token <= 0:
        raise SimInputError(f"--bytes-per-token must be positive, got {bytes_per_token}")
    files = sorted(p for p in root.glob(glob) if p.is_file() and not p.is_symlink())
    tok = None
    if tokenizer is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
    lengths: list[int] = []
    names: list[str] = []
    for p in files:
        if max_files is not None and len(lengths) >= max_files:
            break
        try:
            size = p.stat().st_size
            if size < min_bytes:
                continue
            with p.open("rb") as f:
                head = f.read(4096)
            if b"\x00" in head:
                continue  # binary
            if tok is None:
                n = int(np.ceil(size / bytes_per_token))
            else:
                n = len(tok(p.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)["input_ids"]) + 1
        except OSError:
            continue
        if n >= 1:
            lengths.append(n)
            names.append(str(p.relative_to(root)))
    if not lengths:
        raise SimInputError(f"{root}: no text files matched {glob!r}")
    return np.asarray(lengths, dtype=np.int64), names


def lengths_from_recipe(recipe_path: str | Path, overrides: list[str] | None = None) -> np.ndarray:
    """Token lengths of a recipe's dataset, through the project's data loader (tokenized, cached)."""
    from ..data import load_corpus
    from ..recipe import load_recipe

    recipe = load_recipe(recipe_path, overrides, check_paths=False)
    tokenizer = recipe.data.tokenizer or recipe.model.path
    corpus = load_corpus(recipe.data, tokenizer, progress=False)
    return np.asarray(corpus.lengths, dtype=np.int64)


def synthetic_lengths(n: int, median: float, sigma: float, max_len: int, seed: int = 0, min_len: int = 16) -> np.ndarray:
    """Lognormal lengths (median, log-sigma), clipped to [min_len, max_len]."""
    rng = np.random.default_rng([seed, 7])
    L = np.rint(rng.lognormal(np.log(median), sigma, int(n)))
    return np.clip(L, min_len, max_len).astype(np.int64)


LONG_TAIL_MIX = ((0.70, 1024, 4096), (0.25, 4096, 32768), (0.05, 32768, 131072))


def long_tail_lengths(n: int, seed: int = 0, mix=LONG_TAIL_MIX) -> np.ndarray:
    """A synthetic long-tail mix: by default 70% of documents 1-4K tokens, 25% 4-32K, 5% 32-128K,
    log-uniform inside each range (the mix of a typical long-context fine-tuning set)."""
    if n < 1:
        raise SimInputError("--long-tail needs a positive document count")
    rng = np.random.default_rng([seed, 7])
    shares = np.array([m[0] for m in mix], dtype=np.float64)
    which = rng.choice(len(mix), size=n, p=shares / shares.sum())
    lo = np.log(np.array([m[1] for m in mix], dtype=np.float64))[which]
    hi = np.log(np.array([m[2] for m in mix], dtype=np.float64))[which]
    return np.exp(rng.uniform(lo, hi)).astype(np.int64)
