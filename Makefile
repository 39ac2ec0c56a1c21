# Each target creates .venv and installs the project when needed, so a fresh clone needs nothing else.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,bench,embedded]'
	touch $(STAMP)

.PHONY: install test demo bench lint
install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest

demo: $(STAMP)
	$(BIN)/ctxengine demo

bench: $(STAMP)
	$(BIN)/ctxengine bench build --json

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy core contract activities workflows services ctxengine harness worker.py
	$(BIN)/lint-imports
