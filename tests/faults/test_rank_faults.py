"""Faults of real ranks under `sbft train --nproc 2`: one line naming the rank and its cause, the
right exit status, no orphans, no rank waiting forever."""
from __future__ import annotations

import os
import signal
import time

import pytest
from _sbft import error_lines, rank_pids, start_sbft, wait_for_steps

pytestmark = pytest.mark.slow


def _start(write_recipe, tmp_path, **training):
    recipe = write_recipe(training={"max_steps": 500, **training})
    proc = start_sbft("train", recipe, "--nproc", 2)
    wait_for_steps(tmp_path / "run" / "metrics.jsonl", 1, proc)
    return proc, rank_pids(proc.pid)


def _verdict(proc, timeout=120) -> str:
    _, stderr = proc.communicate(timeout=timeout)
    lines = error_lines(stderr)
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def test_a_killed_rank_is_reported_with_its_signal(write_recipe, tmp_path):
    proc, ranks = _start(write_recipe, tmp_path)
    os.kill(ranks[1], signal.SIGKILL)
    line = _verdict(proc)
    assert line == "error: rank 1 was killed by SIGKILL (exit code -9); all ranks were stopped"
    assert proc.returncode == 128 + signal.SIGKILL


def test_ctrl_c_stops_every_rank_with_exit_130(write_recipe, tmp_path):
    proc, ranks = _start(write_recipe, tmp_path)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends to the foreground group
    assert _verdict(proc) == "error: interrupted (SIGINT): all ranks were stopped"
    assert proc.returncode == 130


def test_ranks_die_with_a_killed_launcher(write_recipe, tmp_path):
    import psutil

    proc, ranks = _start(write_recipe, tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(r) and psutil.Process(r).status() != "zombie" for r in ranks):
        time.sleep(0.1)
    orphans = [r for r in ranks if psutil.pid_exists(r) and psutil.Process(r).status() != "zombie"]
    for pid in orphans:  # do not leave them behind if the test fails
        os.kill(pid, signal.SIGKILL)
    assert not orphans, "ranks kept training after their launcher was killed"


def test_a_hung_rank_fails_the_others_at_the_collective_timeout(write_recipe, tmp_path):
    proc, ranks = _start(write_recipe, tmp_path, collective_timeout=3)
    os.kill(ranks[1], signal.SIGSTOP)
    stopped = time.monotonic()
    log = tmp_path / "run" / "logs" / "rank-0.log"
    while not log.exists() and time.monotonic() - stopped < 60:
        time.sleep(0.1)
    os.kill(ranks[1], signal.SIGCONT)  # let it receive the launcher's SIGTERM instead of waiting for SIGKILL
    line = _verdict(proc)
    assert line.startswith("error: rank 0 failed (exit code 1): another rank stopped responding")
    assert "(training.collective_timeout)" in line and f"traceback in {log}" in line
    assert proc.returncode == 1
    assert "Traceback" in log.read_text()


def test_ctrl_c_of_one_process_is_one_line_and_130(write_recipe, tmp_path):
    proc = start_sbft("train", write_recipe(training={"max_steps": 500}))
    wait_for_steps(tmp_path / "run" / "metrics.jsonl", 1, proc)
    os.killpg(proc.pid, signal.SIGINT)
    assert _verdict(proc) == "interrupted (Ctrl-C)"
    assert proc.returncode == 130
    assert not (tmp_path / "run" / ".sbft.lock").exists()  # the next --resume is not refused
