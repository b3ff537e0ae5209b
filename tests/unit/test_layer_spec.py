"""The Megatron-Core layer spec: the arguments `build_gpt_model` passes bind against every megatron-core release
this project ships (0.16.1 installed, 0.19.2 the GPU image's pin), and the choice is logged with its reason,
never silently (an installed Transformer Engine that fails to import is named)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from default_lane import require

require("megatron.core", "megatron")

import layer_spec_probe
from gpu_pins import REPO, mcore019_dir

from nemo_rollout_correction.models import hf_llama

EXPECTED = {f"{arch}/{spec}": f"ok: {fn}" for arch in layer_spec_probe.ARCHES
            for spec, fn in layer_spec_probe.SPEC_FUNCTIONS.items()}


def test_spec_arguments_bind_against_megatron_core_0_16_1(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="nemo_rollout_correction.models"):
        results = layer_spec_probe.probe()
    assert results.pop("megatron_core") == "0.16.1"
    assert results == EXPECTED
    messages = [r.getMessage() for r in caplog.records]
    assert any("layer spec: local (requested" in m for m in messages)
    assert any("layer spec: transformer_engine (requested" in m for m in messages)


def test_spec_arguments_bind_against_megatron_core_0_19_2() -> None:
    site = mcore019_dir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO), str(Path(__file__).parent)])}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("layer_spec_probe.py"))], env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    # 0.19.2 adds "+<commit>" of the git checkout it is unpacked in (.cache/gpu-pins sits in this repository)
    assert results.pop("megatron_core").split("+")[0] == "0.19.2"
    assert results == EXPECTED


def test_automatic_choice_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    choice = hf_llama.choose_layer_spec()
    assert (choice.name, "CUDA is not available" in choice.reason) == ("local", True)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # not installed
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    choice = hf_llama.choose_layer_spec()
    assert choice.name == "local" and "not installed" in choice.reason

    # installed but broken (what a CUDA/driver mismatch looks like): named, not swallowed
    monkeypatch.delitem(sys.modules, "transformer_engine")
    monkeypatch.delitem(sys.modules, "transformer_engine.pytorch")
    package = tmp_path / "transformer_engine"
    package.mkdir()
    (package / "__init__.py").write_text("raise OSError('libcuda.so.1: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    choice = hf_llama.choose_layer_spec()
    assert choice.name == "local"
    assert "installed but failed to import: OSError: libcuda.so.1" in choice.reason
    assert hf_llama.transformer_engine_available() is False
