#!/usr/bin/env bash
# Builds .venv-bench (repo root): this package + verl 0.9.1 side by side, for
# benchmarks/bench_correction.py. torch stays pinned to the local CPU build (torch==2.13.0 via
# ci/constraints.txt) in EVERY install, so nothing can pull a multi-GB CUDA torch.
#
# verl is installed with --no-deps (its declared deps include ray[default], wandb, datasets,
# peft, accelerate, torchdata, ... and extras that pin torch 2.11 CUDA). Only the packages that
# `from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask`
# really imports are added, found by trying the import; nothing is stubbed. Version ranges follow
# verl 0.9.1's own Requires-Dist where it declares one.
#
#   bash benchmarks/setup_bench_env.sh            # create or update .venv-bench
#   VERL_WHEEL=/path/verl-0.9.1-py3-none-any.whl bash benchmarks/setup_bench_env.sh   # offline wheel
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
VENV=.venv-bench
C=(-c ci/constraints.txt)

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV with $("$PY" --version) =="
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q)

"${PIP[@]}" --upgrade pip
echo "== torch==2.13.0 (local CPU build) =="
"${PIP[@]}" "${C[@]}" torch==2.13.0
echo "== nemo_rollout_correction (editable) =="
"${PIP[@]}" "${C[@]}" -e .
echo "== verl==0.9.1 --no-deps =="
"${PIP[@]}" "${C[@]}" --no-deps "${VERL_WHEEL:-verl==0.9.1}"
echo "== the packages verl's rollout_corr_helper imports =="
# Who needs what (all imported at module level on the import path of rollout_corr_helper):
#   packaging     verl/__init__.py
#   numpy         verl/protocol.py, verl/utils/*
#   ray           verl/protocol.py (`import ray`), verl/utils/ray_utils.py   (plain ray, no [default])
#   tensordict    verl/protocol.py
#   omegaconf     verl/trainer/config/*, verl/base_config.py
#   transformers  verl/utils/torch_functional.py (`from transformers import PreTrainedTokenizer`)
#   codetiming    verl/utils/profiler
#   orjson        verl/utils/tracking.py
"${PIP[@]}" "${C[@]}" \
  packaging \
  "numpy>=2.0.0" \
  "ray>=2.41.0" \
  "tensordict>=0.8.0,<=0.10.0,!=0.9.0" \
  omegaconf \
  "transformers>=5.5.3,<5.11,!=5.6.0" \
  codetiming \
  orjson

echo "== check =="
"$VENV/bin/python" - <<'PY'
import torch
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask  # noqa: F401
import importlib.metadata as md
assert torch.__version__.startswith("2.13.0"), torch.__version__
print("torch", torch.__version__, "| verl", md.version("verl"),
      "| tensordict", md.version("tensordict"), "| ray", md.version("ray"),
      "| transformers", md.version("transformers"))
PY
echo "ok: activate with 'source $VENV/bin/activate' and run 'python benchmarks/bench_correction.py'"
