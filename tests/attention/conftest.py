"""Fixtures of the attention tests.

- `device`: where a kernel check runs: the GPU when there is one, else the CPU (under triton's interpreter).
"""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
