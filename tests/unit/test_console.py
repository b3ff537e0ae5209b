"""trainer/console.py: library output (this process and its children) lands in the log file, redacted; our
lines reach the terminal; the per-step line carries the ETA; the summary says where everything is."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from nemo_rollout_correction.config.redaction import REDACTED
from nemo_rollout_correction.trainer.console import Console, RunSummary, StepProgress


def test_capture_sends_child_and_own_output_to_the_log_redacted(tmp_path: Path) -> None:
    terminal = io.StringIO()
    console = Console(stream=terminal, secrets={"s3cr3t-value"})
    log = tmp_path / "run" / "nrc.log"
    console.capture_library_output(log)
    try:
        # fd-level writes, as C extensions and (outside pytest, whose capture replaces sys.stdout) print() do
        os.write(1, b"own stdout line s3cr3t-value\n")
        os.write(2, b"own stderr line\n")
        subprocess.run([sys.executable, "-c", "import sys; print('child warning s3cr3t-value', file=sys.stderr)"],
                       check=True)
        console.print("our progress s3cr3t-value")
    finally:
        console.close()
    text = log.read_text()
    assert f"own stdout line {REDACTED}" in text and "own stderr line" in text
    assert f"child warning {REDACTED}" in text
    assert "s3cr3t-value" not in text
    assert "our progress" not in text  # ours goes to the terminal, not the library log
    # After close, fds 1/2 are restored: this line does not reach the log.
    os.write(2, b"after close\n")
    assert "after close" not in log.read_text()


def test_step_line_has_the_headline_and_eta() -> None:
    out = io.StringIO()
    progress = StepProgress(total=4, start=0, console=Console(stream=out))
    progress.update(1, {"reward/mean": -0.5, "rollout_corr/kl": -3e-3, "rollout_corr/k3_kl": 2e-3,
                        "rollout_corr/kept_token_fraction": 1.0})
    line = out.getvalue()
    assert line.startswith("step 1/4  reward -0.500") and "k3 kl 2.00e-03" in line and "eta " in line
    assert "-3.00e-03" not in line  # the signed k1 estimate is not the headline
    assert progress.eta_seconds(1) >= 0


def test_summary_names_reward_trend_mismatch_and_where_things_are() -> None:
    history = [{"reward/mean": -0.9, "rollout_corr/kl": 1e-3, "rollout_corr/k3_kl": 2e-3,
                "rollout_corr/kept_token_fraction": 1.0},
               {"reward/mean": -0.4, "rollout_corr/kl": 3e-3, "rollout_corr/k3_kl": 4e-3,
                "rollout_corr/kept_token_fraction": 0.5}]
    lines = "\n".join(RunSummary.from_history(
        history, output_dir="runs/x", checkpoint_dir="runs/x/checkpoints", log_path="runs/x/nrc.log",
        mlflow_run_id="abc", tracking_uri="sqlite:///runs/x/mlflow.db").lines())
    assert "-0.900 -> -0.400" in lines and "mean kl 2.00e-03 (k3 3.00e-03)" in lines and "kept fraction 0.750" in lines
    assert "mlflow ui --backend-store-uri sqlite:///runs/x/mlflow.db" in lines and "runs/x/checkpoints" in lines
