"""The optimizer / schedule / mini-batch keys: ranges, cross-field rules and what they resolve to."""

from __future__ import annotations

import pytest

from nemo_rollout_correction.config.schema import (
    ConfigError,
    GRPOConfig,
    PolicyConfig,
    RunConfig,
    TaskConfig,
    TrainConfig,
)
from nemo_rollout_correction.models.optimizer import LR_DECAY_STYLES


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"lr_warmup_steps": -1}, "policy.lr_warmup_steps=-1"),
    ({"lr": 1e-4, "min_lr": 2e-4}, "policy.min_lr=0.0002"),
    ({"min_lr": -1.0}, "policy.min_lr=-1.0"),
])
def test_policy_schedule_errors_name_the_key(kwargs: dict[str, float], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        PolicyConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["num_mini_batches", "ppo_epochs"])
def test_updates_per_step_must_be_positive(key: str) -> None:
    with pytest.raises(ConfigError, match=f"grpo.{key}=0"):
        GRPOConfig(**{key: 0})  # type: ignore[arg-type]


def test_mini_batches_must_split_into_whole_microbatches_per_rank() -> None:
    # 4 prompts x 4 samples = 16 rollouts; micro 4 x DP 1 x 2 mini-batches = 8 divides, 8 x 2 = 16 divides too
    TrainConfig(policy=PolicyConfig(micro_batch_size=4), grpo=GRPOConfig(num_mini_batches=2))
    with pytest.raises(ConfigError, match=r"grpo\.num_mini_batches"):
        TrainConfig(policy=PolicyConfig(micro_batch_size=4), grpo=GRPOConfig(num_mini_batches=3))


def test_total_optimizer_updates_and_decay_styles() -> None:
    cfg = TrainConfig(run=RunConfig(num_steps=5), task=TaskConfig(prompts_per_step=4),
                      policy=PolicyConfig(micro_batch_size=2), grpo=GRPOConfig(num_mini_batches=2, ppo_epochs=3))
    assert cfg.total_optimizer_updates == 5 * 2 * 3
    assert set(LR_DECAY_STYLES) == {"constant", "linear", "cosine"}
    assert PolicyConfig().use_distributed_optimizer is False and GRPOConfig().ppo_epochs == 1
