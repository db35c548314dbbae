"""The documents follow the code and the measurements.

- docs/recipe.md's reference is the schema's own (regenerate with `reference_markdown()`).
- Every bold figure of the README's results table equals the JSON field its row names, at the
  precision shown: a figure edited by hand, or a benchmark re-run without updating the README, fails.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from sparsebalance_ft.recipe import reference_markdown

ROOT = Path(__file__).parents[1]
NUMBER = re.compile(r"[+-]?\d+(?:,\d{3})*(?:\.\d+)?")
SOURCE = re.compile(r"`([\w./+-]+\.json)#([^`]+)`")
PENDING = "lead fills"  # a row the lead fills in later (its figure has no JSON yet)


def test_recipe_reference_matches_the_schema():
    reference = (ROOT / "docs" / "recipe.md").read_text()
    assert reference_markdown() in reference, "docs/recipe.md is stale: paste sparsebalance_ft.recipe.reference_markdown()"


def test_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 320


# --- the results table -------------------------------------------------------------------------

def _cells(row: str) -> list[str]:
    """A markdown table row's cells; `\\|` is a pipe inside a cell (GFM), not a separator."""
    parts = re.split(r"(?<!\\)\|", row.strip().strip("|"))
    return [part.strip().replace("\\|", "|") for part in parts]


def results_rows(markdown: str) -> list[dict[str, str]]:
    """The rows of the table under `## Results`, keyed by header."""
    section = markdown.split("\n## Results", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = _cells(lines[0])
    return [dict(zip(header, _cells(line))) for line in lines[2:]]


def _select(node, segment: str):
    """One step of a source path: a key, a list index, `*` (every child), or `[k=v,...]` (the list item matching)."""
    if segment == "*":
        return list(node.values()) if isinstance(node, dict) else list(node)
    if segment.startswith("["):
        wanted = dict(pair.split("=", 1) for pair in segment[1:-1].split(","))
        matches = [item for item in node if all(_equal(item.get(k), v) for k, v in wanted.items())]
        assert len(matches) == 1, f"{segment}: {len(matches)} items match"
        return matches[0]
    return node[int(segment)] if isinstance(node, list) else node[segment]


def _equal(value, text: str) -> bool:
    if isinstance(value, (int, float)):
        return math.isclose(value, float(text))
    return str(value) == text


def resolve(source: str) -> float:
    """`file.json#/a/[k=v]/*/b|min|GiB` -> a number: walk the path, then apply the operations in order."""
    path, _, pointer = source.partition("#")
    pointer, *operations = pointer.split("|")
    nodes, fanned = [json.loads((ROOT / path).read_text())], False
    for segment in filter(None, pointer.split("/")):
        if segment == "*":
            nodes, fanned = [child for node in nodes for child in _select(node, "*")], True
        else:
            nodes = [_select(node, segment) for node in nodes]
    values = [float(v) for v in nodes]
    for operation in operations:
        if operation in ("min", "max", "sum"):
            values = [{"min": min, "max": max, "sum": sum}[operation](values)]
        elif operation == "GiB":
            values = [v / 2**30 for v in values]
        elif operation == "x100":
            values = [v * 100 for v in values]
        else:
            raise AssertionError(f"unknown operation {operation!r} in {source}")
    assert len(values) == 1, f"{source}: {'a * needs min, max or sum' if fanned else 'not one number'}"
    return values[0]


def figures(cell: str) -> list[tuple[float, int]]:
    """The bold numbers of a figure cell, each with its shown number of decimals."""
    out = []
    for bold in re.findall(r"\*\*([^*]+)\*\*", cell):
        for number in NUMBER.findall(bold):
            decimals = len(number.split(".")[1]) if "." in number else 0
            out.append((float(number.replace(",", "")), decimals))
    return out


def figure_mismatches(markdown: str) -> list[str]:
    """Every bold figure that disagrees with its source, as one line each (empty: all agree)."""
    problems = []
    for row in results_rows(markdown):
        if PENDING in row["figure"]:
            continue
        shown, sources = figures(row["figure"]), SOURCE.findall(row["source (JSON#field)"])
        if len(shown) != len(sources) or not shown:
            problems.append(f"{row['result']}: {len(shown)} bold figures, {len(sources)} sources")
            continue
        for (value, decimals), (path, pointer) in zip(shown, sources):
            measured = resolve(f"{path}#{pointer}")
            if abs(measured - value) > 0.5 * 10**-decimals + 1e-9:
                problems.append(f"{row['result']}: shows {value}, {path}#{pointer} is {measured:.{decimals + 2}f}")
    return problems


def test_every_headline_figure_is_its_json_field():
    assert figure_mismatches((ROOT / "README.md").read_text()) == []


def test_every_headline_row_names_its_command():
    rows = results_rows((ROOT / "README.md").read_text())
    assert len(rows) >= 5
    for row in rows:
        assert row["reproduce"].startswith("`make ") or row["reproduce"].startswith("`sbft bench "), row["result"]
        if row["reproduce"].startswith("`make "):
            target = row["reproduce"].strip("`").split()[1]
            assert re.search(rf"^{re.escape(target)}:", (ROOT / "Makefile").read_text(), re.M), target


@pytest.mark.parametrize(("old", "new"), [("**7.69x**", "**7.70x**"), ("**+0.47%**", "**+0.57%**"),
                                          ("**10**/10 at every", "**9**/10 at every"), ("**4.78 GiB**", "**4.20 GiB**")])
def test_an_edited_figure_fails(old, new):
    readme = (ROOT / "README.md").read_text()
    assert old in readme
    assert figure_mismatches(readme.replace(old, new, 1)), f"editing {old} to {new} went unnoticed"


def test_a_source_path_that_matches_nothing_fails():
    with pytest.raises((KeyError, AssertionError)):
        resolve("bench_results/balance/balance.json#/results/no-such-configuration/speedup_vs_peer")
