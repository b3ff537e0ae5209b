"""DAPO's batch shaping: zero-variance group detection, the soft overlong penalty and overlong filtering.

Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (2025), sections 3.2-3.4:

- **dynamic sampling**: a group whose rewards are all equal has zero advantage under GRPO and adds no
  gradient, only tokens to the denominator; DAPO drops such groups and samples more prompts.
  :func:`zero_variance_groups` finds them (exact equality, DAPO's ``std == 0``).
- **soft overlong punishment**: with ``L_max`` the response budget and ``L_cache`` the buffer, a
  response of ``L`` tokens gets ``0`` for ``L <= L_max - L_cache``, ``(L_max - L_cache - L) / L_cache`` in
  between (linear, down to ``-1`` at ``L = L_max``) and ``-1`` beyond, scaled by a factor and added to
  its reward: :func:`overlong_penalty`.
- **overlong filtering**: truncated responses leave the loss (their loss_mask row is cleared), because
  a reward for a cut-off answer is noise: :func:`overlong_filter_mask`.

Pure torch, no distributed code: the trainer applies these to the step's whole batch, identical on
every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["DapoConfig", "overlong_filter_mask", "overlong_penalty", "zero_variance_groups"]


def _key(default: Any, help: str) -> Any:
    """A field with its default and its one-line help (docs/configuration.md is generated from it)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class DapoConfig:
    """DAPO's keys of the `grpo` section, each written once, here: the config schema's `GRPOConfig` extends this
    class, the trainer's dynamic sampling (trainer/dynamic_sampling.py) reads it. Checked on construction; an
    error names the `grpo.<key>`."""

    dynamic_sampling: bool = _key(False, "Drop prompt groups whose rewards are all equal (no advantage) and refill "
                                  "the batch from further prompts (DAPO; docs/training.md).")
    max_refill_batches: int = _key(2, "dynamic_sampling: extra prompt batches a step may generate to refill; then "
                                   "zero-variance groups fill the rest (all zero-variance: the update is skipped).")
    overlong_filter: bool = _key(False, "Remove truncated responses (finish_reason=length) from the loss (DAPO "
                                 "overlong filtering; docs/training.md).")
    overlong_penalty: bool = _key(False, "Add DAPO's soft overlong penalty to the reward: 0 up to "
                                  "rollout.max_new_tokens - overlong_buffer_len tokens, then linear down to "
                                  "-overlong_penalty_factor (docs/training.md).")
    overlong_buffer_len: int = _key(16, "overlong_penalty: length of the soft-penalty region in tokens "
                                    "(<= rollout.max_new_tokens).")
    overlong_penalty_factor: float = _key(1.0, "overlong_penalty: the penalty at rollout.max_new_tokens tokens "
                                          "(DAPO: 1.0).")

    def __post_init__(self) -> None:
        if not self.max_refill_batches >= 0:
            raise ValueError(f"grpo.max_refill_batches={self.max_refill_batches!r} is not allowed: must be >= 0")
        if not self.overlong_buffer_len >= 1:
            raise ValueError(f"grpo.overlong_buffer_len={self.overlong_buffer_len!r} is not allowed: must be >= 1")
        if not (math.isfinite(self.overlong_penalty_factor) and self.overlong_penalty_factor >= 0):
            raise ValueError(f"grpo.overlong_penalty_factor={self.overlong_penalty_factor!r} is not allowed: "
                             "must be a finite number >= 0")


def zero_variance_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Which groups have all-equal rewards.

    Args:
        rewards: ``[num_samples]`` rewards, groups as consecutive runs of ``group_size`` samples.
        group_size: samples per group (the GRPO group size), >= 1.

    Returns:
        ``[num_groups]`` bool, True where every reward of the group equals the others (a group of one
        always counts as zero-variance: it has no baseline).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [num_samples], got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.numel() % group_size:
        raise ValueError(f"num_samples = {rewards.numel()} is not divisible by group_size = {group_size}")
    groups = rewards.reshape(-1, group_size)
    # max == min, not std < tol: the exact test, and a NaN reward (never equal) cannot hide a group
    result: Tensor = groups.amax(dim=1) == groups.amin(dim=1)
    return result


def overlong_penalty(response_lengths: Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong penalty per response, ``<= 0``.

    ``factor * clamp((max_len - buffer_len - L) / buffer_len, -1, 0)`` for a response of ``L`` tokens:
    0 up to ``max_len - buffer_len`` tokens, then linear down to ``-factor`` at ``max_len``, and
    ``-factor`` beyond.

    Args:
        response_lengths: ``[batch]`` generated tokens per response (integer or float).
        max_len: the response budget ``L_max`` (``rollout.max_new_tokens``), >= 1.
        buffer_len: the soft region ``L_cache``, in ``[1, max_len]``.
        factor: the penalty at ``max_len`` (DAPO: 1.0), >= 0.

    Returns:
        ``[batch]`` float32 penalties, to add to the rewards.
    """
    if response_lengths.dim() != 1:
        raise ValueError(f"response_lengths must be [batch], got shape {tuple(response_lengths.shape)}")
    if max_len < 1 or not 1 <= buffer_len <= max_len:
        raise ValueError(f"need max_len >= 1 and 1 <= buffer_len <= max_len, got max_len={max_len}, "
                         f"buffer_len={buffer_len}")
    if not factor >= 0:
        raise ValueError(f"factor must be >= 0, got {factor}")
    lengths = response_lengths.to(torch.float32)
    exceed = lengths - float(max_len - buffer_len)
    return (-exceed / float(buffer_len)).clamp(min=-1.0, max=0.0) * float(factor)


def overlong_filter_mask(loss_mask: Tensor, truncated: Tensor) -> Tensor:
    """``loss_mask`` with the rows of truncated responses cleared.

    Args:
        loss_mask: ``[batch, seq]`` bool (or 0/1) trainable response tokens.
        truncated: ``[batch]`` bool, True for a response cut at the length budget (vLLM's
            ``finish_reason == "length"``).

    Returns:
        ``[batch, seq]`` bool mask; a truncated row is all False (the row stays in the batch, so group
        advantages and shapes are unchanged; only its tokens leave the loss and its denominator).
    """
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [batch, seq], got shape {tuple(loss_mask.shape)}")
    if truncated.shape != (loss_mask.shape[0],):
        raise ValueError(f"truncated must be [batch] = ({loss_mask.shape[0]},), got shape {tuple(truncated.shape)}")
    keep = loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0
    return keep & ~truncated.to(torch.bool).unsqueeze(-1)
