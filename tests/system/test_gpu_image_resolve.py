"""The GPU image's install steps without a GPU: pip's resolver on its pins for its platform (ci/resolve_gpu_pins.sh).

The image (containers/Dockerfile) cannot be built here (no GPU, no NGC registry), so `containers/install.sh gpu
deps` is checked as far as it can be: the resolver, asked for the wheels a Python 3.12 manylinux x86_64 machine
would install, must find one consistent set that keeps every pin of containers/requirements-gpu.txt, together with
Transformer Engine's CUDA 13 wheels, and the torch extension's source release must be served. It talks to the
package index (about a minute), hence the system lane; it needs no root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from system_support import ROOT

pytestmark = [pytest.mark.system, pytest.mark.timeout(900)]


def test_gpu_pins_resolve_for_the_gpu_images_python_and_platform(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    proc = subprocess.run(["bash", str(ROOT / "ci" / "resolve_gpu_pins.sh"), str(report)], capture_output=True,
                          text=True, timeout=800, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout)
    chosen = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
              for item in json.loads(report.read_text())["install"]}
    assert chosen["vllm"] == "0.33.0" and chosen["torch"] == "2.14.0" and chosen["megatron-core"] == "0.19.2"
    assert chosen["transformer-engine"] == chosen["transformer-engine-cu13"] == "2.20.2"
    assert any(name.startswith("nvidia-nccl") for name in chosen)  # CUDA wheels: the GPU build of torch
    assert "resolve_gpu_pins: OK" in proc.stdout
