"""One run per output directory: refusal, overwrite, and a lock that a killed run does not leave stuck."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from sparsebalance_ft.train.checkpoint import COMPLETE_MARKER
from sparsebalance_ft.train.output_dir import LOCK_NAME, OutputDirError, RunLock, check_output_dir, clear_output_dir


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_used_directory_needs_resume_or_overwrite(tmp_path):
    (tmp_path / "checkpoint-30").mkdir()
    with pytest.raises(OutputDirError, match="already holds a run"):
        check_output_dir(tmp_path, resume=False, overwrite=False)
    check_output_dir(tmp_path, resume=True, overwrite=False)
    check_output_dir(tmp_path, resume=False, overwrite=True)
    clear_output_dir(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_resume_refuses_to_restart_a_run_that_left_no_checkpoint(tmp_path):
    check_output_dir(tmp_path, resume=True, overwrite=False)  # empty: a job script's --resume starts fresh
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    with pytest.raises(OutputDirError, match="logged steps but no checkpoint"):
        check_output_dir(tmp_path, resume=True, overwrite=False)
    assert (tmp_path / "metrics.jsonl").read_text().startswith('{"step": 1')
    (tmp_path / "checkpoint-1").mkdir()  # a save cut short is no checkpoint either
    with pytest.raises(OutputDirError, match="no checkpoint"):
        check_output_dir(tmp_path, resume=True, overwrite=False)
    (tmp_path / "checkpoint-1" / COMPLETE_MARKER).write_text("{}")
    check_output_dir(tmp_path, resume=True, overwrite=False)


def test_a_live_lock_refuses_a_second_run(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(OutputDirError, match=f"in use by another sbft train \\(pid \\d+ on {socket.gethostname()}\\)"):
            check_output_dir(tmp_path, resume=True, overwrite=False)
        with pytest.raises(OutputDirError, match="in use"):
            RunLock(tmp_path).acquire()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_stale_lock_of_a_killed_run_is_taken_over(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname()}))
    check_output_dir(tmp_path, resume=True, overwrite=False)
    with pytest.warns(UserWarning, match="stale lock"):
        lock = RunLock(tmp_path)
        lock.acquire()
    assert lock.held
    lock.release()


def test_another_ranks_write_probe_is_not_a_run(tmp_path):
    """Every rank checks the directory at once: one rank's probe file must not make another refuse it."""
    from sparsebalance_ft.train.output_dir import WRITE_PROBE

    (tmp_path / f"{WRITE_PROBE}99999").write_text("")
    check_output_dir(tmp_path, resume=False, overwrite=False)  # no refusal
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(OutputDirError, match=r"already holds a run \(metrics.jsonl\)"):
        check_output_dir(tmp_path, resume=False, overwrite=False)
