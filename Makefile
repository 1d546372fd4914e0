# Quickstart: `make train` (the main job on the embedded default), `make test` (the whole suite),
# `make test-verl` (the verl adapter's tests beside the real verl, in an environment of its own).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  := torch==2.13.0

.PHONY: setup train test test-fast test-verl bench clean

setup: $(VENV)/.installed

# torch first (the small CPU build), then the project and its pinned dependencies.
$(VENV)/.installed: pyproject.toml requirements-lock.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -c requirements-lock.txt -e ".[test,ray]"
	touch $@

# The verl adapter's tests run beside the real verl 0.9.1 under verl's own pins (tensordict 0.10.0, transformers
# 5.10.x), in a separate environment: megacritic with its dependencies resolved against that lock (so its
# declared ranges must admit verl's versions), then verl and what its single controller imports, without the
# rest of verl's training stack (tests/integrations/requirements-verl.txt says what is in it).
VERL_VENV := .cache/venv-verl
VERL_PY   := $(VERL_VENV)/bin/python
VERL_LOCK := tests/integrations/requirements-verl.txt
VERL_TESTS := tests/integrations tests/data/test_rollouts.py

$(VERL_VENV)/.installed: pyproject.toml $(VERL_LOCK)
	rm -rf $(VERL_VENV)
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_PY) -m pip install -q --upgrade pip
	$(VERL_PY) -m pip install -q $(TORCH)
	$(VERL_PY) -m pip install -q -c $(VERL_LOCK) -e ".[test]"
	$(VERL_PY) -m pip install -q --no-deps -r $(VERL_LOCK)
	touch $@

# The embedded default model: a tiny Qwen2-style Hugging Face folder generated from the seed, so that
# `make train` starts through the same checkpoint loader as a real model.
DEFAULT_MODEL := .cache/default-critic

$(DEFAULT_MODEL)/config.json: $(VENV)/.installed
	$(PY) -m megacritic init-hf --out $(DEFAULT_MODEL)

train: setup $(DEFAULT_MODEL)/config.json
	$(PY) -m megacritic train model.path=$(DEFAULT_MODEL) $(ARGS)

# The whole suite, then the verl adapter's tests in their own environment (its build and run add ~1.5 min).
test: setup $(VERL_VENV)/.installed
	$(PY) -m pytest -q
	$(VERL_PY) -m pytest -q $(VERL_TESTS)

test-verl: $(VERL_VENV)/.installed
	$(VERL_PY) -m pytest -q $(VERL_TESTS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

bench: setup
	$(PY) -m megacritic bench $(ARGS)

clean:
	rm -rf $(VENV) outputs .pytest_cache .cache
