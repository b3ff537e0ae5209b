#!/usr/bin/env bash
# The README's main-job command. Until the GRPO trainer lands (issue 5) the main job is
# `nrc demo`: every preset of the rollout-correction API applied to generated rollout/trainer
# logprobs with a realistic bf16-vs-fp32 mismatch. Extra arguments go to `nrc demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/_venv.sh
ensure_venv config
nrc demo "$@"
