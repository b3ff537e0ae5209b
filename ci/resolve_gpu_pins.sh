#!/usr/bin/env bash
# Resolve the GPU image's pins (containers/requirements-gpu.txt and requirements-gpu-te.txt) for that image's
# platform, without a GPU and without installing anything: pip's resolver in --dry-run mode, asked for the
# wheels a Python 3.12 manylinux x86_64 machine (the NGC PyTorch base: Ubuntu 24.04, glibc 2.39) would install.
# It proves that `containers/install.sh gpu deps` finds a consistent set on PyPI (vLLM 0.33.0's torch 2.14.0,
# Megatron-Core 0.19.2, Transformer Engine 2.20.2 for CUDA 13, ...) and writes pip's JSON report.
#
#   bash ci/resolve_gpu_pins.sh [REPORT]     # default REPORT: .cache/gpu-resolve/report.json
#
# What it cannot check here: transformer-engine-torch (Transformer Engine's torch extension, the `pytorch`
# extra) is a source distribution whose metadata step needs CUDA, so the resolver takes
# `transformer-engine[core_cu13]` (binary) and the script only checks that transformer-engine-torch's pinned
# version is served. Source-only pure-Python dependencies (antlr4-python3-runtime 4.9.3, Hydra's parser
# runtime) are built into wheels first, since a resolver for another platform accepts wheels only.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
report="${1:-.cache/gpu-resolve/report.json}"
work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT
mkdir -p "$(dirname "${report}")"

te_line="$(grep -v '^[[:space:]]*#' containers/requirements-gpu-te.txt | grep -m1 'transformer-engine')"
te_version="${te_line##*==}"
te_extras="${te_line#*[}"; te_extras="${te_extras%%]*}"
[[ ",${te_extras}," == *,pytorch,* ]] || { echo "resolve_gpu_pins: ${te_line} has no pytorch extra" >&2; exit 1; }
te_binary_extras="$(tr ',' '\n' <<< "${te_extras}" | grep -v '^pytorch$' | paste -sd, -)"

# Pure-Python dependencies published only as source: wheels built here (platform-independent, py3-none-any).
"${PY}" -m pip wheel -q --no-deps -w "${work}/wheels" antlr4-python3-runtime==4.9.3

platforms=()
for glibc in $(seq 17 39); do platforms+=(--platform "manylinux_2_${glibc}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64)
# A constraint file of this machine (PIP_CONSTRAINT, pip.conf) pins its own environment, not the image's.
PIP_CONSTRAINT="" "${PY}" -m pip install --dry-run --ignore-installed --quiet --report "${report}" \
  --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  "${platforms[@]}" --find-links "${work}/wheels" \
  -r containers/requirements-gpu.txt "transformer-engine[${te_binary_extras}]==${te_version}"

"${PY}" - "${report}" <<'PYEOF'
import json
import re
import sys
from pathlib import Path

from packaging.utils import canonicalize_name

report = json.loads(Path(sys.argv[1]).read_text())
chosen = {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"] for item in report["install"]}
pins = {}
for line in Path("containers/requirements-gpu.txt").read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if line:
        name, version = re.split(r"\s*==\s*", line)
        pins[canonicalize_name(name)] = version
wrong = {name: (version, chosen.get(name)) for name, version in pins.items() if chosen.get(name) != version}
if wrong:
    sys.exit(f"resolve_gpu_pins: the resolver chose other versions than the pins (pin, chosen): {wrong}")
cuda = sorted(name for name in chosen if name.startswith("nvidia-"))
print(f"resolve_gpu_pins: {len(chosen)} distributions for cp312 manylinux x86_64; pins kept: "
      + ", ".join(f"{name}=={version}" for name, version in sorted(pins.items())))
print(f"resolve_gpu_pins: torch {chosen['torch']}, torchvision {chosen.get('torchvision')}, "
      f"transformer-engine {chosen.get('transformer-engine')} + {chosen.get('transformer-engine-cu13')} (cu13), "
      f"{len(cuda)} nvidia-* wheels, e.g. nccl {chosen.get('nvidia-nccl-cu13')}, cudnn {chosen.get('nvidia-cudnn-cu13')}")
PYEOF

# The source-only torch extension: is the pinned version served? (Its build needs CUDA: only in the image.)
served="$("${PY}" -m pip index versions transformer-engine-torch 2>/dev/null | sed -n 's/^Available versions: //p')"
[[ ", ${served}," == *", ${te_version},"* ]] \
  || { echo "resolve_gpu_pins: transformer-engine-torch ${te_version} is not served (${served})" >&2; exit 1; }
echo "resolve_gpu_pins: transformer-engine-torch ${te_version} is served (source distribution; builds with CUDA only)"
echo "resolve_gpu_pins: OK (report: ${report})"
