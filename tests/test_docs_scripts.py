"""docs/scripts/kernel_parts.py reaches into the kernel's private pieces, so a refactor of `torch_kernel.py`
could break it silently until the next person re-runs its documented figures: run it on a tiny layer.
(`selection_before_after.py` compares against an earlier commit read from git: not a unit test's job.)"""
from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPTS = Path(__file__).parents[1] / "docs" / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernel_parts_times_every_part_of_a_small_layer():
    row = _load("kernel_parts").parts_at(512, 0.5, repeats=1)
    assert set(row["seconds"]) == {"dense_forward", "sparse_forward", "diagonal", "off_diagonal",
                                   "off_diagonal_pre_gathered", "sparse_backward", "dense_forward_backward"}
    assert all(seconds > 0 for seconds in row["seconds"].values())
    assert 0.3 < row["kept_density"] < 0.7  # the forced density, within a block's rounding per row
