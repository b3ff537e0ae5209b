"""trainer/console.py: library output (this process and its children) lands in the log file, redacted; our
lines reach the terminal; the per-step line carries the ETA; the summary says where everything is."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_close_returns_at_once_while_a_child_still_holds_the_pipe(tmp_path: Path) -> None:
    # multiprocessing's resource tracker (and any spawned worker) inherits fds 1 and 2 and outlives `close`: the
    # copier sees no EOF then. `close` still returns as soon as this process's output is in the log (it waited
    # 10 s for the EOF before, at the end of every `nrc train`), and a child's unfinished line is kept.
    import time

    console = Console(stream=io.StringIO())
    log = tmp_path / "nrc.log"
    ready = tmp_path / "ready"
    console.capture_library_output(log)
    os.write(1, b"own line before close\n")
    holder = subprocess.Popen([sys.executable, "-c", "import pathlib, sys, time; sys.stderr.write('unfinished'); "
                               f"sys.stderr.flush(); pathlib.Path({str(ready)!r}).touch(); time.sleep(120)"])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert holder.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        started = time.monotonic()
        console.close()
        assert time.monotonic() - started < 8.0  # (the EOF wait it replaces took its 10 s timeout)
    finally:
        holder.kill()
        holder.wait()
    lines = log.read_text().splitlines()
    assert "own line before close" in lines and "unfinished" in lines
    assert not any("nrc-console-close" in line or "\0" in line for line in lines)


# keys every step emits besides reward/mean (harness/metric_names.py), as the step line reads them
_EVERY_STEP = {"response/length_mean": 12.0, "timing/generation_s": 1.5, "timing/train_s": 2.5}


def test_step_line_has_the_headline_and_eta() -> None:
    out = io.StringIO()
    progress = StepProgress(total=4, start=0, console=Console(stream=out))
    progress.update(1, {"reward/mean": -0.5, "rollout_corr/kl": -3e-3, "rollout_corr/k3_kl": 2e-3,
                        "rollout_corr/kept_token_fraction": 1.0, **_EVERY_STEP})
    line = out.getvalue()
    assert line.startswith("step 1/4  reward -0.500") and "k3 kl 2.00e-03" in line and "eta " in line
    assert "-3.00e-03" not in line  # the signed k1 estimate is not the headline
    assert progress.eta_seconds(1) >= 0


def test_step_line_refuses_a_step_without_its_always_emitted_keys() -> None:
    # Keys every step emits are read without a default: a renamed or missing key raises instead of printing 0.
    progress = StepProgress(total=4, start=0, console=Console(stream=io.StringIO()))
    with pytest.raises(KeyError, match="response/length_mean"):
        progress.update(1, {"reward/mean": -0.5, "timing/generation_s": 1.0, "timing/train_s": 2.0})
    # A DAPO-skipped step has no loss or rollout_corr/* keys: they print as nan.
    out = io.StringIO()
    StepProgress(total=4, start=0, console=Console(stream=out)).update(1, {"reward/mean": 0.0, **_EVERY_STEP})
    assert "loss +nan" in out.getvalue() and "k3 kl nan" in out.getvalue()


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
