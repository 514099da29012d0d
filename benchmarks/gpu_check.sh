#!/usr/bin/env bash
# The vllm backend on a GPU machine: the same tests as on the CPU (generation, stop tokens, seeds,
# log-probs vs the learner's recomputation before and after a weight sync, a 2-iteration training
# with rollout.engine=vllm), now with vLLM on CUDA, then rollout tokens/s of vllm vs hf on CUDA.
#
# Needs: this repo's environment with a CUDA torch (`python3 -m pip install -e '.[dev]'`; on a GPU
# machine pip resolves torch==2.13.0 to the CUDA build) and a Python that has vLLM for CUDA in
# RAGEN_VLLM_PYTHON (e.g. `python3 -m venv /opt/vllm && /opt/vllm/bin/pip install vllm`).
#   RAGEN_VLLM_PYTHON=/opt/vllm/bin/python bash benchmarks/gpu_check.sh
# Prints one BENCH line per figure at the end; exit status is the tests'.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
: "${RAGEN_VLLM_PYTHON:?set RAGEN_VLLM_PYTHON to a Python with vLLM for CUDA}"
export RAGEN_VLLM_PYTHON RAGEN_REQUIRE_VLLM=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "no GPU (nvidia-smi failed)"; exit 2; }
"$PY" -c "import torch; assert torch.cuda.is_available(), 'torch in $PY has no CUDA'; print('torch', torch.__version__, torch.version.cuda)" || exit 2
"$RAGEN_VLLM_PYTHON" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())" || exit 2
"$PY" -m pytest -q -p no:cacheprovider tests/ragen_core/test_vllm_engine.py
status=$?
"$PY" benchmarks/rollout.py --vllm --device cuda --threads 0
exit $status
