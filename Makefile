# `make demo` and `make test` each do their own set-up on a fresh machine that
# has only python3 and make.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint components fuzz bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m llmgw.demo

lint: $(STAMP)
	$(BIN)/ruff check llmgw tests fuzz bench
	$(BIN)/mypy

# Debian packages some tests need (promtool, chromium, postgresql), installed when missing and root.
components:
	scripts/components

test: lint components
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python bench/rpc.py
	$(BIN)/python bench/fleet.py
	$(BIN)/python bench/install.py
	$(BIN)/python bench/failover.py

clean:
	rm -rf $(VENV) demo-state .pytest_cache .mypy_cache .ruff_cache .hypothesis
