"""DAPO in the step's batch: zero-variance groups, refills from the sampler, the soft overlong penalty and the
overlong filter, each checked against values derived by hand."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from nemo_rollout_correction.config.schema import ConfigError, GRPOConfig, RolloutConfig, TrainConfig
from nemo_rollout_correction.core.advantages import grpo_advantages
from nemo_rollout_correction.core.dapo import overlong_filter_mask, overlong_penalty, zero_variance_groups
from nemo_rollout_correction.rollout.samples import RolloutBatch, RolloutSample
from nemo_rollout_correction.tasks.prompts import PromptRecord, PromptSampler
from nemo_rollout_correction.trainer.dynamic_sampling import (
    DapoOptions,
    apply_overlong_filter,
    collect_step_rollouts,
)

N = 4  # samples per prompt
MAX_LEN = 10


def _records(constant: Sequence[bool]) -> list[PromptRecord]:
    return [PromptRecord(f"prompt {i}", metadata={"i": i, "constant": c}) for i, c in enumerate(constant)]


class Rollouts:
    """A deterministic rollout phase: sample j of a prompt has 3 + 2 * j tokens (the last one hits MAX_LEN when
    j = 3 and is cut there); reward 1.0 for every sample of a 'constant' record, else j / N."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], int]] = []

    def __call__(self, records: list[PromptRecord], attempt: int) -> tuple[RolloutBatch, list[float]]:
        self.calls.append(([r.metadata["i"] for r in records], attempt))
        samples, rewards = [], []
        for p, record in enumerate(records):
            for j in range(N):
                length = min(3 + 2 * j + 1, MAX_LEN) if j == N - 1 else 3 + 2 * j
                samples.append(RolloutSample(p, [1, 2], list(range(length)), [-0.5] * length,
                                             "length" if length == MAX_LEN else "stop", f"r{record.metadata['i']}.{j}"))
                rewards.append(1.0 if record.metadata["constant"] else j / N)
        return RolloutBatch(samples, n=N, seconds=0.5), rewards


def test_zero_variance_groups_by_hand() -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5000001])
    assert zero_variance_groups(rewards, 3).tolist() == [True, False, False]
    assert zero_variance_groups(torch.tensor([2.0, 3.0]), 1).tolist() == [True, True]  # a group of one
    assert zero_variance_groups(torch.tensor([float("nan")] * 2), 2).tolist() == [False]  # NaN never hides
    with pytest.raises(ValueError, match="not divisible by group_size = 2"):
        zero_variance_groups(torch.zeros(3), 2)


