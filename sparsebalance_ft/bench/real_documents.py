"""Real documents of three kinds for the real-model benches, all from the local disk.

- code: the Python standard library sources of the running interpreter.
- prose: the licence texts in /usr/share/common-licenses and the READMEs, changelogs and copyright notices
  under /usr/share/doc (identical texts, e.g. the many copies of one licence, counted once).
- repetitive: a real passage (code or prose, 48-192 tokens, at most a quarter of the document) repeated to the
  document's length, the shape of templated or generated text, where attention can find a near copy of every
  query in many places.

Each document is drawn with a target length (log-uniform between the bench's bounds) and truncated to it,
so the length dependence is measured on real text rather than read off whichever files happen to be long.
Content is described by two numbers independent of the model: the zlib compression ratio of the text
(compressed / raw bytes; low = repetitive) and the token diversity (distinct tokens / tokens).
"""
from __future__ import annotations

import hashlib
import math
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KINDS = ("code", "prose", "repetitive")
PROSE_ROOTS = (Path("/usr/share/common-licenses"), Path("/usr/share/doc"))
_CHARS_PER_TOKEN_MAX = 8  # read at most this many characters per wanted token before tokenizing


@dataclass
class Document:
    kind: str
    source: str
    ids: np.ndarray  # token ids, already truncated to the drawn length
    compression_ratio: float
    token_diversity: float

    @property
    def tokens(self) -> int:
        return int(len(self.ids))


def code_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def prose_files() -> list[Path]:
    files, seen = [], set()
    for root in PROSE_ROOTS:
        for p in sorted(root.rglob("*")) if root.is_dir() else []:
            if not p.is_file() or p.suffix in (".gz", ".html", ".png", ".svg", ".py", ".c", ".h"):
                continue
            try:
                head = p.read_bytes()[:65536]
            except OSError:
                continue
            digest = hashlib.sha1(head).hexdigest()
            if digest in seen or b"\0" in head:
                continue
            seen.add(digest)
            files.append(p)
    return files


def content_measures(text: str, ids: np.ndarray) -> tuple[float, float]:
    """(zlib compressed / raw bytes, distinct tokens / tokens) of one document."""
    raw = text.encode("utf-8", "replace")
    ratio = len(zlib.compress(raw, 9)) / max(1, len(raw))
    return float(ratio), float(len(np.unique(ids)) / max(1, len(ids)))


def _read(path: Path, chars: int) -> str | None:
    try:
        return path.read_text(encoding="utf-8")[:chars]
    except (OSError, UnicodeDecodeError):
        return None


def truncated_document(tokenizer, kind: str, source: str, text: str, length: int) -> Document:
    """The first `length` tokens of `text` as a `Document`, its content measured on what was kept."""
    ids = np.asarray(tokenizer(text, add_special_tokens=False).input_ids[:length], dtype=np.int64)
    kept = tokenizer.decode(ids.tolist())
    ratio, diversity = content_measures(kept, ids)
    return Document(kind, source, ids, ratio, diversity)


def draw_lengths(n: int, min_tokens: int, max_tokens: int, rng: np.random.Generator) -> list[int]:
    return [int(round(math.exp(x))) for x in rng.uniform(math.log(min_tokens), math.log(max_tokens), n)]


def sample_documents(tokenizer, per_kind: int, min_tokens: int, max_tokens: int, seed: int = 0) -> list[Document]:
    """`per_kind` documents of each kind, interleaved (code, prose, repetitive, code, ...), lengths drawn
    log-uniform in [min_tokens, max_tokens]; a file shorter than its draw keeps its own length (if >= min)."""
    rng = np.random.default_rng(seed)
    pools = {"code": code_files(), "prose": prose_files()}
    out: dict[str, list[Document]] = {kind: [] for kind in KINDS}
    for kind, pool in pools.items():
        order = rng.permutation(len(pool))
        lengths = iter(draw_lengths(len(pool), min_tokens, max_tokens, rng))
        for i in order:
            if len(out[kind]) == per_kind:
                break
            length = next(lengths)
            text = _read(pool[i], length * _CHARS_PER_TOKEN_MAX)
            if not text:
                continue
            doc = truncated_document(tokenizer, kind, str(pool[i]), text, length)
            if doc.tokens >= min_tokens:
                out[kind].append(doc)
    passages = out["code"] + out["prose"]
    for length in draw_lengths(per_kind, min_tokens, max_tokens, rng):
        base = passages[int(rng.integers(len(passages)))]
        span = min(int(rng.integers(48, 193)), max(8, length // 4))  # at least four copies in the document
        start = int(rng.integers(0, max(1, base.tokens - span)))
        passage = tokenizer.decode(base.ids[start:start + span].tolist())
        text = "\n".join([passage] * (length // max(1, span) + 2))
        out["repetitive"].append(truncated_document(tokenizer, "repetitive", f"repeat:{base.source}@{start}+{span}", text, length))
    return [doc for group in zip(*(out[kind] for kind in KINDS)) for doc in group]
