"""Tokenize a data source once, cache it on disk, and serve documents as int32 arrays.

    corpus = load_corpus(recipe.data, tokenizer)
    corpus.lengths            # np.ndarray[int64], one length per kept document (EOS included)
    len(corpus), corpus[i]    # np.ndarray[int32] token ids of document i (a read-only memmap view)
    corpus.example(i)         # {"input_ids", and "labels" (-100 outside assistant turns) under train_on: assistant}
    corpus.target_tokens      # np.ndarray[int64], tokens of each document the shifted loss trains on
    corpus.subset(indices)    # the same documents' view, e.g. a held-out validation share
    corpus.summary()          # counts to log: read, kept, truncated, dropped (too long / too short)

Cache. Tokenization (one EOS appended per document) is stored under `data.cache_dir` in a folder
named by a fingerprint of the source files (path, size, mtime), the tokenizer (its full
serialisation, special tokens and chat template) and the settings that change token ids
(format, fields, glob, max_documents, train_on). It is one flat int32 `tokens.npy` plus the raw
`lengths.npy` (and, under `train_on: assistant`, a uint8 `assistant_mask.npy` beside the
tokens), memory-mapped on load. The length policy (`max_seq_len`, `too_long`,
`min_seq_len`) is applied when loading, so changing it never re-tokenizes. Writers build the
folder under a temporary name and publish it with one `os.replace`; concurrent callers (ranks)
serialise on a lock file, so one tokenizes and the others wait and reuse its result.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
from filelock import FileLock

from ..recipe import DataConfig
from .chat import assistant_mask_method, tokenize_chat
from .packing import IGNORE_INDEX
from .sources import DataError, Document, detect_format, hub_fingerprint, read_documents, source_files

CACHE_VERSION = 1
_BATCH_DOCS = 256
_BATCH_CHARS = 4_000_000


class TokenizedCorpus:
    """Documents as token-id arrays over one flat int32 array (memory-mapped when from the cache)."""

    def __init__(
        self,
        tokens: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        info: dict[str, Any] | None = None,
        assistant_mask: np.ndarray | None = None,
    ) -> None:
        self.tokens = tokens
        self.starts = np.asarray(starts, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.lengths.setflags(write=False)
        self.assistant_mask = assistant_mask  # aligned with `tokens`; None: every token is trained on
        self._info = dict(info or {})
        self.target_tokens = self._target_tokens()

    def _target_tokens(self) -> np.ndarray:
        """Per document, the labels the shifted loss predicts: all but the first token, or the assistant ones."""
        if self.assistant_mask is None:
            return self.lengths - 1
        return np.array(
            [int(self.assistant_mask[s + 1 : s + n].sum()) for s, n in zip(self.starts.tolist(), self.lengths.tolist())],
            dtype=np.int64,
        )

    @classmethod
    def from_documents(cls, docs: Iterable[Sequence[int] | np.ndarray], info: dict[str, Any] | None = None) -> "TokenizedCorpus":
        """An in-memory corpus from token-id sequences (for tests and synthetic data)."""
        arrays = [np.asarray(d, dtype=np.int32).reshape(-1) for d in docs]
        lengths = np.array([len(a) for a in arrays], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(arrays) else np.zeros(0, np.int64)
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
        base = {"documents": len(arrays), "tokens": int(lengths.sum())}
        return cls(tokens, starts, lengths, {**base, **(info or {})})

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> np.ndarray:
        n = len(self.lengths)
        i = int(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"document {index} out of range for a corpus of {n}")
        start = int(self.starts[i])
        return np.asarray(self.tokens[start : start + int(self.lengths[i])])

    def example(self, index: int) -> dict[str, np.ndarray]:
        """Document `index` for packing: its `input_ids`, and `labels` (-100 outside assistant turns) when masked."""
        ids = self[index]
        if self.assistant_mask is None:
            return {"input_ids": ids}
        start = int(self.starts[index if index >= 0 else index + len(self)])
        mask = np.asarray(self.assistant_mask[start : start + len(ids)], dtype=bool)
        return {"input_ids": ids, "labels": np.where(mask, ids.astype(np.int64), IGNORE_INDEX)}

    def subset(self, indices: Sequence[int] | np.ndarray) -> "TokenizedCorpus":
        """The documents at `indices`, in that order, over the same token storage (nothing copied)."""
        idx = np.asarray(indices, dtype=np.int64)
        info = {**self._info, "documents": int(len(idx)), "tokens": int(self.lengths[idx].sum())}
        return TokenizedCorpus(self.tokens, self.starts[idx], self.lengths[idx], info, self.assistant_mask)

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(len(self)):
            yield self[i]

    @property
    def total_tokens(self) -> int:
        return int(self.lengths.sum())

    def summary(self) -> dict[str, Any]:
        """What loading did, for the trainer to log: source, counts, cache use."""
        return dict(self._info)

    def describe(self) -> str:
        """One line for logs: kept documents and tokens, what was truncated or dropped, cache use."""
        s = self._info
        parts = [f"{len(self):,} documents, {self.total_tokens:,} tokens"]
        if "documents_read" in s:
            parts.append(
                f"from {s['documents_read']:,} read: {s.get('truncated', 0):,} truncated to {s.get('max_seq_len')}, "
                f"{s.get('dropped_too_long', 0):,} dropped as too long, "
                f"{s.get('dropped_too_short', 0):,} dropped as shorter than {s.get('min_seq_len')}"
            )
        if "assistant_mask" in s:
            parts.append(
                f"loss on {int(self.target_tokens.sum()):,} assistant tokens (found by {s['assistant_mask']})"
            )
        if "cache_hit" in s:
            parts.append("tokenization cache reused" if s["cache_hit"] else "tokenized and cached")
        return "; ".join(parts)

    def __repr__(self) -> str:
        return f"TokenizedCorpus({self.describe()})"


# ------------------------------------------------------------------------------ fingerprints


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of everything in a tokenizer that changes the ids it produces."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    extra = [
        type(tokenizer).__name__,
        getattr(tokenizer, "bos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
        getattr(tokenizer, "chat_template", None),
        [str(t) for t in getattr(tokenizer, "all_special_tokens", [])],
    ]
    h.update(json.dumps(extra, default=str).encode())
    return h.hexdigest()


def corpus_fingerprint(cfg: DataConfig, tokenizer: Any, fmt: str, files: list[Path]) -> str:
    """Key of a tokenization cache entry: source files, tokenizer and token-changing settings."""
    stats = []
    for f in files:
        st = f.stat()
        stats.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    key = {
        "version": CACHE_VERSION,
        "format": fmt,
        "settings": {
            "text_field": cfg.text_field,
            "messages_field": cfg.messages_field,
            "text_glob": cfg.text_glob,
            "max_documents": cfg.max_documents,
            "train_on": cfg.train_on,
        },
        "files": stats,
        "hub": hub_fingerprint(cfg.path) if fmt == "hub" else None,
        "tokenizer": tokenizer_fingerprint(tokenizer),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


# ------------------------------------------------------------------------------ loading


def load_corpus(data_cfg: DataConfig, tokenizer: Any, *, progress: bool | None = None) -> TokenizedCorpus:
    """Tokenize `data_cfg`'s source with `tokenizer` (or reuse the cache) and apply the length policy.

    `tokenizer` is a tokenizer object or a directory to load one from. `progress` shows a rich
    progress bar while tokenizing (default: on rank 0 when stderr is a terminal).
    Raises `DataError` (one line) for missing files, broken lines or fields, a document over
    `max_seq_len` under `too_long: error`, or no document left after filtering.
    """
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    if data_cfg.min_seq_len > data_cfg.max_seq_len:
        raise DataError(
            f"data.min_seq_len ({data_cfg.min_seq_len}) is above data.max_seq_len ({data_cfg.max_seq_len})"
        )
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no EOS token; documents need one to end them")
    fmt = detect_format(data_cfg)
    files = source_files(data_cfg, fmt)
    fingerprint = corpus_fingerprint(data_cfg, tokenizer, fmt, files)
    cache_root = Path(data_cfg.cache_dir)
    entry = cache_root / f"tokens-{fingerprint}"

    cache_hit = _complete(entry)
    if not cache_hit:
        try:
            cache_root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise DataError(f"{cache_root}: cannot create the data cache folder: {error.strerror or error}") from None
        with FileLock(cache_root / f"tokens-{fingerprint}.lock"):
            cache_hit = _complete(entry)  # another rank may have finished while we waited
            if not cache_hit:
                _build(entry, data_cfg, tokenizer, fmt, fingerprint, progress)

    meta = json.loads((entry / "meta.json").read_text())
    tokens = np.load(entry / "tokens.npy", mmap_mode="r")
    raw_lengths = np.load(entry / "lengths.npy")
    mask_file = entry / "assistant_mask.npy"
    mask = np.load(mask_file, mmap_mode="r") if mask_file.is_file() else None
    return _apply_length_policy(tokens, raw_lengths, data_cfg, tokenizer, meta, cache_hit, entry, mask)


def _complete(entry: Path) -> bool:
    return (entry / "meta.json").is_file()


def _rank() -> int:
    for name in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return 0


def _tokenize_texts(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """One batch through the tokenizer (a seam tests count calls on)."""
    return tokenizer(texts, add_special_tokens=add_special_tokens, verbose=False)["input_ids"]


def _batches(docs: Iterator[Document]) -> Iterator[list[Document]]:
    batch: list[Document] = []
    chars = 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc.text)
        if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _build(entry: Path, cfg: DataConfig, tokenizer: Any, fmt: str, fingerprint: str, progress: bool | None) -> None:
    eos = int(tokenizer.eos_token_id)
    # Chat text carries its own special tokens from the template; plain text gets whatever the
    # tokenizer adds by default (BOS for Llama-style tokenizers, nothing for the tiny one).
    add_special = cfg.messages_field is None
    assistant_only = cfg.train_on == "assistant"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{fingerprint}-", dir=entry.parent))
    try:
        lengths: list[int] = []
        started = time.perf_counter()
        with open(tmp / "tokens.bin", "wb") as out, open(tmp / "mask.bin", "wb") as mask_out, _progress(progress) as bar:
            task = bar.add_task("tokenizing", total=None)
            for batch in _batches(read_documents(cfg, tokenizer)):
                for ids, mask in _tokenize_batch(tokenizer, batch, add_special, assistant_only):
                    if not ids or ids[-1] != eos:  # the appended EOS is not an assistant token
                        ids, mask = list(ids) + [eos], mask + [False] if mask is not None else None
                    arr = np.asarray(ids, dtype=np.int32)
                    out.write(arr.tobytes())
                    if mask is not None:
                        mask_out.write(np.asarray(mask, dtype=np.uint8).tobytes())
                    lengths.append(len(arr))
                bar.update(task, advance=len(batch), description=f"tokenizing: {sum(lengths):,} tokens")
        if not lengths:
            raise DataError(f"{cfg.path}: no documents found")
        if assistant_only:
            np.save(tmp / "assistant_mask.npy", np.fromfile(tmp / "mask.bin", dtype=np.uint8))
        (tmp / "mask.bin").unlink()
        raw = np.memmap(tmp / "tokens.bin", dtype=np.int32, mode="r")
        stored = np.lib.format.open_memmap(tmp / "tokens.npy", mode="w+", dtype=np.int32, shape=(len(raw),))
        step = 1 << 24
        for i in range(0, len(raw), step):
            stored[i : i + step] = raw[i : i + step]
        stored.flush()
        del stored, raw
        (tmp / "tokens.bin").unlink()
        np.save(tmp / "lengths.npy", np.asarray(lengths, dtype=np.int64))
        meta = {
            "version": CACHE_VERSION,
            "fingerprint": fingerprint,
            "source": str(cfg.path),
            "format": fmt,
            "tokenizer": getattr(tokenizer, "name_or_path", type(tokenizer).__name__),
            "documents_read": len(lengths),
            "tokens_read": int(sum(lengths)),
            "tokenize_seconds": round(time.perf_counter() - started, 3),
        }
        if assistant_only:
            meta["assistant_mask"] = assistant_mask_method(tokenizer)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        try:
            os.replace(tmp, entry)
        except OSError:
            if not _complete(entry):  # not a lost race with another writer: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tokenize_batch(tokenizer: Any, batch: list[Document], add_special: bool, assistant_only: bool):
    """(token ids, assistant mask or None) per document: one tokenizer call for plain text, per conversation for masks."""
    if not assistant_only:
        return [(ids, None) for ids in _tokenize_texts(tokenizer, [d.text for d in batch], add_special)]
    return [tokenize_chat(d.messages, tokenizer, d.where) for d in batch]


def _progress(enabled: bool | None):
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if enabled is None:
        enabled = _rank() == 0 and console.is_terminal
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TextColumn("{task.completed:,} documents"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not enabled,
    )


def _apply_length_policy(
    tokens: np.ndarray,
    raw_lengths: np.ndarray,
    cfg: DataConfig,
    tokenizer: Any,
    meta: dict[str, Any],
    cache_hit: bool,
    entry: Path,
    assistant_mask: np.ndarray | None = None,
) -> TokenizedCorpus:
    starts = np.zeros(len(raw_lengths), dtype=np.int64)
    np.cumsum(raw_lengths[:-1], out=starts[1:])
    long = raw_lengths > cfg.max_seq_len
    if cfg.too_long == "error" and long.any():
        index = int(np.flatnonzero(long)[0])
        where = _where(cfg, tokenizer, index)
        raise DataError(
            f"{where}: document has {int(raw_lengths[index])} tokens, above data.max_seq_len={cfg.max_seq_len}"
            " (set data.too_long to truncate or drop)"
        )
    lengths = raw_lengths.copy()
    keep = np.ones(len(raw_lengths), dtype=bool)
    truncated = dropped_long = 0
    if cfg.too_long == "truncate":
        truncated = int(long.sum())
        lengths[long] = cfg.max_seq_len
    else:
        dropped_long = int(long.sum())
        keep &= ~long
    short = keep & (lengths < cfg.min_seq_len)
    dropped_short = int(short.sum())
    keep &= ~short
    info = {
        "source": meta["source"],
        "format": meta["format"],
        "documents_read": int(len(raw_lengths)),
        "documents": int(keep.sum()),
        "tokens": int(lengths[keep].sum()),
        "truncated": truncated,
        "dropped_too_long": dropped_long,
        "dropped_too_short": dropped_short,
        "max_seq_len": cfg.max_seq_len,
        "min_seq_len": cfg.min_seq_len,
        "too_long": cfg.too_long,
        "cache_hit": cache_hit,
        "cache_path": str(entry),
        "fingerprint": meta["fingerprint"],
    }
    if "assistant_mask" in meta:
        info["assistant_mask"] = meta["assistant_mask"]
    if not keep.any():
        raise DataError(
            f"{cfg.path}: no documents left: {len(raw_lengths)} read, {dropped_long} over max_seq_len"
            f" {cfg.max_seq_len}, {dropped_short} under min_seq_len {cfg.min_seq_len}"
        )
    return TokenizedCorpus(tokens, starts[keep], lengths[keep], info, assistant_mask)


def _where(cfg: DataConfig, tokenizer: Any, index: int) -> str:
    """The origin ('file:line') of the source's `index`-th document, re-read on this error path only."""
    for i, doc in enumerate(read_documents(cfg, tokenizer)):
        if i == index:
            return doc.where
    return f"{cfg.path}: document {index + 1}"
