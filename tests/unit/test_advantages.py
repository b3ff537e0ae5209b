"""GRPO group-normalised advantages and their per-token broadcast."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_rollout_correction.core.advantages import broadcast_to_tokens, grpo_advantages

F64 = torch.float64
EPS = 1e-6


def test_contiguous_groups_by_hand() -> None:
    # Group 0: [1, 2, 3], mean 2, sample std sqrt(((-1)^2 + 0 + 1^2) / 2) = 1.
    # Group 1: [0, 0, 0], std 0 -> 0 / (0 + eps) = 0.
    rewards = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 0.0], dtype=F64)
    advantages = grpo_advantages(rewards, group_size=3, eps=EPS)
    expected = torch.tensor([-1 / (1 + EPS), 0.0, 1 / (1 + EPS), 0.0, 0.0, 0.0], dtype=F64)
    torch.testing.assert_close(advantages, expected)


def test_sample_std_not_population_std() -> None:
    # [0, 1]: mean 0.5; sample std = sqrt(0.5) (population std would be 0.5).
    advantages = grpo_advantages(torch.tensor([0.0, 1.0], dtype=F64), group_size=2, eps=EPS)
    expected = 0.5 / (math.sqrt(0.5) + EPS)
    torch.testing.assert_close(advantages, torch.tensor([-expected, expected], dtype=F64))


def test_interleaved_group_ids_by_hand() -> None:
    # ids 7 -> rewards {1, 3}: mean 2, std sqrt(2); ids -4 -> {5, 9}: mean 7, std sqrt(8).
    rewards = torch.tensor([1.0, 5.0, 3.0, 9.0], dtype=F64)
    group_ids = torch.tensor([7, -4, 7, -4])
    advantages = grpo_advantages(rewards, group_ids=group_ids, eps=EPS)
    a0 = 1 / (math.sqrt(2) + EPS)
    a1 = 2 / (math.sqrt(8) + EPS)
    torch.testing.assert_close(advantages, torch.tensor([-a0, -a1, a0, a1], dtype=F64))


def test_group_of_one_gets_zero_advantage() -> None:
    rewards = torch.tensor([1.0, 3.0, 10.0], dtype=F64)
    advantages = grpo_advantages(rewards, group_ids=torch.tensor([0, 0, 1]), eps=EPS)
    assert advantages[2].item() == 0.0
    assert grpo_advantages(torch.tensor([4.0]), group_size=1).item() == 0.0
    assert grpo_advantages(torch.tensor([4.0]), group_size=1, normalize_by_std=False).item() == 0.0


def test_mean_only_without_std() -> None:
    rewards = torch.tensor([1.0, 2.0, 6.0, 10.0, 20.0, 30.0], dtype=F64)
    advantages = grpo_advantages(rewards, group_size=3, normalize_by_std=False)
    torch.testing.assert_close(advantages, torch.tensor([-2.0, -1.0, 3.0, -10.0, 0.0, 10.0], dtype=F64))


def test_integer_rewards_become_float32_and_result_is_detached() -> None:
    advantages = grpo_advantages(torch.tensor([0, 1, 1, 0]), group_size=2)
    assert advantages.dtype == torch.float32
    with_grad = torch.tensor([0.0, 1.0], requires_grad=True)
    assert not grpo_advantages(with_grad, group_size=2).requires_grad


def test_empty_rewards() -> None:
    assert grpo_advantages(torch.zeros(0), group_size=4).shape == (0,)
    assert grpo_advantages(torch.zeros(0), group_ids=torch.zeros(0, dtype=torch.long)).shape == (0,)


def test_errors_are_clear() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0])
    with pytest.raises(ValueError, match="exactly one"):
        grpo_advantages(rewards)
    with pytest.raises(ValueError, match="exactly one"):
        grpo_advantages(rewards, group_size=2, group_ids=torch.tensor([0, 0, 1, 1]))
    with pytest.raises(ValueError, match="not divisible by group_size = 3"):
        grpo_advantages(rewards, group_size=3)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        grpo_advantages(rewards, group_size=0)
    with pytest.raises(ValueError, match=r"rewards\[2\] = nan"):
        grpo_advantages(torch.tensor([1.0, 2.0, float("nan"), float("inf")]), group_size=2)
    with pytest.raises(ValueError, match=r"rewards\[1\] = inf"):
        grpo_advantages(torch.tensor([1.0, float("inf")]), group_size=2)
    with pytest.raises(ValueError, match=r"\[num_samples\]"):
        grpo_advantages(rewards.reshape(2, 2), group_size=2)
    with pytest.raises(ValueError, match="group_ids must be"):
        grpo_advantages(rewards, group_ids=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="integer"):
        grpo_advantages(rewards, group_ids=torch.tensor([0.0, 0.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="eps must be > 0"):
        grpo_advantages(rewards, group_size=2, eps=0.0)


def test_broadcast_to_tokens_by_hand() -> None:
    advantages = torch.tensor([1.5, -2.0])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    expected = torch.tensor([[1.5, 1.5, 0.0], [-2.0, 0.0, 0.0]])
    torch.testing.assert_close(broadcast_to_tokens(advantages, mask), expected)
    torch.testing.assert_close(broadcast_to_tokens(advantages, mask.long()), expected)
    with pytest.raises(ValueError, match=r"\[batch\]"):
        broadcast_to_tokens(advantages.reshape(2, 1), mask)
    with pytest.raises(ValueError, match="batch = 2"):
        broadcast_to_tokens(advantages, mask[:1])


@settings(max_examples=60, deadline=None)
@given(
    rewards=st.lists(st.floats(min_value=-100.0, max_value=100.0), min_size=1, max_size=24),
    num_groups=st.integers(min_value=1, max_value=5),
    normalize_by_std=st.booleans(),
)
def test_each_group_has_zero_mean_and_bounded_advantages(
    rewards: list[float], num_groups: int, normalize_by_std: bool
) -> None:
    reward_tensor = torch.tensor(rewards, dtype=F64)
    group_ids = torch.arange(len(rewards)) % num_groups
    advantages = grpo_advantages(reward_tensor, group_ids=group_ids, normalize_by_std=normalize_by_std)
    assert torch.isfinite(advantages).all()
    for group in group_ids.unique():
        members = advantages[group_ids == group]
        assert abs(members.sum().item()) <= 1e-6 * max(1.0, members.abs().max().item()) * len(members)
        if normalize_by_std:
            # Deviations sum to 0, so |r_i - mean| <= (n - 1) / sqrt(n) * sample std in a group of n.
            n = len(members)
            assert (members.abs() <= (n - 1) / math.sqrt(n) + 1e-6).all()
