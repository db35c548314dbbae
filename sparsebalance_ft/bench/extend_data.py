"""Long documents for the context-extension bench, from the Python standard library every machine has.

Standard-library files are mostly shorter than 16K tokens, so a document here is several whole files of one
source concatenated in a stable (sorted) order until it reaches the wanted length. Train and held-out text
come from different sources, never from chunks of one: training reads the top-level modules (`*.py`), the
held-out set the `email/` package (as `make demo` does), so evaluation text is never trained on.

`long_texts` is the one place the bench chooses its text: a proper long-document source (books, long
documentation, a user's JSONL) replaces it without touching the bench.
"""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path

TRAIN_GLOB = "*.py"
HELDOUT_GLOB = "email/**/*.py"
_SEPARATOR = "\n\n"


def source_files(glob: str, root: Path | None = None) -> list[Path]:
    root = root or Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob(glob) if p.is_file() and "site-packages" not in p.parts)


def long_texts(tokenizer, glob: str, tokens: int, count: int, root: Path | None = None) -> list[str]:
    """Up to `count` texts of at least `tokens` tokens, each whole files of `glob` joined in sorted order.

    Token counts are measured per file (the join adds a few), and a trailing group too short to reach
    `tokens` is dropped, so every text covers the full evaluation or training length."""
    texts, parts, length = [], [], 0
    for path in source_files(glob, root):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        length += len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if length >= tokens:
            texts.append(_SEPARATOR.join(parts))
            parts, length = [], 0
            if len(texts) == count:
                break
    return texts


def heldout_ids(tokenizer, tokens: int, count: int, root: Path | None = None) -> list[list[int]]:
    """Held-out documents as token ids, each exactly `tokens` long."""
    texts = long_texts(tokenizer, HELDOUT_GLOB, tokens, count, root)
    return [tokenizer(text, add_special_tokens=False)["input_ids"][:tokens] for text in texts]


def write_training_jsonl(tokenizer, tokens: int, count: int, out: Path, root: Path | None = None) -> Path:
    """The training documents as a JSONL file (`text` field), which `data.path` reads like any corpus."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as handle:
        for text in long_texts(tokenizer, TRAIN_GLOB, tokens, count, root):
            handle.write(json.dumps({"text": text}) + "\n")
    return out
