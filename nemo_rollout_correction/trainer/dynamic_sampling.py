"""The step's batch under DAPO: overlong reward shaping, dynamic sampling with refills, overlong filtering.

The GRPO step calls :func:`collect_step_rollouts` in place of its one rollout call, then
:func:`apply_overlong_filter` on the batch tensors (see docs/training.md, "Dynamic sampling and
overlong handling"):

    result = collect_step_rollouts(records, sampler, generate_and_score, DapoOptions.from_config(cfg))
    if result.skip_update: ...warn, log result.metrics, do not step the optimizer...
    advantages = grpo_advantages(tensor(result.rewards), group_size=result.batch.n, ...)
    tensors = result.batch.to_tensors(pad_id)
    tensors["loss_mask"], filter_metrics = apply_overlong_filter(tensors["loss_mask"], result.batch, options)

``generate_and_score(records, attempt)`` is the step's rollout phase: generate ``n`` samples per record
and score them, returning the same ``(RolloutBatch, rewards)`` on every rank. ``attempt`` is 0 for the
step's first batch and ``k`` for its ``k``-th refill, so request seeds can differ per attempt.

Determinism: refill prompts are the sampler's next batches, and every decision depends only on the
(broadcast) rewards, so every rank draws the same prompts, and the sampler position saved in a checkpoint
covers the refills: a resumed run continues exactly, provided ``generate_and_score`` is deterministic in
``(records, attempt)`` for a given step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.core.dapo import DapoConfig, overlong_filter_mask, overlong_penalty, zero_variance_groups
from nemo_rollout_correction.rollout.samples import RolloutBatch, RolloutSample
from nemo_rollout_correction.tasks.prompts import PromptRecord

__all__ = [
    "DapoOptions",
    "GenerateAndScore",
    "PromptSource",
    "StepRollouts",
    "apply_overlong_filter",
    "collect_step_rollouts",
]

GenerateAndScore = Callable[[list[PromptRecord], int], tuple[RolloutBatch, Sequence[float]]]
"""``(records, attempt) -> (batch with n samples per record in record order, [len(batch)] rewards)``."""


class PromptSource(Protocol):
    """What the refill loop needs from :class:`~nemo_rollout_correction.tasks.prompts.PromptSampler`."""

    def next_batch(self) -> list[PromptRecord]:
        """The next prompts, advancing the (checkpointed) state."""
        ...


@dataclass(frozen=True)
class DapoOptions(DapoConfig):
    """What the step needs: the ``grpo.*`` DAPO keys (:class:`~nemo_rollout_correction.core.dapo.DapoConfig`,
    where each key is defined) and the response budget ``rollout.max_new_tokens``."""

    max_new_tokens: int = 48

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> DapoOptions:
        """The ``grpo.*`` DAPO keys and ``rollout.max_new_tokens`` of ``cfg``."""
        dapo = {f.name: getattr(cfg.grpo, f.name) for f in dataclasses.fields(DapoConfig)}
        return cls(**dapo, max_new_tokens=cfg.rollout.max_new_tokens)


@dataclass
class StepRollouts:
    """The batch a step trains on.

    Attributes:
        records: ``[num_groups]`` the prompts, in batch order (``batch.samples[i].prompt_index`` indexes it).
        batch: ``n`` samples per record; exactly as many groups as the step's first prompt batch.
        rewards: ``[num_samples]`` rewards for the advantages: the task reward plus the overlong penalty.
        task_rewards: ``[num_samples]`` the reward function's values (for ``reward/*`` metrics).
        skip_update: every generated group had zero reward variance: nothing to learn, skip the update.
        warning: why the update is skipped (or why the batch was padded), for the step to print; else None.
        metrics: ``grpo/*`` metrics of this step (see docs/training.md).
    """

    records: list[PromptRecord]
    batch: RolloutBatch
    rewards: list[float]
    task_rewards: list[float]
    skip_update: bool = False
    warning: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _Group:
    record: PromptRecord
    samples: list[RolloutSample]
    rewards: list[float]
    task_rewards: list[float]


def collect_step_rollouts(
    records: list[PromptRecord],
    sampler: PromptSource,
    generate_and_score: GenerateAndScore,
    options: DapoOptions,
) -> StepRollouts:
    """Generate and score ``records``; with dynamic sampling, replace zero-variance groups from refill batches.

    Without ``options.dynamic_sampling`` this is one ``generate_and_score(records, 0)`` call (plus the
    overlong penalty when enabled). With it, groups whose rewards (after the penalty) are all equal are
    set aside and ``sampler.next_batch()`` supplies more prompts, up to ``options.max_refill_batches``
    extra calls, until ``len(records)`` groups have reward variance (DAPO's dynamic sampling). Surplus
    informative groups of the last refill are dropped, as in DAPO. If the refills run out first, the
    batch is filled up with set-aside groups (they have zero advantage, so they add no gradient; the
    batch keeps its configured size, which the microbatch and data-parallel split rely on); if no group
    at all has variance, ``skip_update`` is set with a warning.

    Args:
        records: ``[num_groups]`` this step's first prompts (already drawn from ``sampler``).
        sampler: the source of refill prompts (the trainer's ``PromptSampler``).
        generate_and_score: the step's rollout phase (see the module doc).
        options: the DAPO settings.

    Returns:
        The batch to train on; its ``metrics`` hold ``grpo/filtered_group_fraction``,
        ``grpo/refill_batches``, ``grpo/padded_group_fraction`` and ``grpo/update_skipped`` with dynamic
        sampling, and ``grpo/overlong_penalty_mean`` with the overlong penalty.

    Raises:
        ValueError: ``records`` is empty, or ``generate_and_score`` returned a batch that does not hold
            ``n`` samples per record in order, or a reward list of another length.
    """
    if not records:
        raise ValueError("collect_step_rollouts needs at least one prompt record")
    target = len(records)
    kept: list[_Group] = []
    filtered: list[_Group] = []
    num_generated = 0
    refills = 0
    seconds = 0.0
    group_size = 0
    prompts = records
    while True:
        batch, task_rewards = generate_and_score(prompts, refills)
        groups = _split_groups(prompts, batch, task_rewards, options)
        group_size, seconds = batch.n, seconds + batch.seconds
        if not options.dynamic_sampling:
            return _assemble(groups, group_size, seconds, options, metrics={})
        rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float64)
        flat = zero_variance_groups(rewards, group_size).tolist()
        for group, zero_variance in zip(groups, flat, strict=True):
            (filtered if zero_variance else kept).append(group)
        num_generated += len(groups)
        if len(kept) >= target or refills >= options.max_refill_batches:
            break
        refills += 1
        prompts = sampler.next_batch()

    num_padded = max(target - len(kept), 0)
    chosen = kept[:target] + filtered[:num_padded]
    skip = not kept
    warning = None
    if skip:
        warning = (f"grpo.dynamic_sampling: all {num_generated} groups of this step ({1 + refills} batches, "
                   f"grpo.max_refill_batches={options.max_refill_batches}) have zero reward variance: nothing to "
                   "learn, the update is skipped")
    elif num_padded:
        warning = (f"grpo.dynamic_sampling: only {len(kept)} of {target} groups have reward variance after "
                   f"{refills} refill batches; {num_padded} zero-variance groups fill the batch (no gradient)")
    metrics = {
        "grpo/filtered_group_fraction": (num_generated - len(kept)) / num_generated,
        "grpo/refill_batches": float(refills),
        "grpo/padded_group_fraction": num_padded / target,
        "grpo/update_skipped": float(skip),
    }
    result = _assemble(chosen, group_size, seconds, options, metrics)
    result.skip_update, result.warning = skip, warning
    return result


def _split_groups(
    prompts: list[PromptRecord], batch: RolloutBatch, task_rewards: Sequence[float], options: DapoOptions
) -> list[_Group]:
    """One group per prompt, with the overlong penalty added to its rewards when enabled."""
    n = batch.n
    if len(batch.samples) != len(prompts) * n or len(task_rewards) != len(batch.samples):
        raise ValueError(f"generate_and_score returned {len(batch.samples)} samples and {len(task_rewards)} rewards "
                         f"for {len(prompts)} prompts x n={n}")
    if any(s.prompt_index != i // n for i, s in enumerate(batch.samples)):
        raise ValueError("generate_and_score must return the samples in prompt order, n per prompt")
    raw = [float(r) for r in task_rewards]
    shaped = list(raw)
    if options.overlong_penalty:
        lengths = torch.tensor([len(s.token_ids) for s in batch.samples])
        penalty = overlong_penalty(lengths, options.max_new_tokens, options.overlong_buffer_len,
                                   options.overlong_penalty_factor)
        shaped = [r + p for r, p in zip(raw, penalty.tolist(), strict=True)]
    return [
        _Group(prompts[i], batch.samples[i * n:(i + 1) * n], shaped[i * n:(i + 1) * n], raw[i * n:(i + 1) * n])
        for i in range(len(prompts))
    ]


def _assemble(
    groups: list[_Group], n: int, seconds: float, options: DapoOptions, metrics: dict[str, float]
) -> StepRollouts:
    """The chosen groups as one batch, prompt indices renumbered into the new record list."""
    samples = [dataclasses.replace(s, prompt_index=i) for i, g in enumerate(groups) for s in g.samples]
    rewards = [r for g in groups for r in g.rewards]
    task_rewards = [r for g in groups for r in g.task_rewards]
    if options.overlong_penalty:
        metrics["grpo/overlong_penalty_mean"] = sum(r - t for r, t in zip(rewards, task_rewards, strict=True)) / max(
            len(rewards), 1)
    return StepRollouts(
        records=[g.record for g in groups],
        batch=RolloutBatch(samples, n=n, seconds=seconds),
        rewards=rewards,
        task_rewards=task_rewards,
        metrics=metrics,
    )


def apply_overlong_filter(
    loss_mask: Tensor, batch: RolloutBatch, options: DapoOptions
) -> tuple[Tensor, dict[str, float]]:
    """``grpo.overlong_filter``: clear the loss_mask rows of truncated responses (``finish_reason == "length"``).

    Args:
        loss_mask: ``[num_samples, seq]`` from ``batch.to_tensors`` (the whole step's batch, on every rank,
            before the data-parallel split).
        batch: the step's batch (row ``i`` is ``batch.samples[i]``).
        options: the DAPO settings; without ``overlong_filter`` the mask is returned unchanged.

    Returns:
        ``([num_samples, seq] loss_mask, metrics)`` with ``grpo/overlong_filtered_fraction`` (share of
        responses removed from the loss) when the filter is on. If every response is truncated the mask
        is all False: the loss is then zero with zero gradient (the correction's empty-batch rule).
    """
    if not options.overlong_filter:
        return loss_mask, {}
    if loss_mask.shape[0] != len(batch.samples):
        raise ValueError(f"loss_mask has {loss_mask.shape[0]} rows for {len(batch.samples)} samples")
    truncated = torch.tensor([s.finish_reason == "length" for s in batch.samples], dtype=torch.bool)
    fraction = float(truncated.float().mean()) if len(batch.samples) else 0.0
    return overlong_filter_mask(loss_mask, truncated), {"grpo/overlong_filtered_fraction": fraction}