def test_overlong_penalty_by_hand() -> None:
    # max_len 10, buffer 4: free up to 6 tokens, then -1/4 per token, -1 at 10, capped at -1 beyond
    lengths = torch.tensor([0, 5, 6, 7, 8, 9, 10, 12])
    assert overlong_penalty(lengths, 10, 4).tolist() == [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    assert overlong_penalty(lengths, 10, 4, factor=0.5).tolist() == [0.0, 0.0, 0.0, -0.125, -0.25, -0.375, -0.5, -0.5]
    assert overlong_penalty(torch.tensor([0, 1, 2]), 2, 2).tolist() == [0.0, -0.5, -1.0]  # buffer = the whole budget
    with pytest.raises(ValueError, match="1 <= buffer_len <= max_len"):
        overlong_penalty(lengths, 10, 11)


def test_overlong_filter_mask_by_hand() -> None:
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    out = overlong_filter_mask(mask, torch.tensor([False, True, False]))
    assert out.tolist() == [[False, True, True, False], [False] * 4, [True] * 4]
    assert overlong_filter_mask(mask.int(), torch.tensor([True, True, True])).sum() == 0


def test_refills_replace_constant_reward_groups_from_the_next_prompts() -> None:
    # File order, 2 prompts per step; records 0, 1, 2, 4 have a constant reward (zero variance).
    records = _records([True, True, True, False, True, False, False, False])
    sampler = PromptSampler(records, prompts_per_step=2, seed=0, shuffle=False)
    rollouts = Rollouts()
    options = DapoOptions(dynamic_sampling=True, max_refill_batches=3, max_new_tokens=MAX_LEN)
    result = collect_step_rollouts(sampler.next_batch(), sampler, rollouts, options)
    # [0, 1]: both filtered -> refill [2, 3]: 2 filtered, 3 kept -> refill [4, 5]: 4 filtered, 5 kept -> stop
    assert rollouts.calls == [([0, 1], 0), ([2, 3], 1), ([4, 5], 2)]
    assert [r.metadata["i"] for r in result.records] == [3, 5]
    assert result.metrics == {"grpo/filtered_group_fraction": 4 / 6, "grpo/refill_batches": 2.0,
                              "grpo/padded_group_fraction": 0.0, "grpo/update_skipped": 0.0}
    assert not result.skip_update and result.warning is None
    assert [s.prompt_index for s in result.batch.samples] == [0] * N + [1] * N  # indices into result.records
    assert [s.text for s in result.batch.samples][:2] == ["r3.0", "r3.1"] and result.batch.seconds == 1.5
    assert result.rewards == [0.0, 0.25, 0.5, 0.75] * 2 == result.task_rewards
    assert sampler.state_dict()["position"] == 6  # the refills came from the sampler: a checkpoint covers them


def test_refills_stop_at_the_limit_and_fill_with_zero_variance_groups() -> None:
    records = _records([True, True, True, False, True, False, False, False])
    sampler = PromptSampler(records, prompts_per_step=2, seed=0, shuffle=False)
    options = DapoOptions(dynamic_sampling=True, max_refill_batches=1, max_new_tokens=MAX_LEN)
    result = collect_step_rollouts(sampler.next_batch(), sampler, Rollouts(), options)
    # [0, 1] filtered, one refill [2, 3]: only 3 kept; the first set-aside group (record 0) fills the batch
    assert [r.metadata["i"] for r in result.records] == [3, 0]
    assert result.metrics["grpo/filtered_group_fraction"] == 3 / 4
    assert result.metrics["grpo/refill_batches"] == 1.0 and result.metrics["grpo/padded_group_fraction"] == 0.5
    assert not result.skip_update and "only 1 of 2 groups have reward variance" in (result.warning or "")
    advantages = grpo_advantages(torch.tensor(result.rewards), group_size=N)
    assert advantages[N:].abs().max() == 0  # the filler group carries no gradient


def test_an_all_filtered_batch_warns_and_skips_the_update_without_nan() -> None:
    records = _records([True] * 6)
    sampler = PromptSampler(records, prompts_per_step=2, seed=7)
    rollouts = Rollouts()
    options = DapoOptions(dynamic_sampling=True, max_refill_batches=2, max_new_tokens=MAX_LEN)
    first = sampler.next_batch()
    result = collect_step_rollouts(first, sampler, rollouts, options)
    assert len(rollouts.calls) == 3 and [a for _, a in rollouts.calls] == [0, 1, 2]
    assert result.skip_update and result.metrics["grpo/update_skipped"] == 1.0
    assert result.metrics["grpo/filtered_group_fraction"] == 1.0 and result.metrics["grpo/refill_batches"] == 2.0
    assert "all 6 groups of this step (3 batches" in (result.warning or "") and "update is skipped" in result.warning
    assert result.records == first and len(result.batch.samples) == 2 * N  # the batch keeps its shape
    advantages = grpo_advantages(torch.tensor(result.rewards), group_size=N)
    assert torch.isfinite(advantages).all() and advantages.abs().max() == 0


def test_refills_are_deterministic_with_the_sampler_so_resume_is_exact() -> None:
    constant = [i % 3 != 0 for i in range(30)]  # two in three records have a constant reward
    options = DapoOptions(dynamic_sampling=True, max_refill_batches=4, max_new_tokens=MAX_LEN)

    def run(sampler: PromptSampler, steps: int) -> list[tuple[list[int], float]]:
        out = []
        for _ in range(steps):
            result = collect_step_rollouts(sampler.next_batch(), sampler, Rollouts(), options)
            out.append(([r.metadata["i"] for r in result.records], result.metrics["grpo/padded_group_fraction"]))
        return out

    straight = run(PromptSampler(_records(constant), 3, seed=11), 4)
    first = PromptSampler(_records(constant), 3, seed=11)
    head = run(first, 2)
    resumed = PromptSampler(_records(constant), 3, seed=11)
    resumed.load_state_dict(first.state_dict())  # what a checkpoint after step 2 holds
    assert head + run(resumed, 2) == straight
    for ids, padded in straight:  # zero-variance groups appear only as the reported filler, after the others
        num_constant = sum(constant[i] for i in ids)
        assert num_constant == round(padded * 3) and all(not constant[i] for i in ids[: 3 - num_constant])


def test_overlong_penalty_shapes_rewards_before_the_filter() -> None:
    # Constant task reward, but samples 2 and 3 (7 and 10 tokens) fall in the soft region [6, 10]:
    # penalties 0, 0, -0.25, -1 -> the group now has variance and is kept.
    records = _records([True, False])
    sampler = PromptSampler(records, prompts_per_step=1, seed=0, shuffle=False)
    options = DapoOptions(dynamic_sampling=True, max_refill_batches=0, overlong_penalty=True,
                          overlong_buffer_len=4, max_new_tokens=MAX_LEN)
    result = collect_step_rollouts(sampler.next_batch(), sampler, Rollouts(), options)
    assert result.task_rewards == [1.0] * 4
    assert result.rewards == [1.0, 1.0, 0.75, 0.0]
    assert result.metrics["grpo/overlong_penalty_mean"] == pytest.approx(-1.25 / 4)
    assert result.metrics["grpo/filtered_group_fraction"] == 0.0


def test_without_dynamic_sampling_it_is_one_rollout_call() -> None:
    records = _records([True, False])
    sampler = PromptSampler(records, prompts_per_step=2, seed=0, shuffle=False)
    rollouts = Rollouts()
    result = collect_step_rollouts(sampler.next_batch(), sampler, rollouts, DapoOptions(max_new_tokens=MAX_LEN))
    assert rollouts.calls == [([0, 1], 0)] and result.metrics == {} and not result.skip_update
    assert result.rewards == [1.0] * 4 + [0.0, 0.25, 0.5, 0.75]


def test_overlong_filter_clears_the_truncated_rows_of_the_batch() -> None:
    records = _records([False])
    batch, _ = Rollouts()(records, 0)
    tensors = batch.to_tensors(pad_token_id=0)
    options = DapoOptions(overlong_filter=True, max_new_tokens=MAX_LEN)
    mask, metrics = apply_overlong_filter(tensors["loss_mask"], batch, options)
    # sample 3 (10 tokens) finished with "length": its row leaves the loss, the others are untouched
    assert mask.sum(-1).tolist() == [3, 5, 7, 0]
    assert metrics == {"grpo/overlong_filtered_fraction": 0.25}
    same, none = apply_overlong_filter(tensors["loss_mask"], batch, DapoOptions())
    assert torch.equal(same, tensors["loss_mask"]) and none == {}


def test_config_keys_are_validated_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"grpo.max_refill_batches=-1 is not allowed: must be >= 0"):
        GRPOConfig(max_refill_batches=-1)
    with pytest.raises(ConfigError, match=r"grpo.overlong_buffer_len=0 is not allowed"):
        GRPOConfig(overlong_buffer_len=0)
    with pytest.raises(ConfigError, match=r"grpo.overlong_penalty_factor=-0.5 is not allowed"):
        GRPOConfig(overlong_penalty_factor=-0.5)
    with pytest.raises(ConfigError, match=r"grpo.overlong_buffer_len=64 .*<= rollout.max_new_tokens \(48\)"):
        TrainConfig(grpo=GRPOConfig(overlong_penalty=True, overlong_buffer_len=64))
    cfg = TrainConfig(grpo=GRPOConfig(dynamic_sampling=True, overlong_penalty=True, overlong_buffer_len=8),
                      rollout=RolloutConfig(max_new_tokens=32))
    assert DapoOptions.from_config(cfg) == DapoOptions(dynamic_sampling=True, max_refill_batches=2,
                                                       overlong_penalty=True, overlong_buffer_len=8,
                                                       max_new_tokens=32)
