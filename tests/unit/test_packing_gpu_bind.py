"""The packed-sequence path's Megatron calls bind against megatron-core 0.16.1 (installed) and the GPU image's
0.19.2 (`packing_probe`); the GPU run of Transformer Engine's THD attention itself is unverified (docs/deployment.md,
"GPU status")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from default_lane import require

require("megatron.core", "megatron")

import packing_probe
from gpu_pins import REPO, mcore019_dir

CHECKS = ("packed_seq_params", "packed_seq_fields", "gpt_forward", "te_thd_padding_causal", "rope_thd")


def test_packing_binds_against_megatron_core_0_16_1() -> None:
    results = packing_probe.probe()
    assert results.pop("megatron_core") == "0.16.1"
    assert results == dict.fromkeys(CHECKS, "ok")


def test_packing_binds_against_megatron_core_0_19_2() -> None:
    site = mcore019_dir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO), str(Path(__file__).parent)])}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("packing_probe.py"))], env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results.pop("megatron_core").split("+")[0] == "0.19.2"
    assert results == dict.fromkeys(CHECKS, "ok")
