"""The one entry point: `compute_rollout_correction`.

Two phases, each a loop over row chunks so peak extra memory stays at a few chunk-sized
temporaries whatever the batch size:

1. `sequence_partials`: per-sequence sums/maxima/minima of token terms (phase 1). Under
   context parallelism these `[batch]` vectors are all-reduced over the CP group here.
2. `finish_correction`: sequence decisions (IS weight, rejection, veto, non-finite policy)
   from the complete per-sequence partials, the token-level keep mask and IS weights, and
   the mergeable metric partials (phase 2).

On one process `compute_rollout_correction` runs both phases per chunk while the chunk is hot
in cache. Inputs are never modified; outputs are detached (IS weights carry no gradient).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from nemo_rollout_correction.core import keys as K
from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.frontier import opsm_rejected
from nemo_rollout_correction.core.masking import LOG_RATIO_BOUND, TokenChunk, validate_advantages, validate_inputs
from nemo_rollout_correction.core.metrics import (
    finalize_metrics,
    sequence_metric_partials,
    token_metric_partials,
)
from nemo_rollout_correction.core.rejection import seq_logprob_error_rejected, sequence_rejected, vetoed
from nemo_rollout_correction.core.sequence_stats import (
    chunk_sequence_partials,
    token_is_weights,
    token_rs_rejected_any,
)
from nemo_rollout_correction.core.stats import Partials
from nemo_rollout_correction.core.step_thresholds import resolve_step_thresholds
from nemo_rollout_correction.core.weights import bound_weights, normalize_is_weights_

CHUNK_ELEMENTS = 1 << 20
"""Most tokens per row chunk (4 MiB per float32 temporary)."""

MIN_CHUNK_ELEMENTS = 1 << 16
"""Fewest tokens per row chunk (unless the batch is smaller): below this, per-chunk Python
overhead outweighs the memory saved."""


@dataclass
class RolloutCorrectionOutput:
    """What `compute_rollout_correction` returns.

    is_weights: `[batch, seq]` float32, detached; the IS weight on kept tokens, 1 where no IS
        applies, 0 outside keep_mask.
    keep_mask: `[batch, seq]` bool; loss_mask after rejection, veto and non-finite handling.
    denominator_mask: `[batch, seq]` bool; the tokens that count in the loss denominator
        (keep_mask, or the finite loss tokens when `rejected_tokens_in_denominator`).
    partials: the unreduced statistics (sums / maxima / minima / histograms) behind `metrics`,
        for distributed callers to reduce before `finalize_metrics`.
    metrics: `rollout_corr/<name>` -> float, for this batch alone.
    """

    is_weights: Tensor
    keep_mask: Tensor
    denominator_mask: Tensor
    partials: Partials
    config: RolloutCorrectionConfig
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_kept_tokens(self) -> int:
        """Tokens in keep_mask (local; a distributed caller sums it over dp x cp)."""
        return int(self.partials.get_sum(K.NUM_KEPT_TOKENS))

    @property
    def num_denominator_tokens(self) -> int:
        """Tokens in denominator_mask (local; the global sum is the loss denominator)."""
        return int(self.partials.get_sum(K.NUM_DENOMINATOR_TOKENS))


def compute_rollout_correction(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    loss_mask: Tensor,
    cfg: RolloutCorrectionConfig,
    *,
    is_weight_mean: float | Tensor | None = None,
    advantages: Tensor | None = None,
) -> RolloutCorrectionOutput:
    """IS weights, keep mask and diagnostics for one batch.

    old_logprobs: `[batch, seq]` pi_old of the sampled tokens, as re-scored by the trainer. In
        bypass / pure-IS mode pass the current policy's logprobs (they are detached here).
    rollout_logprobs: `[batch, seq]` pi_rollout as the rollout engine reported them.
    loss_mask: `[batch, seq]` bool (or 0/1) marking trainable response tokens.
    cfg: the configuration (see `RolloutCorrectionConfig.from_preset`).
    is_weight_mean: for `rollout_is_batch_normalize`, the global mean of the kept weights
        (computed by the caller over all ranks); None uses this batch's own mean.
    advantages: `[batch]` or `[batch, seq]`; required when `cfg.needs_advantages` (OPSM,
        DPPO-TV), ignored otherwise. A sequence's OPSM advantage is the mean over its valid tokens.

    Step-level thresholds (M2PO) not yet set on `cfg` are chosen from this batch alone: right for one
    process holding the whole step; across microbatches or ranks resolve them first
    (`distributed.resolve_step_config`).

    Raises ValueError for mismatched shapes/dtypes, for missing advantages, and for non-finite
    logprobs when the config says `raise` or the fail-fast fraction is exceeded.
    """
    validate_inputs(old_logprobs, rollout_logprobs, loss_mask)
    if not cfg.step_thresholds_resolved:
        cfg = resolve_step_thresholds(cfg, [(old_logprobs, rollout_logprobs, loss_mask)])
    adv = validate_advantages(advantages, old_logprobs, cfg.needs_advantages)
    old_logprobs, rollout_logprobs = old_logprobs.detach(), rollout_logprobs.detach()
    outputs = _allocate_outputs(old_logprobs)
    partials = Partials()
    seq_parts: list[Partials] = []
    decision_parts: list[dict[str, Tensor]] = []
    for start, stop in row_chunks(old_logprobs):
        tok = TokenChunk(old_logprobs[start:stop], rollout_logprobs[start:stop], loss_mask[start:stop],
                         None if adv is None else adv[start:stop])
        seq = chunk_sequence_partials(tok, cfg)
        _check_nonfinite_raise(seq, cfg, start)
        token_partials, decisions = _finish_chunk(tok, seq, cfg, outputs, start, stop)
        partials.merge(token_partials)
        seq_parts.append(seq)
        decision_parts.append(decisions)
    partials.merge(sequence_metric_partials(Partials.concat(seq_parts), cfg, _concat_decisions(decision_parts)))
    return _complete(outputs, partials, cfg, is_weight_mean)


def sequence_partials(
    old_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor, cfg: RolloutCorrectionConfig,
    *, advantages: Tensor | None = None,
) -> Partials:
    """Phase 1 alone: per-sequence partials `[batch]` to reduce over context-parallel ranks.

    SUM entries are summed, MAX entries maxed and MIN entries minned over the CP group; the
    result is passed to `finish_correction` on every CP rank. advantages: as in
    `compute_rollout_correction` (this rank's `[batch, local_seq]` shard, or `[batch]`).
    """
    validate_inputs(old_logprobs, rollout_logprobs, loss_mask)
    adv = validate_advantages(advantages, old_logprobs, cfg.needs_advantages)
    parts = []
    for start, stop in row_chunks(old_logprobs):
        tok = TokenChunk(old_logprobs[start:stop].detach(), rollout_logprobs[start:stop].detach(),
                         loss_mask[start:stop], None if adv is None else adv[start:stop])
        parts.append(chunk_sequence_partials(tok, cfg))
    return Partials.concat(parts)


def finish_correction(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    loss_mask: Tensor,
    cfg: RolloutCorrectionConfig,
    seq: Partials,
    *,
    owns_sequences: bool = True,
    is_weight_mean: float | Tensor | None = None,
    advantages: Tensor | None = None,
) -> RolloutCorrectionOutput:
    """Phase 2 alone, given complete per-sequence partials `seq` (already CP-reduced).

    advantages: the same tensor given to `sequence_partials` (DPPO-TV reads it per token).
    owns_sequences: whether this rank contributes the per-sequence metric terms. Under context
        parallelism every CP rank holds the same complete sequence statistics, so exactly one
        CP rank (e.g. cp_rank 0) must own them or they would be counted cp_size times.
    The returned `metrics` describe this rank's share only; reduce `partials` (SUM/MAX/MIN)
    over dp x cp and call `finalize_metrics` for the step's values.
    """
    validate_inputs(old_logprobs, rollout_logprobs, loss_mask)
    adv = validate_advantages(advantages, old_logprobs, cfg.needs_advantages)
    _check_nonfinite_raise(seq, cfg, 0)
    old_logprobs, rollout_logprobs = old_logprobs.detach(), rollout_logprobs.detach()
    outputs = _allocate_outputs(old_logprobs)
    partials = Partials()
    decision_parts: list[dict[str, Tensor]] = []
    for start, stop in row_chunks(old_logprobs):
        tok = TokenChunk(old_logprobs[start:stop], rollout_logprobs[start:stop], loss_mask[start:stop],
                         None if adv is None else adv[start:stop])
        token_partials, decisions = _finish_chunk(tok, seq.slice_rows(start, stop), cfg, outputs, start, stop)
        partials.merge(token_partials)
        decision_parts.append(decisions)
    if owns_sequences:
        partials.merge(sequence_metric_partials(seq, cfg, _concat_decisions(decision_parts)))
    return _complete(outputs, partials, cfg, is_weight_mean)


# ---- internals ------------------------------------------------------------------------------


def row_chunks(x: Tensor) -> list[tuple[int, int]]:
    """Row ranges `[start, stop)` that split `x` `[batch, seq]` into chunks.

    About a quarter of the batch per chunk, within [MIN_CHUNK_ELEMENTS, CHUNK_ELEMENTS] tokens:
    peak extra memory stays a fraction of the batch's own size, while large batches are not
    cut into so many chunks that per-chunk overhead dominates.
    """
    batch, seq_len = x.shape
    if batch == 0:
        return [(0, 0)]  # one empty chunk, so every partial exists with shape [0]
    elements = min(CHUNK_ELEMENTS, max(MIN_CHUNK_ELEMENTS, x.numel() // 4))
    rows = max(1, elements // max(seq_len, 1))
    return [(start, min(start + rows, batch)) for start in range(0, batch, rows)]


def _allocate_outputs(like: Tensor) -> dict[str, Tensor]:
    return {
        "is_weights": torch.empty(like.shape, dtype=torch.float32, device=like.device),
        "keep_mask": torch.empty(like.shape, dtype=torch.bool, device=like.device),
        "denominator_mask": torch.empty(like.shape, dtype=torch.bool, device=like.device),
    }


def _check_nonfinite_raise(seq: Partials, cfg: RolloutCorrectionConfig, row_offset: int) -> None:
    if cfg.nonfinite_policy != "raise":
        return
    bad_rows = torch.nonzero(seq.sums["num_nonfinite"] > 0).flatten()
    if bad_rows.numel():
        total = int(seq.sums["num_nonfinite"].sum())
        raise ValueError(
            f"{total} non-finite logprob(s) on loss tokens (first in row {int(bad_rows[0]) + row_offset}) "
            "with nonfinite_policy='raise'; use 'mask_token' or 'reject_sequence' to train through them"
        )


def _complete(
    outputs: dict[str, Tensor],
    partials: Partials,
    cfg: RolloutCorrectionConfig,
    is_weight_mean: float | Tensor | None,
) -> RolloutCorrectionOutput:
    _check_nonfinite_fraction(partials, cfg)
    if cfg.rollout_is_batch_normalize:
        mean = float(is_weight_mean) if is_weight_mean is not None else local_is_weight_mean(partials)
        if not (math.isfinite(mean) and mean > 0):
            mean = 1.0  # nothing kept anywhere: nothing to rescale, and report that honestly
        # A MAX, not a SUM: every microbatch and rank of a step divides by the same global mean.
        partials.add_max(K.BATCH_NORM_FACTOR, torch.tensor(mean, dtype=torch.float64))
        if not cfg.metrics_only:
            normalize_is_weights_(outputs["is_weights"], mean)
    return RolloutCorrectionOutput(
        is_weights=outputs["is_weights"],
        keep_mask=outputs["keep_mask"],
        denominator_mask=outputs["denominator_mask"],
        partials=partials,
        config=cfg,
        metrics=finalize_metrics(partials, cfg),
    )


def local_is_weight_mean(partials: Partials) -> float:
    """Mean applied IS weight over kept tokens (token level) or kept sequences (sequence levels).

    Distributed callers instead sum `is_weight_kept_sum` and `is_weight_kept_count` over
    dp x cp and divide. Sequence-level weights are counted by the CP rank that owns the sequences,
    so on the other CP ranks both partials are legitimately absent: nothing kept here, mean 1.0.
    """
    if K.IS_WEIGHT_KEPT_COUNT not in partials.sums:
        return 1.0
    count = partials.get_sum(K.IS_WEIGHT_KEPT_COUNT)
    return partials.get_sum(K.IS_WEIGHT_KEPT_SUM) / count if count > 0 else 1.0


def _check_nonfinite_fraction(partials: Partials, cfg: RolloutCorrectionConfig) -> None:
    limit = cfg.nonfinite_max_fraction
    if limit is None:
        return
    bad = partials.get_sum(K.NUM_NONFINITE_TOKENS)
    total = bad + partials.get_sum(K.NUM_VALID_TOKENS)
    if total > 0 and bad / total > limit:
        raise ValueError(
            f"{bad / total:.4%} of loss tokens have non-finite logprobs ({int(bad)} of {int(total)}), above "
            f"nonfinite_max_fraction={limit}; check the rollout engine's logprobs"
        )


def _concat_decisions(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    if not parts:
        return {"keep": torch.zeros(0, dtype=torch.bool), "rs_any": torch.zeros(0, dtype=torch.bool)}
    if len(parts) == 1:
        return parts[0]
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


def _finish_chunk(
    tok: TokenChunk,
    seq: Partials,
    cfg: RolloutCorrectionConfig,
    outputs: dict[str, Tensor],
    start: int,
    stop: int,
) -> tuple[Partials, dict[str, Tensor]]:
    """Decisions, outputs and token-local metric partials for rows `[start, stop)`.

    Returns the token partials and the per-sequence decisions `[rows]` that the per-sequence
    metric partials are later computed from (once per batch, by the owning rank).
    """
    num_tokens = seq.sums["num_tokens"]
    has_tokens = num_tokens > 0
    apply = not cfg.metrics_only

    # -- sequence-level decisions ----------------------------------------------------------
    decisions: dict[str, Tensor] = {}
    usable = has_tokens.clone()  # sequences whose tokens may reach the loss at all
    if cfg.nonfinite_policy == "reject_sequence":
        decisions["nonfinite"] = seq.sums["num_nonfinite"] > 0
        usable &= ~decisions["nonfinite"]
    seq_keep = usable.clone()
    if cfg.rollout_token_veto_threshold is not None:
        decisions["veto"] = vetoed(seq, cfg.rollout_token_veto_threshold) & has_tokens
        if apply:
            seq_keep &= ~decisions["veto"]
    rs_seq_any = torch.zeros_like(has_tokens)
    for criterion in cfg.rejection_criteria:
        if not criterion.is_token_level:
            decisions[f"rs:{criterion.name}"] = sequence_rejected(seq, criterion)
            rs_seq_any |= decisions[f"rs:{criterion.name}"]
    decisions["rs_any"] = rs_seq_any
    if cfg.opsm_threshold is not None:
        decisions["opsm"] = opsm_rejected(seq, cfg)
        if apply:
            seq_keep &= ~decisions["opsm"]
    if cfg.seq_logprob_error_threshold is not None:
        decisions["seq_lp_error"] = seq_logprob_error_rejected(seq, cfg.seq_logprob_error_threshold)
        if apply:
            seq_keep &= ~decisions["seq_lp_error"]

    seq_weight: Tensor | None = None
    if cfg.rollout_is in ("sequence", "geometric"):
        log_raw = _sequence_log_weight(seq, cfg)
        clamped = log_raw.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        seq_weight, in_bounds = bound_weights(torch.exp(clamped), clamped, cfg)
        decisions["is_log_raw"] = log_raw
        decisions["is_weight"] = seq_weight
        if in_bounds is not None:
            decisions["is_rejected"] = ~in_bounds & has_tokens
    if apply:
        seq_keep &= ~rs_seq_any
        if "is_rejected" in decisions:
            seq_keep &= ~decisions["is_rejected"]
    decisions["keep"] = seq_keep

    # -- token-level keep mask (bool for the output, float 0/1 for cheap arithmetic) ----------
    every_sequence_kept = bool(seq_keep.all())
    # Read-only from here on: when every sequence is kept, `keep` may alias the caller's mask.
    keep = tok.valid if every_sequence_kept else tok.valid & seq_keep.unsqueeze(-1)
    token_weight: Tensor | None = None
    token_rejected: Tensor | None = None
    if cfg.rollout_is == "token":
        token_weight, token_in_bounds = token_is_weights(tok, cfg)
        if token_in_bounds is not None:
            token_rejected = ~token_in_bounds
    rs_rejected = token_rs_rejected_any(tok, cfg)
    if rs_rejected is not None:
        token_rejected = rs_rejected if token_rejected is None else token_rejected | rs_rejected
    weights_out = outputs["is_weights"][start:stop]
    all_kept = every_sequence_kept and not (apply and token_rejected is not None)
    if apply and token_rejected is not None:
        keep = keep & ~token_rejected  # a new tensor: never write into an alias of the input
    outputs["keep_mask"][start:stop] = keep

    valid_weights: Tensor | None = None
    if apply and token_weight is not None:
        # Valid weights go straight into the output slice, then the rejections are applied in place.
        valid_weights = torch.mul(token_weight, tok.valid_f, out=weights_out)
        if not all_kept:
            valid_weights = valid_weights.clone()  # the metrics need them before the keep mask
            weights_out.mul_(keep)
    elif token_weight is not None:  # metrics only: the output is the keep mask, weights are diagnostic
        valid_weights = token_weight * tok.valid_f
    if not (apply and token_weight is not None):
        if all_kept:
            weights_out.copy_(tok.valid_f)
        else:
            weights_out.copy_(keep)
        if apply and seq_weight is not None:
            weights_out.mul_(seq_weight.float().unsqueeze(-1))

    partials = token_metric_partials(tok, cfg, keep, weights_out, valid_weights, decisions)
    num_kept = (tok.valid_f.sum() if all_kept else keep.sum()).double()
    partials.add_sum(K.NUM_KEPT_TOKENS, num_kept)
    if cfg.rejected_tokens_in_denominator:
        outputs["denominator_mask"][start:stop] = tok.valid & usable.unsqueeze(-1)
        partials.add_sum(K.NUM_DENOMINATOR_TOKENS, (tok.valid_f * usable.float().unsqueeze(-1)).sum().double())
    else:
        outputs["denominator_mask"][start:stop] = keep
        partials.add_sum(K.NUM_DENOMINATOR_TOKENS, num_kept)
    return partials, decisions


def _sequence_log_weight(seq: Partials, cfg: RolloutCorrectionConfig) -> Tensor:
    """log rho at the sequence level `[rows]`: the summed log-ratio, or its mean (geometric)."""
    total = seq.sums["sum_log_ratio"]
    if cfg.rollout_is == "geometric":
        return total / seq.sums["num_tokens"].clamp(min=1.0)
    return total


__all__ = [
    "CHUNK_ELEMENTS",
    "MIN_CHUNK_ELEMENTS",
    "RolloutCorrectionOutput",
    "compute_rollout_correction",
    "finish_correction",
    "local_is_weight_mean",
    "row_chunks",
    "sequence_partials",
]
