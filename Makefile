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
	$(PY) -m pip install -q -c requirements-lock.txt -e ".[test,ray]"
	touch $@

# The embedded default model: a tiny Qwen2-style Hugging Face folder generated from the seed, so that
# `make train` starts through the same checkpoint loader as a real model.
DEFAULT_MODEL := .cache/default-critic

$(DEFAULT_MODEL)/config.json: $(VENV)/.installed
	$(PY) -m megacritic init-hf --out $(DEFAULT_MODEL)

train: setup $(DEFAULT_MODEL)/config.json
	$(PY) -m megacritic train model.path=$(DEFAULT_MODEL) $(ARGS)

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

bench: setup
	$(PY) -m megacritic bench $(ARGS)

clean:
	rm -rf $(VENV) outputs .pytest_cache .cache
