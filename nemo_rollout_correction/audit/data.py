"""The audit's data: sample on the engine, share the batch with every rank, re-score the same tokens with the
Megatron policy (any TP/PP/CP layout), and compare (`AuditData`: both policies' logprobs on one batch).

`nrc audit`'s report (audit/mismatch.py) and the LoRA comparison (audit/lora.py) both read it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from nemo_rollout_correction.distributed.context_parallel import gather_cp_tokens
from nemo_rollout_correction.distributed.groups import ParallelGroups
from nemo_rollout_correction.distributed.pipeline import broadcast_from_last_stage
from nemo_rollout_correction.harness import routing_replay
from nemo_rollout_correction.harness.exchange import broadcast_rollouts
from nemo_rollout_correction.harness.scoring import score_microbatches, shard_tokens
from nemo_rollout_correction.models.policy import MegatronPolicy
from nemo_rollout_correction.rollout.options import SamplingOptions
from nemo_rollout_correction.rollout.samples import RolloutBatch
from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine


@dataclass
class AuditData:
    """Rollouts and both policies' logprobs. `[samples, L - 1]` unless noted (position t scores token t + 1)."""

    batch: RolloutBatch
    input_ids: Tensor  # [samples, L]
    rollout_logprobs: Tensor
    old_logprobs: Tensor
    loss_mask: Tensor
    seconds: dict[str, float] = field(default_factory=dict)



def generate(engine: VllmRolloutEngine | None, prompts: Sequence[Sequence[int]], sampling: SamplingOptions, *,
             seed: int = 0) -> RolloutBatch:
    """Sample on the engine rank (`engine` not None) and share the batch with every rank of the job."""
    batch, _ = broadcast_rollouts(engine.generate(prompts, sampling, seed=seed) if engine is not None else None)
    return batch


def rescore(
    policy: MegatronPolicy,
    batch: RolloutBatch,
    replay: dict[str, Any],
    *,
    pad_token_id: int = 0,
    micro_batch_size: int = 16,
    groups: ParallelGroups | None = None,
    replay_routing: bool = False,
) -> AuditData:
    """Re-score `batch`'s tokens with `policy` on every rank (any TP/PP/CP layout); every rank must call it.

    The whole batch goes through Megatron's schedule on every pipeline (TP ranks share the vocab-parallel
    logprobs, CP ranks one token share each, the last stage's scores are sent to the others). `groups`
    defaults to Megatron's parallel state. `replay_routing`: replay the batch's captured MoE routing (the
    policy built with `routing_replay=True`); otherwise the policy routes with its own routers.
    """
    groups = groups if groups is not None else ParallelGroups.from_megatron()
    tensors = batch.to_tensors(pad_token_id)
    start = time.perf_counter()
    ids = tensors["input_ids"]
    # Microbatches of whole rows (not trimmed: the pieces are concatenated back), each cut into this CP rank's
    # share as the trainer cuts its own (`harness.scoring.shard_tokens`).
    num = ids.shape[0]
    rows = [torch.arange(lo, min(lo + micro_batch_size, num)) for lo in range(0, num, micro_batch_size)]
    shards = [shard_tokens(ids[r], {}, groups, pad_id=pad_token_id) for r in rows]
    if policy.routing is not None:
        routing_replay.begin_step(policy)
    if replay_routing:
        for r, shard in zip(rows, shards, strict=True):
            routing_replay.attach_microbatch(policy, tensors, r, shard.input_ids, shard.position_ids)
    scored = score_microbatches(policy, [s.input_ids for s in shards], replay,
                                labels=[s.labels for s in shards if s.labels is not None],
                                position_ids=[s.position_ids for s in shards if s.position_ids is not None])
    if scored is not None and groups.cp_size > 1:  # whole sequences back from every CP rank's share
        scored = [gather_cp_tokens(x, groups)[:, : ids.shape[1] - 1] for x in scored]
    pieces = broadcast_from_last_stage(scored, groups)
    old = torch.cat(pieces) if pieces else torch.zeros_like(tensors["rollout_logprobs"])
    return AuditData(
        batch=batch,
        input_ids=tensors["input_ids"],
        rollout_logprobs=tensors["rollout_logprobs"],
        old_logprobs=old,
        loss_mask=tensors["loss_mask"],
        seconds={"generation": batch.seconds, "rescoring": time.perf_counter() - start},
    )


def collect(
    policy: MegatronPolicy,
    engine: VllmRolloutEngine | None,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingOptions,
    replay: dict[str, Any],
    *,
    seed: int = 0,
    pad_token_id: int = 0,
    micro_batch_size: int = 16,
    groups: ParallelGroups | None = None,
) -> AuditData:
    """`generate` on the engine rank (`engine` not None), broadcast, and `rescore` on every rank."""
    batch = generate(engine, prompts, sampling, seed=seed)
    return rescore(policy, batch, replay, pad_token_id=pad_token_id, micro_batch_size=micro_batch_size,
                   groups=groups)


def logprob_diff(data: AuditData) -> tuple[float, float]:
    """(max, mean) |trainer - vLLM| over response tokens (finite entries only)."""
    diff = (data.old_logprobs - data.rollout_logprobs).abs()[data.loss_mask]
    diff = diff[torch.isfinite(diff)]
    if diff.numel() == 0:
        return 0.0, 0.0
    return float(diff.max()), float(diff.mean())


__all__ = ["AuditData", "collect", "generate", "logprob_diff", "rescore"]
