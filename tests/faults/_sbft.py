"""Run `sbft` as a user does and read its answer: stderr lines, exit status, rank processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SBFT = [sys.executable, "-m", "sbft_cli.app"]


def sbft_env(**extra) -> dict:
    """The environment of a user's shell: no launcher or sbft settings, and no COLUMNS (pytest-xdist workers
    set 80, and messages would wrap where a piped `sbft` prints them whole)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "MASTER_", "SBFT_", "COLUMNS"))}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def run_sbft(*args, timeout=300, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([*SBFT, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=sbft_env(**(env or {})))


def _as_from_a_terminal() -> None:
    """Ctrl-C reaches the command as it does from an interactive shell, even when pytest itself was started
    in the background (a non-interactive shell starts background jobs with SIGINT ignored, and children inherit it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_sbft(*args, env=None) -> subprocess.Popen:
    """A background `sbft` in its own session (so a test can Ctrl-C its whole process group)."""
    return subprocess.Popen(
        [*SBFT, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=sbft_env(**(env or {})), start_new_session=True, preexec_fn=_as_from_a_terminal,
    )


def error_lines(stderr: str) -> list[str]:
    """stderr without progress output: the lines a user reads as the verdict."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith(
        ("step ", "data:", "Loading weights", "setup:", "changed from the defaults:", "memory rank "))]


def one_error_line(result, code: int = 2) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == code, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(error_lines(result.stderr)) == 1, result.stderr[-3000:]
    return error_lines(result.stderr)[0]


def wait_for_steps(metrics: Path, steps: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"{metrics}: fewer than {steps} steps after {timeout}s")


def rank_pids(launcher_pid: int) -> list[int]:
    """The launcher's child processes (its ranks), by rank order of start."""
    import psutil

    return [p.pid for p in sorted(psutil.Process(launcher_pid).children(), key=lambda p: p.create_time())]
