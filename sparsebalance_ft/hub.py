"""`model.path`, `data.path` and `data.eval_path` as Hugging Face hub ids (`owner/name`) for users who are online.

One rule for models and datasets, below every layer that reads a path. A local path always wins; a value that is not one and reads like `owner/name` goes to the hub. Offline
(HF_HUB_OFFLINE set, or no connection) that fails with one line naming the id rather than a traceback.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


# A missing `dir/train.jsonl` is a mistyped local file, not a repository (repository names may hold dots:
# `Qwen/Qwen2.5-7B`, so only data files' own suffixes are excluded).
_DATA_FILE_SUFFIXES = (".jsonl", ".json", ".ndjson", ".parquet", ".pq", ".txt", ".csv", ".arrow")


def is_hub_id(value: str) -> bool:
    """`owner/name` that is not an existing local path (absolute and ./ paths never are) nor a data file's name."""
    return (bool(_HUB_ID.fullmatch(value)) and not Path(value).exists()
            and Path(value).suffix.lower() not in _DATA_FILE_SUFFIXES)


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def no_hub_kernels_offline() -> None:
    """Offline, transformers must not reach for its hub kernels (with the `kernels` package installed it
    swaps in `kernels-community/rotary` and others on CUDA at the first forward, and fails there when they
    are not cached: seen on an offline H200). A user's explicit USE_HUB_KERNELS still decides."""
    if hub_offline():
        os.environ.setdefault("USE_HUB_KERNELS", "NO")


def hub_failure(key: str, hub_id: str, error: Exception) -> str:
    """One line: why `hub_id` could not be loaded from the hub."""
    if hub_offline():
        reason = "HF_HUB_OFFLINE is set"
    else:
        first = str(error).strip().splitlines()
        reason = first[0] if first else type(error).__name__
    return f"{key}: {hub_id} is not a local folder and cannot be loaded from the Hugging Face hub ({reason})"
