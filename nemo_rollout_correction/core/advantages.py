"""GRPO group-normalised advantages and their per-token broadcast.

GRPO samples several responses per prompt (a group) and scores each response against its group:
``A_i = (r_i - mean_g) / (std_g + eps)``. The std is the unbiased sample std (divide by n - 1), as
``torch.std`` in verl. A group of one has no baseline to compare with, so its advantage is 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["broadcast_to_tokens", "grpo_advantages"]


def grpo_advantages(
    rewards: Tensor,
    group_size: int | None = None,
    group_ids: Tensor | None = None,
    *,
    normalize_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Group-normalised advantages, one per sample.

    Args:
        rewards: ``[num_samples]`` scalar reward per response; must be finite.
        group_size: groups are consecutive runs of this many samples (rows ``k*g .. k*g + g - 1``).
        group_ids: ``[num_samples]`` integer group id per sample; groups need not be contiguous.
            Give exactly one of ``group_size`` and ``group_ids``.
        normalize_by_std: divide by ``std + eps`` (GRPO); ``False`` only subtracts the mean
            (Dr. GRPO).
        eps: added to the std so a group whose rewards are all equal gets 0, not 0/0; must be > 0.

    Returns:
        ``[num_samples]`` advantages, in ``rewards``' dtype (float32 for integer rewards), detached.
    """
    rewards = _check_rewards(rewards)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    inverse = _group_index(rewards.shape[0], group_size, group_ids, rewards.device)
    num_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0

    num_in_group = _group_sum(torch.ones_like(rewards), inverse, num_groups)  # [num_groups]
    group_mean = _group_sum(rewards, inverse, num_groups) / num_in_group.clamp(min=1)
    deviation = rewards - group_mean[inverse]
    # A group of one is its own mean, so its deviation is exactly 0 and so is its advantage
    # (verl instead returns the raw reward for such a group).
    if not normalize_by_std:
        return deviation.detach()
    squared = _group_sum(deviation.square(), inverse, num_groups)
    # Unbiased variance; the clamp only guards groups of one, whose deviation is 0 anyway.
    group_std = torch.sqrt(squared / (num_in_group - 1).clamp(min=1))
    return (deviation / (group_std[inverse] + eps)).detach()


def broadcast_to_tokens(advantages: Tensor, mask: Tensor) -> Tensor:
    """Give every kept token of a response its sequence's advantage.

    Args:
        advantages: ``[batch]`` one advantage per sequence.
        mask: ``[batch, seq]`` keep mask.

    Returns:
        ``[batch, seq]`` advantages at kept tokens, 0 elsewhere.
    """
    if advantages.dim() != 1:
        raise ValueError(f"advantages must be [batch], got shape {tuple(advantages.shape)}")
    if mask.dim() != 2 or mask.shape[0] != advantages.shape[0]:
        raise ValueError(
            f"mask must be [batch, seq] with batch = {advantages.shape[0]}, got shape {tuple(mask.shape)}"
        )
    keep = mask if mask.dtype == torch.bool else mask != 0
    per_token = advantages.unsqueeze(-1).expand(mask.shape)
    return torch.where(keep, per_token, torch.zeros_like(per_token))


def _check_rewards(rewards: Tensor) -> Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [num_samples], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    bad = (~torch.isfinite(rewards)).nonzero()
    if bad.numel():
        index = int(bad[0].item())
        raise ValueError(
            f"rewards must be finite; rewards[{index}] = {rewards[index].item()} "
            f"({bad.numel()} non-finite in total)"
        )
    return rewards


def _group_index(
    num_samples: int, group_size: int | None, group_ids: Tensor | None, device: torch.device
) -> Tensor:
    """Dense group index in ``[0, num_groups)`` for each sample."""
    if (group_size is None) == (group_ids is None):
        raise ValueError("give exactly one of group_size and group_ids")
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        if num_samples % group_size:
            raise ValueError(f"num_samples = {num_samples} is not divisible by group_size = {group_size}")
        return torch.arange(num_samples, device=device) // group_size
    assert group_ids is not None  # narrowed by the exactly-one check above
    if group_ids.shape != (num_samples,):
        raise ValueError(
            f"group_ids must be [num_samples] = ({num_samples},), got shape {tuple(group_ids.shape)}"
        )
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    # unique() maps arbitrary ids (e.g. prompt hashes) onto 0..num_groups-1.
    inverse: Tensor = torch.unique(group_ids, return_inverse=True)[1]
    return inverse.to(device)


def _group_sum(values: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, inverse, values)
