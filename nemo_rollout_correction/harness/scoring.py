"""Shared by `nrc train` (trainer/grpo.py) and `nrc audit` (audit/mismatch.py): re-scoring rollout tokens
with the Megatron policy under any context-parallel layout, and per-sequence log-ratio statistics.

Both commands must score and summarise the mismatch the same way (a clean audit is meant to predict
the first training step), so the code lives here once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from nemo_rollout_correction.distributed.context_parallel import shard_next_token_batch
from nemo_rollout_correction.distributed.groups import ParallelGroups
from nemo_rollout_correction.models.packing import PackedRows
from nemo_rollout_correction.models.policy import MegatronPolicy

__all__ = ["SequenceLogRatios", "TokenShard", "score_microbatches", "sequence_log_ratios", "shard_tokens"]


@dataclass(frozen=True)
class TokenShard:
    """This CP rank's share of a microbatch (`shard_tokens`): `input_ids` `[rows, padded // cp]`, and with
    context parallelism `labels` (next-token ids of the held positions) and `position_ids` `[padded // cp]`;
    `tokens` the per-token tensors cut the same way (`[rows, padded // cp]`)."""

    input_ids: Tensor
    labels: Tensor | None
    position_ids: Tensor | None
    tokens: dict[str, Tensor]


def shard_tokens(input_ids: Tensor, tokens: dict[str, Tensor], groups: ParallelGroups, *, pad_id: int) -> TokenShard:
    """This CP rank's tokens of every row of a microbatch (`distributed.context_parallel.shard_next_token_batch`:
    Megatron's load-balanced layout, next-token labels cut from the full sequence first); the microbatch as it is
    without context parallelism. Shared by the trainer's microbatches and the audit's re-scoring, so both cut
    the same way."""
    if groups.cp_size == 1:
        return TokenShard(input_ids, None, None, tokens)
    shard = shard_next_token_batch(input_ids, tokens, groups.cp_size, groups.cp_rank, pad_id=pad_id)
    return TokenShard(shard.input_ids, shard.labels, shard.position_ids, dict(shard.tokens))


def score_microbatches(policy: MegatronPolicy, input_ids: list[Tensor], replay: Mapping[str, Any], *,
                       labels: list[Tensor] | None = None,
                       position_ids: list[Tensor] | None = None,
                       starts: list[int] | None = None,
                       packed: list[PackedRows] | None = None) -> list[Tensor] | None:
    """No-grad logprobs of every microbatch with vLLM's sampler replayed (`replay`: temperature, top_k, top_p).

    Without `labels` (no context parallelism): `[rows, width - 1]` next-token logprobs. With `labels` and
    `position_ids` (this CP rank's shares, from `distributed.context_parallel.shard_next_token_batch`):
    `[rows, width // cp]` logprobs of the held tokens. The last pipeline stage gets the list, the others None.
    `starts` (no CP): per microbatch the first position whose logits are computed, the logprobs before it 0
    (`MegatronPolicy.score_microbatches`). `packed` (no CP): each microbatch's rows packed (`models.packing`),
    logprobs `[rows, width - 1]` as without it.
    """
    if packed is not None:
        return policy.score_microbatches(input_ids, packed=packed, **replay)
    if not labels:
        return policy.score_microbatches(input_ids, starts=starts, **replay)
    return policy.score_microbatches(input_ids, labels=labels, position_ids=position_ids, **replay)


@dataclass(frozen=True)
class SequenceLogRatios:
    """log pi_trainer - log pi_rollout of response tokens and its per-sequence summaries.

    log_ratio: `[rows, seq]`, 0 outside `loss_mask`; seq_log_ratio: `[rows]` sum over the response (the
    sequence-level log IS ratio); seq_max_abs_log_ratio: `[rows]` max |token log ratio|.
    """

    log_ratio: Tensor
    seq_log_ratio: Tensor
    seq_max_abs_log_ratio: Tensor


def sequence_log_ratios(reference: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor, *,
                        nonfinite: Literal["zero", "worst"]) -> SequenceLogRatios:
    """Token and per-sequence log ratios of `reference` (`[rows, seq]` trainer logprobs) against
    `rollout_logprobs` over `loss_mask`.

    nonfinite: what a NaN/inf token log ratio becomes. `zero`: 0 everywhere (the training review: a
    non-finite token must not poison a step's plots). `worst`: kept in the sum and ranked as the largest
    |log ratio| (the audit: a non-finite sequence is the first thing to look at).
    """
    log_ratio = torch.where(loss_mask, reference - rollout_logprobs, torch.zeros_like(reference))
    if nonfinite == "zero":
        log_ratio = torch.nan_to_num(log_ratio, nan=0.0, posinf=0.0, neginf=0.0)
        ranked = log_ratio
    else:
        ranked = torch.nan_to_num(log_ratio, nan=torch.inf, posinf=torch.inf, neginf=-torch.inf)
    seq_max = ranked.abs().amax(-1) if ranked.numel() else torch.zeros(ranked.shape[0], device=ranked.device)
    return SequenceLogRatios(log_ratio, log_ratio.sum(-1), seq_max)
