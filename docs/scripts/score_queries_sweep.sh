#!/usr/bin/env bash
# Why `sparsity.score_queries` is 8 (docs/benchmarks/step.md, "Sampled query tokens per block"): the default
# budget's loss against dense at 4K tokens on SmolLM2-135M for 2, 4, 8 and 12 sampled query tokens per block
# on _pydecimal.py (the step bench's text, read from its start), for 4 and 8 on _collections_abc.py (a second
# module, with budgets 0.6 and 0.7 beside the default at 8), and four other ways to close the gap, each with
# the earlier 4 tokens: two sink blocks, four local blocks, layers 0-1 dense, tau 0.85. One
# `sbft bench step --loss-only` per file (dense and the budgets, one forward each, same weights and tokens);
# about 10 minutes on 2 cores. Writes bench_results/step/score-queries/<module>-<label>.json and prints one
# line per budget.
set -euo pipefail
SBFT=${SBFT:-.venv/bin/sbft}
PYTHON=${PYTHON:-.venv/bin/python}
MODEL=${MODEL:-runs/smollm2}
OUT=${OUT:-bench_results/step/score-queries}
mkdir -p "$OUT"
run() {  # arms, module, label, recipe overrides...
  local arms=$1 module=$2 label=$3
  shift 3
  local sets=(--set "data.text_glob=$module.py")
  for override in "$@"; do sets+=(--set "$override"); done
  "$SBFT" bench step --loss-only --model "$MODEL" --lengths 4096 --arms "$arms" "${sets[@]}" --out "$OUT/$module-$label.json"
}
for count in 2 4 8 12; do run dense,0.5 _pydecimal "$count" "sparsity.score_queries=$count"; done
run dense,0.5 _collections_abc 4 sparsity.score_queries=4
run dense,0.5,0.6,0.7 _collections_abc 8 sparsity.score_queries=8
run dense,0.5 _pydecimal 4-sink2 sparsity.score_queries=4 sparsity.sink_blocks=2
run dense,0.5 _pydecimal 4-local4 sparsity.score_queries=4 sparsity.local_blocks=4
run dense,0.5 _pydecimal 4-dense01 sparsity.score_queries=4 "sparsity.dense_layers=[0,1]"
run dense,0.5 _pydecimal 4-tau085 sparsity.score_queries=4 sparsity.tau=0.85
for f in "$OUT"/*.json; do
  "$PYTHON" -c 'import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    if r["arm"] != "dense":
        print("%s budget %s: loss gap %+.2f%%, kept density %.3f" % (sys.argv[1], r["arm"], 100 * r["loss_gap"], r["kept_density"]))' "$f"
done
