#!/usr/bin/env bash
# Every GPU check in one call (ci/gpu_smoke.py prints one table), sized for one device call of <= 8 minutes on a
# machine with torch + CUDA but no vLLM, no Transformer Engine and no internet. megatron-core travels as its
# unpacked wheel (ci/fetch_gpu_pins.sh puts it in .cache/gpu-pins/megatron-core-0.19.2; carry that directory):
# when `import megatron.core` fails, that directory is put on PYTHONPATH. Without CUDA the CPU-checkable parts run
# and every GPU step says it was skipped.
#   bash ci/gpu_smoke.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
if ! "$PY" -W ignore -c "import megatron.core" 2>/dev/null; then
  site="${NRC_GPU_PINS:-$PWD/.cache/gpu-pins}/megatron-core-0.19.2"
  [ -d "$site/megatron" ] || { echo "megatron-core is not importable and $site is missing: run ci/fetch_gpu_pins.sh"; exit 2; }
  export PYTHONPATH="$site:$PYTHONPATH" NRC_MCORE_SITE="$site"
fi
timeout 480 "$PY" -W ignore ci/gpu_smoke.py
