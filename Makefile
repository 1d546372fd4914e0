# Quickstart: `make train` (the main job on the embedded default), `make test` (the whole suite).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  := torch==2.13.0

.PHONY: setup train test test-fast bench clean

setup: $(VENV)/.installed

# torch first (the small CPU build), then the project and its pinned dependencies.
$(VENV)/.installed: pyproject.toml requirements-lock.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -c requirements-lock.txt -e ".[test]"
	touch $@

train: setup
	$(PY) -m megacritic train $(ARGS)

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

bench: setup
	$(PY) -m megacritic bench $(ARGS)

clean:
	rm -rf $(VENV) outputs .pytest_cache
