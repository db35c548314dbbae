"""CLI plumbing: piped output is not cut at 80 columns, `--version`, and `--resume [CHECKPOINT]`."""
from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version

import pytest

from cli.train import optional_resume_value

WIDE_TABLE = """
from rich.table import Table
from cli.common import console
table = Table()
for i in range(5):
    table.add_column(f"column number {i} with a long name")
table.add_row(*[f"value {i} that is also rather long" for i in range(5)])
console.print(table)
"""


def test_piped_tables_keep_their_width():
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run([sys.executable, "-c", WIDE_TABLE], capture_output=True, text=True, env=env, check=True).stdout
    assert "column number 4 with a long name" in out and "value 4 that is also rather long" in out
    assert max(len(line) for line in out.splitlines()) > 80


def test_version():
    result = subprocess.run([sys.executable, "-m", "sbft_cli.app", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == f"sbft {version('sparsebalance-ft')}"


def test_resume_takes_an_optional_checkpoint(tmp_path):
    assert optional_resume_value(["train", "r.yaml", "--resume"]) == ["train", "r.yaml", "--resume=latest"]
    assert optional_resume_value(["train", "--resume", "r.yaml"]) == ["train", "--resume=latest", "r.yaml"]
    assert optional_resume_value(["train", "r.yaml", "--resume", "--nproc", "2"])[2] == "--resume=latest"
    chosen = str(tmp_path / "run" / "checkpoint-30")  # named like a checkpoint: its value, even if missing
    assert optional_resume_value(["train", "r.yaml", "--resume", chosen]) == ["train", "r.yaml", "--resume", chosen]
    assert optional_resume_value(["train", "r.yaml", "--resume", str(tmp_path)])[2:] == ["--resume", str(tmp_path)]


@pytest.mark.parametrize("code, status, stderr", [(None, 0, ""), (3, 3, ""), ("bad", 1, "bad\n")])
def test_exit_without_teardown_runs_exit_handlers_and_flushes(code, status, stderr):
    program = ("import atexit; atexit.register(lambda: print('handler ran'));"
               f"from sbft_cli.common import exit_without_teardown; print('unflushed', end=''); exit_without_teardown({code!r});"
               "print('never')")
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stdout, run.stderr) == (status, "unflushedhandler ran\n", stderr)
