# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# Everything installs into .venv; torch is pinned to the CPU build that lies on local disk.

VENV    ?= .venv
PY      := $(VENV)/bin/python
SBFT    := $(VENV)/bin/sbft
RUNS    ?= runs
STDLIB  := $(shell python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
MODEL   := $(RUNS)/tiny-llama

.PHONY: install demo test test-fast bench bench-attention bench-balance bench-accuracy simulate clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

$(MODEL)/config.json: | install
	$(SBFT) init-tiny $(MODEL)

# A short real training run: the tiny model, two ranks on gloo, real text (the Python stdlib sources).
demo: install $(MODEL)/config.json
	$(SBFT) train recipes/demo.yaml --nproc 2 --set data.path=$(STDLIB) --set model.path=$(MODEL)
	$(SBFT) report $(RUNS)/demo

test: install
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: install
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(RUNS) .sbft_cache
