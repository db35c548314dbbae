"""Triton kernel checks without a GPU: rerun a test file under triton's interpreter in a fresh process.

``TRITON_INTERPRET=1`` must be set before triton itself is imported: triton decorates its own language
helpers (``tl.zeros`` and the like) with ``@triton.jit`` at import, and the variable is read at decoration.
Inside a full pytest run triton has long been imported by then (sparsebalance_ft imports it), so on a
CPU-only machine one test per kernel file reruns that file in a fresh interpreter with the variable set;
``TRITON_INTERPRET=1 pytest FILE`` runs its checks directly. With a GPU the checks run in process, compiled.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from sparsebalance_ft.attention.kernels.triton import interpreting

IN_PROCESS = torch.cuda.is_available() or interpreting()
kernel_check = pytest.mark.skipif(not IN_PROCESS, reason="runs in test_kernels_in_fresh_interpreter's subprocess")
rerun_check = pytest.mark.skipif(IN_PROCESS, reason="the kernel checks run in this process")


def rerun_under_interpreter(path: str, known_skips: dict[str, int]) -> None:
    """Run the file's tests with ``TRITON_INTERPRET=1``: they must pass, and skip only `known_skips` (reason:
    count), the cases the interpreter cannot check and `make gpu-check` runs compiled."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", path], env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1], run.stdout[-2000:]
    skipped: dict[str, int] = {}
    for line in run.stdout.splitlines():  # "SKIPPED [4] path:line: reason" (-rs groups equal reasons)
        if line.startswith("SKIPPED ["):
            count, reason = int(line[9:line.index("]")]), line.split(": ", 1)[1]
            if reason != "the kernel checks run in this process":  # the rerunning test, inside the subprocess
                skipped[reason] = skipped.get(reason, 0) + count
    assert skipped == known_skips, f"the subprocess skipped other cases than the known ones: {skipped}"
    logging.getLogger(__name__).warning("triton interpreter, %s: %d cases skipped, run by make gpu-check: %s",
                                        os.path.basename(path), sum(skipped.values()), skipped)
