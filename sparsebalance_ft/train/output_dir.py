"""One run per output directory: a fresh run never writes over another's files, two runs never share one.

A fresh run refuses a directory that already holds anything unless it is told to `--overwrite`
(which clears it) or to `--resume` (which continues it). While it runs, rank 0 holds a lock file
naming its pid and host; a lock whose process is gone (`kill -9`) is recognised as stale and taken
over, so a crash never blocks the `--resume` that follows it.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
import warnings
from pathlib import Path

from ..errors import UserError
from .checkpoint import checkpoint_dirs

LOCK_NAME = ".sbft.lock"


class OutputDirError(UserError):
    """The output directory is in use, holds another run, or cannot be written."""


def _read_lock(out: Path) -> dict | None:
    try:
        return json.loads((out / LOCK_NAME).read_text())
    except (OSError, ValueError):
        return None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _lock_is_live(info: dict) -> bool:
    """Another host's lock cannot be checked from here, so it counts as live."""
    if info.get("host") != socket.gethostname():
        return True
    return _process_alive(int(info.get("pid", -1)))


def _describe(info: dict) -> str:
    return f"pid {info.get('pid')} on {info.get('host')}"


def _refuse_if_locked(out: Path) -> None:
    info = _read_lock(out)
    if info is not None and _lock_is_live(info):
        raise OutputDirError(
            f"training.output_dir: {out} is in use by another sbft train ({_describe(info)}); "
            f"wait for it, stop it, or delete {out / LOCK_NAME} if that run is gone"
        )


WRITE_PROBE = ".sbft-write-test-"  # + pid: the empty file that shows the directory is writable


def _check_writable(out: Path) -> None:
    probe = out / f"{WRITE_PROBE}{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink(missing_ok=True)  # another rank's --overwrite may have cleared it already
    except OSError as error:
        raise OutputDirError(f"training.output_dir: cannot write to {out}: {error.strerror or error}") from None


def check_output_dir(out: str | Path, resume: bool | str | Path, overwrite: bool) -> None:
    """Refuse, in one line, a directory in use, unwritable, or holding a run this one would overwrite.

    `resume` is True for the newest checkpoint of `out` or a checkpoint's path. A bare `--resume` in a
    directory whose run logged steps but left no checkpoint would start again from step 0 and drop
    that log, so it is refused too (job scripts that always pass --resume still start in an empty dir).
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"training.output_dir: {out} is a file, not a directory")
    _refuse_if_locked(out)
    _check_writable(out)
    if resume is True and not overwrite and not checkpoint_dirs(out) and _has_logged_steps(out):
        raise OutputDirError(
            f"training.output_dir: {out} holds a run with logged steps but no checkpoint to resume; "
            "replace it with --overwrite or choose another output_dir"
        )
    if resume or overwrite:
        return
    # every rank probes at once: another rank's probe is not a run
    held = sorted(p.name for p in out.iterdir() if p.name != LOCK_NAME and not p.name.startswith(WRITE_PROBE))
    if held:
        raise OutputDirError(
            f"training.output_dir: {out} already holds a run ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}); "
            "continue it with --resume or replace it with --overwrite"
        )


def _has_logged_steps(out: Path) -> bool:
    metrics = out / "metrics.jsonl"
    return metrics.is_file() and metrics.stat().st_size > 0


def clear_output_dir(out: str | Path) -> None:
    """What `--overwrite` does: delete everything in the directory except a lock."""
    for path in Path(out).iterdir():
        if path.name == LOCK_NAME:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


class RunLock:
    """`with RunLock(out):` holds OUT/.sbft.lock for the run; a stale lock (its process gone) is taken over."""

    def __init__(self, out: str | Path):
        self.path = Path(out) / LOCK_NAME
        self.held = False

    def acquire(self) -> None:
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                info = _read_lock(self.path.parent) or {}
                if info and _lock_is_live(info):
                    _refuse_if_locked(self.path.parent)
                warnings.warn(f"{self.path}: stale lock of a run that is gone ({_describe(info)}); taking it over", stacklevel=2)
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as handle:
                handle.write(record)
            self.held = True
            return
        raise OutputDirError(f"training.output_dir: could not take {self.path}; another run is starting there")

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
