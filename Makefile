# `make demo` and `make test` each do their own set-up on a fresh machine that
# has only python3 and make.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint components fuzz bench clean dist constraints

# Runtime dependencies at the release's pins (constraints.txt), so the tests run what
# `make dist` ships; the test tools resolve freely.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m llmgw.demo

lint: $(STAMP)
	$(BIN)/ruff check llmgw tests fuzz bench
	$(BIN)/mypy

# Debian packages some tests need (promtool, chromium, postgresql), installed when missing and root.
components:
	scripts/components

# The test files run in parallel, a file per worker at a time (most of the suite's time
# is spent waiting on real processes, not on the CPU): PYTEST_WORKERS=0 runs them in one.
# The slowest tests are printed at the end, so a run says where its minutes went.
# --no-loadscope-reorder keeps the files in the order tests/conftest.py gives them (the
# longest first): xdist otherwise hands out the files with the most tests first, and
# the three longest files, a test each, started last and ran a minute past the rest.
PYTEST_WORKERS ?= 4
# Bytecode is cached even where the environment says not to (PYTHONDONTWRITEBYTECODE):
# every worker and every llmgw process a test starts would compile llmgw and rewrite
# the test files' asserts again, about a minute of CPU in one run. The venvs tests make
# (the runbook, dist, onboarding, engine installs) are not byte-compiled at install by
# pip (PIP_NO_COMPILE): what runs compiles what it imports (runbook: 9 s of CPU less).
test: lint components
	env -u PYTHONDONTWRITEBYTECODE PIP_NO_COMPILE=1 $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# The release a node installs from its control plane's mirror (docs/operations.md,
# "Releases and the mirror"): dist/ holds the wheel, wheelhouse/, constraints.txt,
# bootstrap.py and SHA256SUMS. PYTHON is the interpreter the nodes run.
dist:
	PYTHON=$(PYTHON) scripts/dist

# constraints.txt from what .venv resolved for pyproject's dependencies.
constraints: $(STAMP)
	$(BIN)/python scripts/constraints

bench: $(STAMP)
	$(BIN)/python bench/rpc.py
	$(BIN)/python bench/fleet.py
	$(BIN)/python bench/install.py
	$(BIN)/python bench/failover.py
	$(BIN)/python bench/rollout.py
	$(BIN)/python bench/autoscale.py
	$(BIN)/python bench/adapters.py
	$(BIN)/python bench/packing.py

clean:
	rm -rf $(VENV) demo-state dist .pytest_cache .mypy_cache .ruff_cache .hypothesis
