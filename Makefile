# Each target creates .venv and installs the project when needed, so a fresh clone needs nothing else.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,bench,otel,embedded]'
	touch $(STAMP)

# The Node example's locked dependencies (its test runs `npm ci` itself when they are missing; skipped without node).
TS_EXAMPLE := examples/orchestrator-ts
$(TS_EXAMPLE)/node_modules/.package-lock.json: $(TS_EXAMPLE)/package-lock.json
	-command -v npm >/dev/null && cd $(TS_EXAMPLE) && npm ci --no-audit --no-fund --silent

# The project's packages (as pyproject.toml lists them for setuptools and import-linter).
PACKAGES := core contract activities workflows services ctxengine harness

.PHONY: install bytecode test demo bench lint
install: $(STAMP) bytecode $(TS_EXAMPLE)/node_modules/.package-lock.json

# The project's modules compiled at each install (only what changed): the workflow sandbox imports the workflow
# modules again for every new workflow instance, and without bytecode (an editable install under
# PYTHONDONTWRITEBYTECODE) each of those imports compiles the source again (docs/operations.md).
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q -j0 --invalidation-mode timestamp $(PACKAGES) worker.py

# The suite on TEST_JOBS pytest-xdist workers, each with its own Temporal dev server and PostgreSQL, a test file
# whole on one worker (tests/conftest.py). `make test TEST_JOBS=0` runs it in one process.
TEST_JOBS ?= 2
test: install
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile

demo: $(STAMP) bytecode
	$(BIN)/ctxengine demo

bench: $(STAMP)
	$(BIN)/ctxengine bench build --json

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy $(PACKAGES) worker.py
	$(BIN)/lint-imports