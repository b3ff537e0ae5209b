"""The real `nrc` CLI, run as a user runs it (a subprocess of the installed entry point)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _nrc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nemo_rollout_correction.cli", *args],
                          capture_output=True, text=True, timeout=300, check=False)


def test_demo_runs_every_preset_and_writes_finite_metrics(tmp_path: Path) -> None:
    out = tmp_path / "metrics.json"
    proc = _nrc("demo", "--batch", "16", "--seq", "64", "--vocab", "128", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())
    from nemo_rollout_correction import RolloutCorrectionConfig

    assert sorted(results) == RolloutCorrectionConfig.preset_names()
    for name, metrics in results.items():
        assert all(value == value and abs(value) != float("inf") for value in metrics.values()), name
        # The two injected NaN rollout logprobs are counted and kept out of the loss.
        assert metrics["rollout_corr/nonfinite_token_count"] == 2
    # The bf16 rollout engine really disagrees with the fp32 trainer.
    assert results["disabled"]["rollout_corr/k3_kl"] > 0
    assert "generated data, not a training run" in proc.stdout


def test_demo_rejects_unknown_preset_naming_valid_ones() -> None:
    proc = _nrc("demo", "--preset", "token_tsi")
    assert proc.returncode == 2
    assert "token_tsi" in proc.stderr and "token_tis" in proc.stderr


def test_demo_rejects_bad_sizes() -> None:
    proc = _nrc("demo", "--batch", "0")
    assert proc.returncode == 2
    assert "positive integer" in proc.stderr


def test_presets_lists_every_preset() -> None:
    proc = _nrc("presets")
    assert proc.returncode == 0
    from nemo_rollout_correction import RolloutCorrectionConfig

    listed = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    assert listed == RolloutCorrectionConfig.preset_names()


def test_audit_reports_a_failure_through_the_console(tmp_path: Path) -> None:
    # A checkpoint path that does not exist fails inside the audit, after the runtime started; the message
    # goes through the trainer's console (stderr, redacted) and the exit status is 1.
    missing = tmp_path / "no_such_checkpoint"
    proc = _nrc("audit", f"model.source={missing}", f"run.output_dir={tmp_path / 'run'}")
    assert proc.returncode == 1, proc.stderr
    assert "nrc audit: failed:" in proc.stderr and "no_such_checkpoint" in proc.stderr
    assert "Traceback" not in proc.stderr
