"""The step's batch preparation: from the fleet's rollouts to the tensors and advantages the update trains on.

One phase of `GrpoTrainer.step`, between the rollouts (`RolloutFleet.collect`) and the update (`PolicyUpdate`),
identical on every rank; every mode's change to the batch happens here, in this order:

1. advantages: group-normalised per prompt (GRPO) from the rewards (the task's reward plus DAPO's overlong
   penalty), one per rollout;
2. rewritten histories (multi-turn, `split_rewritten`): a row per exact-prefix segment, each row with its
   trajectory's advantage and reward;
3. the rows' tensors (`RolloutBatch.to_tensors`), DAPO's overlong filter on `loss_mask`
   (`apply_overlong_filter`), and the staleness tensors of async and partial rollouts
   (`CollectedRollouts.staleness_tensors`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.core.advantages import grpo_advantages
from nemo_rollout_correction.rollout.samples import RolloutBatch
from nemo_rollout_correction.tasks.environments import split_rewritten
from nemo_rollout_correction.tasks.prompts import PromptRecord
from nemo_rollout_correction.trainer.dynamic_sampling import DapoOptions, apply_overlong_filter
from nemo_rollout_correction.trainer.fleet import CollectedRollouts

__all__ = ["StepBatch", "prepare_batch"]


@dataclass(frozen=True)
class StepBatch:
    """What the step's update trains on (`prepare_batch`).

    Attributes:
        batch: the rows trained: the rollouts' batch, or with rewritten histories a row per segment.
        tensors: `batch.to_tensors` (`[rows, seq]` and `[rows]` tensors), `loss_mask` after the overlong
            filter, with the mode's `staleness` / `token_staleness`.
        advantages: `[rows]` each row's advantage (its trajectory's).
        rewards: `[num_samples]` the task's reward of each rollout (`reward/*` metrics).
        review_rewards: `[rows]` each row's task reward (the review).
        records: the prompts, in batch order (`samples[i].prompt_index` indexes it).
        metrics: the rollouts' `grpo/*` metrics (DAPO, async staleness) and the overlong filter's.
        skip_update: no group to learn from (DAPO): the step makes no optimizer update.
    """

    batch: RolloutBatch
    tensors: dict[str, Tensor]
    advantages: Tensor
    rewards: Tensor
    review_rewards: Tensor
    records: list[PromptRecord]
    metrics: dict[str, float]
    skip_update: bool


def prepare_batch(collected: CollectedRollouts, cfg: TrainConfig, *, pad_id: int, dapo: DapoOptions) -> StepBatch:
    """The step's batch from its rollouts (module docstring); identical on every rank.

    Args:
        collected: the step's rollouts from `RolloutFleet.collect` (this rank's rows localized).
        cfg: the run's config (`grpo.normalize_advantages_by_std`; the rewritten-history checks).
        pad_id: the tokenizer's padding id.
        dapo: the DAPO options (`grpo.overlong_filter`).
    """
    rollouts, batch = collected.rollouts, collected.batch
    rewards = torch.tensor(rollouts.task_rewards, dtype=torch.float32)  # the task's reward, for reward/*
    advantages = grpo_advantages(torch.tensor(rollouts.rewards, dtype=torch.float32), group_size=batch.n,
                                 normalize_by_std=cfg.grpo.normalize_advantages_by_std)
    review_rewards = rewards
    split = split_rewritten(cfg, batch)  # rewritten histories: a row per segment
    if split is not None:  # the trajectory's advantage (and reward, for the review) broadcast to its rows
        batch, advantages, review_rewards = split[0], advantages[split[1]], rewards[split[1]]
    tensors = batch.to_tensors(pad_id)
    tensors["loss_mask"], filter_metrics = apply_overlong_filter(tensors["loss_mask"], batch, dapo)
    tensors |= collected.staleness_tensors(batch, tensors)
    return StepBatch(batch, tensors, advantages, rewards, review_rewards, rollouts.records,
                     {**rollouts.metrics, **filter_metrics}, rollouts.skip_update)
