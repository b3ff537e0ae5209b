"""Where the GPU image's pinned releases, fetched by ci/fetch_gpu_pins.sh, live for the CPU tests that check
against them (megatron-core 0.19.2 unpacked; vLLM 0.33.0's pure-Python files). A test skips, saying how to
fetch them, only when they are absent."""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PINS = Path(os.environ.get("NRC_GPU_PINS", REPO / ".cache" / "gpu-pins"))
FETCH = "run `bash ci/fetch_gpu_pins.sh` (or set NRC_GPU_PINS to where it put them)"


def mcore019_dir() -> Path:
    """The unpacked megatron-core 0.19.2 wheel (a directory to put on PYTHONPATH), or skip."""
    path = PINS / "megatron-core-0.19.2"
    if not (path / "megatron" / "core").is_dir():
        pytest.skip(f"megatron-core 0.19.2 (the GPU image's pin) is not fetched in {path}: {FETCH}")
    return path


def vllm033_file(relative: str) -> Path:
    """One pure-Python file of vLLM 0.33.0 (e.g. "vllm/distributed/weight_transfer/base.py"), or skip."""
    path = PINS / "vllm-0.33.0" / relative
    if not path.is_file():
        pytest.skip(f"vLLM 0.33.0's {relative} (the GPU image's pin) is not fetched in {path.parent}: {FETCH}")
    return path


def load_vllm033_weight_transfer_base(monkeypatch: pytest.MonkeyPatch) -> Any:
    """vLLM 0.33.0's `vllm/distributed/weight_transfer/base.py`, imported alone (no CUDA, no vLLM install).

    Its two vLLM imports (`ParallelConfig`, `WeightTransferConfig`) are used in annotations only; they are
    stood in for by empty classes for the duration of the test (monkeypatch restores sys.modules).
    """
    path = vllm033_file("vllm/distributed/weight_transfer/base.py")
    for module, cls in (("vllm.config.parallel", "ParallelConfig"), ("vllm.config.weight_transfer",
                                                                    "WeightTransferConfig")):
        stub = types.ModuleType(module)
        setattr(stub, cls, type(cls, (), {}))
        monkeypatch.setitem(sys.modules, module, stub)
    name = "nrc_vllm033_weight_transfer_base"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module
