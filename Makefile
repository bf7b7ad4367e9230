# The two commands people need: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint protos bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned, so nothing can resolve a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[server,test]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/fastdecode demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -ra

protos: $(STAMP)
	$(BIN)/python -m fastdecode.codegen

bench: $(STAMP)
	$(BIN)/python bench/codec_bench.py

clean:
	rm -rf $(VENV) .models .pytest_cache .ruff_cache .hypothesis
