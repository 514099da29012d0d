# The README's two commands: `make run` (main job) and `make test` (whole suite).
# Both create the virtual environment if needed; a second call does not reinstall
# (the stamp is newer than pyproject.toml).
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0
export RAY_AUTH_MODE := disabled
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_DISABLE_TELEMETRY := true
export TOKENIZERS_PARALLELISM := false
export HF_HUB_DISABLE_PROGRESS_BARS := 1

.PHONY: setup run demo test lint bench

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=24"
	$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/ragen train configs/bandit-tiny.yaml

demo: $(STAMP)
	$(BIN)/ragen demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

# gym-sokoban is a benchmark-only reference (not a dependency): --no-deps, as only its
# room_utils.py is loaded; when already installed, pip does nothing (no index lookup).
bench: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps gym-sokoban==0.0.6
	$(BIN)/python benchmarks/envs.py
