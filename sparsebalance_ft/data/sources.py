"""Where documents come from: local JSONL, Parquet, folders of text files, saved `datasets`, Hub ids.

`read_documents(cfg, tokenizer)` yields `Document(text, where)` one by one, in a fixed order,
where `where` names the origin ("file.jsonl:12", "data.parquet:row 7", "texts/a.txt") for error
messages. Chat messages (`cfg.messages_field`) are rendered with the tokenizer's chat template.
`source_files(cfg)` lists the files a source reads, for the tokenization cache's fingerprint.
A `data.path` that does not exist locally and reads `owner/name` is a Hugging Face Hub dataset
id, loaded with `datasets.load_dataset` (network, or the datasets cache); offline, loading it is
one line naming the id.

Every problem a user can fix raises `DataError` with one line naming the path (and line/row,
and field where one is at fault).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ..errors import UserError
from ..hub import is_hub_id
from ..recipe import DataConfig

FORMATS = ("jsonl", "parquet", "text", "saved", "hub")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
# Marker files that `Dataset.save_to_disk` / `DatasetDict.save_to_disk` write.
SAVED_MARKERS = ("state.json", "dataset_info.json", "dataset_dict.json")


class DataError(UserError):
    """A data problem a user can fix: missing file, broken line, missing field, nothing left to train on."""


@dataclass(frozen=True)
class Document:
    text: str
    where: str
    messages: list | None = None  # the chat messages `text` was rendered from, for assistant-only labels


def _has_suffix(path: Path, suffixes: tuple[str, ...]) -> bool:
    return path.suffix.lower() in suffixes


def detect_format(cfg: DataConfig) -> str:
    """The source format: `cfg.format` unless it is `auto`, else from the path.

    A file: `.jsonl/.json/.ndjson` is JSONL, `.parquet/.pq` Parquet, anything else a text file
    (one document). A folder: a `save_to_disk` dataset if it holds one's marker files, else
    JSONL or Parquet if every matched file has that suffix, else a folder of text files.
    """
    path = Path(cfg.path)
    if cfg.format == "hub" or (cfg.format == "auto" and is_hub_id(cfg.path)):
        return "hub"
    if not path.exists():
        raise DataError(f"{path}: data path not found")
    if cfg.format != "auto":
        if cfg.format == "saved" and not path.is_dir():
            raise DataError(f"{path}: format 'saved' needs a folder written by save_to_disk")
        return cfg.format
    if path.is_file():
        if _has_suffix(path, JSONL_SUFFIXES):
            return "jsonl"
        if _has_suffix(path, PARQUET_SUFFIXES):
            return "parquet"
        return "text"
    if any((path / marker).is_file() for marker in SAVED_MARKERS):
        return "saved"
    files = _glob(path, cfg.text_glob)
    if files and all(_has_suffix(f, JSONL_SUFFIXES) for f in files):
        return "jsonl"
    if files and all(_has_suffix(f, PARQUET_SUFFIXES) for f in files):
        return "parquet"
    return "text"


def _glob(folder: Path, pattern: str) -> list[Path]:
    """Files (not folders, not hidden ones) under `folder` matching `pattern`, sorted."""
    out = []
    for p in folder.glob(pattern):
        rel = p.relative_to(folder)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts):
            out.append(p)
    return sorted(out)


def source_files(cfg: DataConfig, fmt: str | None = None) -> list[Path]:
    """The files a source reads, in reading order (every file of a saved dataset's folder)."""
    fmt = fmt or detect_format(cfg)
    path = Path(cfg.path)
    if fmt == "hub":
        return []  # the cache fingerprint uses the loaded dataset's own fingerprint (`hub_fingerprint`)
    if path.is_file():
        return [path]
    if fmt == "saved":
        return sorted(p for p in path.rglob("*") if p.is_file())
    files = _glob(path, cfg.text_glob)
    if fmt == "jsonl":
        files = [f for f in files if _has_suffix(f, JSONL_SUFFIXES)]
    elif fmt == "parquet":
        files = [f for f in files if _has_suffix(f, PARQUET_SUFFIXES)]
    if not files:
        raise DataError(f"{path}: no {fmt} files match data.text_glob '{cfg.text_glob}'")
    return files


def read_documents(cfg: DataConfig, tokenizer: Any = None) -> Iterator[Document]:
    """Yield the source's documents in order, at most `cfg.max_documents` of them.

    A `tokenizer` is needed only for chat messages (its chat template renders them).
    """
    fmt = detect_format(cfg)
    if cfg.messages_field is not None and tokenizer is None:
        raise DataError("data.messages_field is set but no tokenizer was given to render chat messages")
    if fmt == "text":
        records = _read_text(cfg)
    elif fmt == "jsonl":
        records = _read_records(cfg, jsonl_rows, fmt)
    elif fmt == "parquet":
        records = _read_records(cfg, _parquet_rows, fmt)
    elif fmt == "hub":
        records = _dataset_rows(load_hub_dataset(cfg.path), cfg.path, cfg)
    else:
        records = _read_saved(cfg)
    count = 0
    for row, where in records:
        if cfg.max_documents is not None and count >= cfg.max_documents:
            return
        if isinstance(row, str):
            yield Document(row, where)
        else:
            text = _document_text(row, where, cfg, tokenizer)
            yield Document(text, where, row[cfg.messages_field] if cfg.messages_field is not None else None)
        count += 1


# ---------------------------------------------------------------------------------- per format


def _read_text(cfg: DataConfig) -> Iterator[tuple[str, str]]:
    for path in source_files(cfg, "text"):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise DataError(
                f"{path}: not UTF-8 text (byte {error.start}); narrow data.text_glob to text files"
            ) from None
        except OSError as error:
            raise DataError(f"{path}: cannot read: {error.strerror or error}") from None
        yield text, str(path)


def _read_records(cfg: DataConfig, rows, fmt: str) -> Iterator[tuple[dict, str]]:
    for path in source_files(cfg, fmt):
        yield from rows(path, cfg)


def jsonl_rows(path: Path, cfg: DataConfig | None = None) -> Iterator[tuple[dict, str]]:
    """Each non-blank line of a JSONL file as (object, "path:line"); one-line `DataError` for a bad line."""
    try:
        handle = path.open("r", encoding="utf-8")
    except OSError as error:
        raise DataError(f"{path}: cannot read: {error.strerror or error}") from None
    with handle:
        lineno = 0
        while True:
            try:
                line = handle.readline()
            except UnicodeDecodeError:
                raise DataError(f"{path}:{lineno + 1}: not UTF-8 text") from None
            if not line:
                return
            lineno += 1
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{lineno}: not valid JSON: {error.msg} (column {error.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            yield row, f"{path}:{lineno}"


def _columns_needed(cfg: DataConfig) -> str:
    return cfg.messages_field if cfg.messages_field is not None else cfg.text_field


def _parquet_rows(path: Path, cfg: DataConfig) -> Iterator[tuple[dict, str]]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises several types for corrupt files
        raise DataError(f"{path}: not a readable Parquet file: {str(error).splitlines()[0]}") from None
    column = _columns_needed(cfg)
    names = parquet.schema_arrow.names
    if column not in names:
        raise DataError(f"{path}: no column '{column}' (columns: {', '.join(names)}){_chat_hint(cfg, names)}")
    row_index = 0
    for batch in parquet.iter_batches(columns=[column], batch_size=1024):
        for value in batch.column(0).to_pylist():
            row_index += 1
            yield {column: value}, f"{path}:row {row_index}"


def _read_saved(cfg: DataConfig) -> Iterator[tuple[dict, str]]:
    import datasets

    path = Path(cfg.path)
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as error:
        raise DataError(f"{path}: not a dataset saved with save_to_disk: {str(error).splitlines()[0]}") from None
    return _dataset_rows(loaded, str(path), cfg)


@functools.lru_cache(maxsize=4)
def load_hub_dataset(name: str):
    """`datasets.load_dataset(name)`, once per process; offline or unknown, one line naming the id."""
    import datasets
    from huggingface_hub import constants

    try:
        return datasets.load_dataset(name)
    except Exception as error:  # offline, unknown id, gated: several exception types
        if constants.HF_HUB_OFFLINE or datasets.config.HF_DATASETS_OFFLINE:
            reason = "offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set) and not in the datasets cache"
        else:
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise DataError(
            f"{name}: not a local path; as a Hugging Face Hub dataset id it could not be loaded: {reason}"
        ) from None


def hub_fingerprint(name: str) -> str:
    """The loaded Hub dataset's own fingerprints (they change when its files do), for the tokenization cache."""
    loaded = load_hub_dataset(name)
    splits = loaded.values() if hasattr(loaded, "values") else [loaded]
    return ",".join(getattr(split, "_fingerprint", "") for split in splits)


def _dataset_rows(loaded, path: str, cfg: DataConfig) -> Iterator[tuple[dict, str]]:
    """Rows of a `datasets` Dataset, or of a DatasetDict's `train` split (or its only split)."""
    import datasets

    if isinstance(loaded, datasets.DatasetDict):
        if "train" in loaded:
            loaded, split = loaded["train"], "train"
        elif len(loaded) == 1:
            split = next(iter(loaded))
            loaded = loaded[split]
        else:
            raise DataError(f"{path}: a DatasetDict with splits {', '.join(loaded)} and no 'train' split")
        where = f"{path}[{split}]"
    else:
        where = str(path)
    column = _columns_needed(cfg)
    if column not in loaded.column_names:
        names = loaded.column_names
        raise DataError(f"{where}: no column '{column}' (columns: {', '.join(names)}){_chat_hint(cfg, names)}")
    index = 0
    for batch in loaded.select_columns([column]).iter(batch_size=256):
        for value in batch[column]:
            index += 1
            yield {column: value}, f"{where}:row {index}"


# ---------------------------------------------------------------------------------- records


def _chat_hint(cfg: DataConfig, keys) -> str:
    if cfg.messages_field is None and "messages" in keys:
        return " (chat data? set data.messages_field: messages)"
    return ""


def _document_text(row: dict, where: str, cfg: DataConfig, tokenizer: Any) -> str:
    if cfg.messages_field is None:
        if cfg.text_field not in row:
            raise DataError(f"{where}: missing field '{cfg.text_field}'{_chat_hint(cfg, row)}")
        text = row[cfg.text_field]
        if not isinstance(text, str):
            raise DataError(f"{where}: field '{cfg.text_field}' must be a string, got {_kind(text)}")
        return text
    field = cfg.messages_field
    if field not in row:
        raise DataError(f"{where}: missing field '{field}'")
    messages = row[field]
    _check_messages(messages, where, field)
    return render_chat(messages, tokenizer, where)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check_messages(messages: Any, where: str, field: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: field '{field}' must be a non-empty list of messages, got {_kind(messages)}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"{where}: {field}[{i}] must be an object with 'role' and 'content'")
        for key in ("role", "content"):
            if key not in message:
                raise DataError(f"{where}: {field}[{i}] is missing field '{key}'")
            if not isinstance(message[key], str):
                raise DataError(f"{where}: {field}[{i}].{key} must be a string, got {_kind(message[key])}")


def render_chat(messages: list[dict], tokenizer: Any, where: str = "chat") -> str:
    """Render chat messages to text with the tokenizer's chat template (special tokens included)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{where}: chat messages need a tokenizer with a chat template, and this one has none")
    try:
        text = tokenizer.apply_chat_template(
            [{"role": m["role"], "content": m["content"]} for m in messages], tokenize=False
        )
    except Exception as error:  # a template may reject a role order with its own exception type
        raise DataError(f"{where}: the chat template rejected these messages: {str(error).splitlines()[0]}") from None
    return text
