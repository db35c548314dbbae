"""Triton kernels: import-guarded; the CPU install never needs triton.

Status: no Triton kernel is shipped yet. This project's development machines have neither a GPU nor
triton, so a Triton kernel could not be validated (not even under ``TRITON_INTERPRET=1``). The
``triton`` backend therefore resolves to FlexAttention (itself compiled to Triton by inductor on CUDA),
and to the PyTorch kernel where FlexAttention cannot run. `TRITON_AVAILABLE` tells whether triton imports.
"""
from __future__ import annotations

try:  # pragma: no cover - triton is not installed on CPU machines
    import triton  # noqa: F401

    TRITON_AVAILABLE = True
except ImportError:
    TRITON_AVAILABLE = False
