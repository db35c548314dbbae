"""`model.path` as a Hugging Face hub id (`owner/name`) for users who are online.

A local folder always wins; a value that is not one and reads like `owner/name` goes to the hub. Offline
(HF_HUB_OFFLINE set, or no connection) that fails with one line naming the id rather than a traceback.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def is_hub_id(value: str) -> bool:
    """`owner/name` that is not an existing local path (absolute and ./ paths never are)."""
    return bool(_HUB_ID.fullmatch(value)) and not Path(value).exists()


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_failure(key: str, hub_id: str, error: Exception) -> str:
    """One line: why `hub_id` could not be loaded from the hub."""
    if hub_offline():
        reason = "HF_HUB_OFFLINE is set"
    else:
        first = str(error).strip().splitlines()
        reason = first[0] if first else type(error).__name__
    return f"{key}: {hub_id} is not a local folder and cannot be loaded from the Hugging Face hub ({reason})"
