#!/usr/bin/env bash
# Fetch the GPU image's pinned releases that CPU tests check against (no install into any venv):
#   megatron-core 0.19.2: the cp311 wheel, unpacked to $NRC_GPU_PINS/megatron-core-0.19.2 (put on PYTHONPATH by
#     tests in a subprocess and by ci/test_mcore019.sh; its metadata asks for Python 3.12, the code runs on 3.11);
#   vLLM 0.33.0: only its pure-Python weight-transfer, engine-argument and quantization-method files, extracted to
#     $NRC_GPU_PINS/vllm-0.33.0 (the CUDA wheel is never installed: it pins torch 2.14 + CUDA).
# Idempotent: a second run reuses the downloaded wheels (pip download skips files already present).
#   bash ci/fetch_gpu_pins.sh            # default destination: .cache/gpu-pins in the repository
#   NRC_GPU_PINS=/some/dir bash ci/fetch_gpu_pins.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${NRC_GPU_PINS:-$PWD/.cache/gpu-pins}"
PY="${PYTHON:-python}"
mkdir -p "$DEST/wheels"
if [ ! -d "$DEST/megatron-core-0.19.2/megatron" ]; then
  "$PY" -m pip download -q megatron-core==0.19.2 --no-deps --only-binary=:all: --python-version 3.11 \
    --ignore-requires-python -d "$DEST/wheels"
  rm -rf "$DEST/megatron-core-0.19.2.tmp"
  "$PY" -m zipfile -e "$DEST"/wheels/megatron_core-0.19.2-*.whl "$DEST/megatron-core-0.19.2.tmp"
  mv "$DEST/megatron-core-0.19.2.tmp" "$DEST/megatron-core-0.19.2"
fi
if [ ! -f "$DEST/vllm-0.33.0/vllm/distributed/weight_transfer/base.py" ] \
   || [ ! -f "$DEST/vllm-0.33.0/vllm/model_executor/layers/quantization/__init__.py" ]; then
  # about 340 MB once; only a handful of .py files are kept
  "$PY" -m pip download -q vllm==0.33.0 --no-deps --only-binary=:all: -d "$DEST/wheels"
  "$PY" - "$DEST" <<'PYEOF'
import glob, sys, zipfile
dest = sys.argv[1]
keep = ("vllm/distributed/weight_transfer/", "vllm/entrypoints/llm.py", "vllm/engine/arg_utils.py",
        "vllm/config/vllm.py", "vllm/outputs.py", "vllm/model_executor/layers/quantization/__init__.py")
with zipfile.ZipFile(glob.glob(f"{dest}/wheels/vllm-0.33.0-*.whl")[0]) as wheel:
    for name in wheel.namelist():
        if name.endswith(".py") and name.startswith(keep):
            wheel.extract(name, f"{dest}/vllm-0.33.0")
PYEOF
  rm -f "$DEST"/wheels/vllm-0.33.0-*.whl  # the extracted files are all that is read
fi
echo "GPU pins in $DEST: megatron-core-0.19.2 vllm-0.33.0"
