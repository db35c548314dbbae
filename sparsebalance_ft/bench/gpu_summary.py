"""`make gpu-check`'s one JSON: the headline of each GPU benchmark file in a folder.

A GPU session is short and rare here, so its script ends by printing what a person compares first:
per attention backend, the layer speedup over dense SDPA and its share of the ideal 1/density; per
step backend, the whole-step speedup at each length and budget with the selection's share of the
sparse attention and the host synchronisations per step. The full rows stay in the files it names.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _attention(rows: list[dict]) -> list[dict]:
    return [{key: row.get(key) for key in ("length", "density", "route", "speedup", "share_of_ideal", "selection_share")}
            for row in rows]


def _step(rows: list[dict]) -> list[dict]:
    keep = ("length", "arm", "step_s", "speedup_vs_dense", "amdahl_ceiling", "loss_gap", "kept_density",
            "attention_share", "selection_share_of_attention", "host_syncs_per_step")
    return [{key: row.get(key) for key in keep} for row in rows]


def summarize(folder: Path) -> dict:
    """{file name: headline rows} for every `attention-*.json` and `step-*.json` in `folder`."""
    summary: dict = {"folder": str(folder)}
    for path in sorted(folder.glob("attention-*.json")) + sorted(folder.glob("step-*.json")):
        data = json.loads(path.read_text())
        pick = _attention if path.name.startswith("attention-") else _step
        summary[path.name] = {"device": data["setup"].get("gpu") or data["setup"].get("device"),
                              "rows": pick(data["rows"])}
    return summary


if __name__ == "__main__":
    print(json.dumps(summarize(Path(sys.argv[1] if len(sys.argv) > 1 else "bench_results/gpu")), indent=1))
