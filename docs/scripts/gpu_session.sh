#!/usr/bin/env bash
# The second call of a GPU session (docs/gpu-session.md), run in the repository root on the lent machine after
# a first call left .gpu/smollm2.gguf.part00 there: the wheels the image lacks installed beside the project, the
# CLI importable without an install, SmolLM2 converted from its reassembled GGUF, then `make gpu-check` inside
# the call's limit, and its files copied to $OUT (at most 8 come back).
set -uo pipefail
PY=${PY:-python3}
LIMIT_S=${LIMIT_S:-520}  # what is left of a 600 s call after the set-up and the copy
site=/tmp/sbft-site
out=${OUT:?run this through the device tool, which sets OUT}

$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .gpu/wheels/*.whl || exit 1
ln -sfn "$PWD/cli" "$site/sbft_cli"  # the cli/ folder installs as sbft_cli
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
cat .gpu/smollm2.gguf.part00 .gpu/smollm2.gguf.part01 > /tmp/smollm2.gguf || exit 1
$PY -m sbft_cli.app init-model smollm2 runs/smollm2 --gguf /tmp/smollm2.gguf || exit 1
timeout "$LIMIT_S" make -o install gpu-check PY="$PY" SBFT="$PY -m sbft_cli.app" 2>&1 | tee "$out/gpu-check.log"
cp bench_results/gpu/attention-*.json bench_results/gpu/step-*.json bench_results/gpu/step-*.png "$out"/ 2>/dev/null
ls "$out"
