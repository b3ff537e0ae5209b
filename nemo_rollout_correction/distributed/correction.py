"""Rollout correction on a dp x cp shard, and the once-per-step reduction of its statistics.

Per microbatch, on every rank of the last pipeline stage (TP ranks hold replicated values and run
this identically; nothing is reduced over TP):

1. phase 1 (`core.sequence_partials`): this rank's per-sequence partials of its tokens;
2. ONE all-gather over the CP group completes them (`gather_sequence_partials`), so sequence IS,
   sequence RS, the veto and per-sequence metrics see whole sequences; no token leaves its rank;
3. phase 2 (`core.finish_correction`): IS weights and keep mask of this rank's tokens; CP rank 0
   owns the per-sequence metric terms so each sequence is counted once.

Without context parallelism a rank holds whole sequences and core's one-call
`compute_rollout_correction` does all three at once, with no collective.

Per step, `reduce_step` merges the metric partials of all the step's microbatches and reduces them
over dp x cp in one fused all-reduce (two beyond a few hundred ranks, see `reduce.py`). Everything
that needs the whole step derives from those reduced partials, identically on every rank: the loss
denominators (kept tokens, kept sequences), the global mean for batch-normalised IS, the non-finite
checks, and the metrics.

Two deliberate differences from calling core on each shard, both so that every rank acts alike:
- `rollout_is_batch_normalize` divides by the step's global mean, known only after the step
  reduction; `reduce_step` applies it in place to each microbatch's weights (or pass
  `is_weight_mean` when it is known in advance).
- `nonfinite_policy="raise"` and `nonfinite_max_fraction` are checked in `reduce_step` on the
  reduced counts, so all ranks raise together. Raising on the one rank that saw a NaN would leave
  the other ranks waiting in their next collective until the backend timeout. Until then the
  microbatch is handled as with `mask_token` (identical when nothing is non-finite).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from nemo_rollout_correction.core import keys as K
from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.correction import (
    CHUNK_ELEMENTS,
    RolloutCorrectionOutput,
    compute_rollout_correction,
    finish_correction,
    local_is_weight_mean,
    sequence_partials,
)
from nemo_rollout_correction.core.masking import TokenChunk, validate_advantages
from nemo_rollout_correction.core.metrics import finalize_metrics
from nemo_rollout_correction.core.segments import (
    Segments,
    expand_rows,
    expand_tokens,
    fold_any,
    fold_rows,
    fold_sum,
    segment_loss_mask,
)
from nemo_rollout_correction.core.sequence_stats import token_is_weights, token_rs_rejected_any
from nemo_rollout_correction.core.stats import Partials
from nemo_rollout_correction.core.step_thresholds import resolve_step_thresholds
from nemo_rollout_correction.core.weights import normalize_is_weights_
from nemo_rollout_correction.distributed.context_parallel import gather_sequence_partials
from nemo_rollout_correction.distributed.groups import ParallelGroups
from nemo_rollout_correction.distributed.reduce import ExtremesMode, PartialsSchema, all_reduce_partials
from nemo_rollout_correction.distributed.tensor_gather import collective_device

NUM_DENOMINATOR_SEQS = "dist/num_denominator_seqs"
"""SUM partial: sequences with at least one denominator token, each counted on one CP rank."""
BATCH_NORM_FACTOR = K.BATCH_NORM_FACTOR
"""MAX partial (core's name): the global mean the IS weights were divided by."""
_SURVIVORS = "dist/num_survivors"
"""Extra CP row: valid tokens of a sequence that no token-level rejection removed, per rank."""

__all__ = [
    "MicrobatchCorrection",
    "StepReduction",
    "core_config",
    "distributed_rollout_correction",
    "metric_schema",
    "reduce_step",
    "reduce_step_metrics",
    "reduce_step_partials",
    "resolve_step_config",
]


@dataclass
class MicrobatchCorrection:
    """The rollout correction of one microbatch on this rank's CP shard.

    output: core's result for this rank's tokens: `is_weights` / `keep_mask` / `denominator_mask`
        `[batch, local_seq]` and the unreduced metric `partials` (plus `dist/*` counts). Its
        `metrics` dict is emptied: values of one shard must not be logged as the step's.
    seq_kept_tokens: `[batch]` float64, the kept tokens of each sequence over ALL its CP pieces,
        for sequences with a kept token on this rank (0 for the others, whose loss here is 0).
        What a `seq-mean-token-mean` loss divides each sequence's token sum by under CP.
    batch_norm_pending: the IS weights still await division by the step's global mean
        (`reduce_step` applies it).
    """

    output: RolloutCorrectionOutput
    seq_kept_tokens: Tensor
    batch_norm_pending: bool = False

    @property
    def is_weights(self) -> Tensor:
        """`[batch, local_seq]` float32 IS weights of this rank's tokens (0 outside keep_mask)."""
        return self.output.is_weights

    @property
    def keep_mask(self) -> Tensor:
        """`[batch, local_seq]` bool: loss tokens left after rejection, veto and non-finite handling."""
        return self.output.keep_mask

    @property
    def denominator_mask(self) -> Tensor:
        """`[batch, local_seq]` bool: the tokens counted in the loss denominator."""
        return self.output.denominator_mask

    @property
    def partials(self) -> Partials:
        """This rank's unreduced metric partials of the microbatch."""
        return self.output.partials


@dataclass(frozen=True)
class StepReduction:
    """A step's statistics reduced over dp x cp; identical on every rank of the dp x cp group.

    partials: the reduced metric partials. metrics: `rollout_corr/<name>` values of the whole step.
    num_global_tokens: the token-mode loss denominator (denominator tokens of the step).
    num_global_seqs: the sequence-mode loss denominator (sequences with a denominator token).
    is_weight_mean: the global mean the IS weights were divided by (None without batch normalisation).
    """

    partials: Partials
    metrics: dict[str, float]
    num_global_tokens: float
    num_global_seqs: float
    is_weight_mean: float | None


def core_config(cfg: RolloutCorrectionConfig) -> RolloutCorrectionConfig:
    """The configuration core runs with on a shard: batch normalisation and the non-finite checks
    are moved to the step reduction (see the module doc)."""
    if not (cfg.rollout_is_batch_normalize or cfg.nonfinite_max_fraction is not None
            or cfg.nonfinite_policy == "raise"):
        return cfg
    policy = "mask_token" if cfg.nonfinite_policy == "raise" else cfg.nonfinite_policy
    return cfg.carry_step_thresholds(dataclasses.replace(cfg, rollout_is_batch_normalize=False,
                                                         nonfinite_max_fraction=None, nonfinite_policy=policy))


def resolve_step_config(cfg: RolloutCorrectionConfig, chunks: Sequence[tuple[Tensor, Tensor, Tensor]],
                        groups: ParallelGroups) -> RolloutCorrectionConfig:
    """`cfg` with its step-level thresholds (M2PO, the adaptive IS bound) chosen from the whole step over dp x cp.

    chunks: this rank's microbatches `(reference_logprobs, rollout_logprobs, loss_mask)`, `[rows, local_seq]`
    (pi_old in decoupled mode, the current policy's no-grad logprobs in bypass mode). Every dp x cp rank of the
    last pipeline stage must call it, also with no microbatch. Collectives: about 8 all-reduces of <= 765
    float64 over dp x cp (`core.step_thresholds`); none on one rank or without step-level thresholds.
    """
    if not cfg.needs_step_thresholds:
        return cfg

    def reduce(local: Tensor) -> Tensor:
        if groups.dp_cp_size == 1:
            return local
        buf = local.to(device=collective_device(groups.dp_cp_group), dtype=torch.float64).contiguous()
        dist.all_reduce(buf, group=groups.dp_cp_group)
        return buf.cpu()

    return resolve_step_thresholds(cfg, chunks, reduce)


@functools.lru_cache(maxsize=128)
def _core_schema(core_cfg: RolloutCorrectionConfig) -> PartialsSchema:
    # Which partials core emits depends on the config; only extrema also need a valid token,
    # which this probe has. Ranks derive the schema from the config alone, never from their data.
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    rollout = torch.tensor([[-1.1, -1.9, -0.5]])
    mask = torch.tensor([[True, True, False]])
    advantages = torch.tensor([-1.0])  # probed whether or not the config reads advantages
    return PartialsSchema.of(compute_rollout_correction(old, rollout, mask, core_cfg, advantages=advantages).partials)


def metric_schema(cfg: RolloutCorrectionConfig) -> PartialsSchema:
    """The partials a step reduces for `cfg`, in the fixed order they are flattened."""
    extra = Partials(sums={NUM_DENOMINATOR_SEQS: torch.zeros((), dtype=torch.float64)})
    if cfg.rollout_is_batch_normalize:
        extra.maxs[BATCH_NORM_FACTOR] = torch.zeros((), dtype=torch.float64)
    return _core_schema(core_config(cfg)).union(PartialsSchema.of(extra))


def distributed_rollout_correction(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    loss_mask: Tensor,
    cfg: RolloutCorrectionConfig,
    groups: ParallelGroups,
    *,
    is_weight_mean: float | None = None,
    advantages: Tensor | None = None,
    segments: Segments | None = None,
) -> MicrobatchCorrection:
    """Rollout correction of one microbatch on this rank's CP shard of its sequences.

    old_logprobs, rollout_logprobs: `[batch, local_seq]` this rank's tokens (see
        `context_parallel.shard_sequence`); in bypass mode pass the current policy's logprobs as
        old_logprobs. loss_mask: `[batch, local_seq]`.
    groups: the rank's process groups; every CP rank of the group must call this for the same
        microbatch (same batch rows).
    is_weight_mean: for `rollout_is_batch_normalize`, the step's global mean if already known;
        None leaves the weights for `reduce_step` to normalise.
    advantages: `[batch, local_seq]` (this rank's shard, like the logprobs) or `[batch]`; required
        when `cfg.needs_advantages` (OPSM, DPPO-TV). OPSM's per-sequence advantage sum travels in
        the same CP all-gather as the other per-sequence partials.

    segments: multi-turn, the turn of each token of this shard (core/segments.py); with
        `cfg.sequence_unit == "turn"` every sequence-level decision is taken per turn (rows expanded to turns,
        the result folded back; `partials`' sequence counts then count turns). Ignored otherwise.

    Collectives: one all-gather over the CP group when cp_size > 1, none otherwise.
    """
    _require_step_thresholds(cfg)
    if segments is not None and cfg.sequence_unit == "turn":
        k = segments.count
        inner = distributed_rollout_correction(
            expand_tokens(old_logprobs, k), expand_tokens(rollout_logprobs, k), segment_loss_mask(loss_mask, segments),
            cfg, groups, is_weight_mean=is_weight_mean, advantages=None if advantages is None else expand_rows(
                advantages, k))
        out = inner.output
        keep = fold_any(out.keep_mask, k)
        folded = dataclasses.replace(
            out, is_weights=fold_sum(torch.where(out.keep_mask, out.is_weights, 0.0), k), keep_mask=keep,
            denominator_mask=fold_any(out.denominator_mask, k))
        return MicrobatchCorrection(folded, fold_rows(inner.seq_kept_tokens, k), inner.batch_norm_pending)
    core_cfg = core_config(cfg)
    survivors: Tensor | None = None
    if groups.cp_size > 1:
        local_seq = sequence_partials(old_logprobs, rollout_logprobs, loss_mask, core_cfg, advantages=advantages)
        extra = {_SURVIVORS: _local_survivors(local_seq, old_logprobs, rollout_logprobs, loss_mask, core_cfg,
                                              advantages)}
        gathered = gather_sequence_partials(local_seq, groups, extra)
        survivors = gathered.per_rank[_SURVIVORS]  # [cp, batch]
        valid = gathered.per_rank["num_tokens"]
        out = finish_correction(old_logprobs, rollout_logprobs, loss_mask, core_cfg, gathered.reduced,
                                owns_sequences=groups.cp_rank == 0, advantages=advantages)
    else:
        # Whole sequences on this rank: core's one-call path (both phases per chunk, cache-hot).
        out = compute_rollout_correction(old_logprobs, rollout_logprobs, loss_mask, core_cfg, advantages=advantages)
    out.metrics = {}

    keeps_any = out.keep_mask.any(dim=-1)
    if survivors is None:
        # One rank holds every token of its sequences: count directly.
        owner = torch.ones_like(keeps_any)
        total_kept = out.keep_mask.sum(dim=-1).to(torch.float64)
    else:
        # A sequence's denominator count belongs to the lowest CP rank that holds a token able to
        # enter the denominator. There, "has a denominator token" is decided by the sequence-level
        # verdict alone, which every CP rank shares, so exactly one rank counts each kept sequence.
        basis = valid if cfg.rejected_tokens_in_denominator else survivors
        present = basis > 0
        first = torch.where(present.any(dim=0), present.to(torch.int8).argmax(dim=0), groups.cp_size)
        owner = first == groups.cp_rank
        # A rank with a kept token knows the sequence passed, so its kept count is all survivors.
        total_kept = survivors.sum(dim=0)
    num_seqs = (owner & out.denominator_mask.any(dim=-1)).sum()
    out.partials.add_sum(NUM_DENOMINATOR_SEQS, num_seqs.to(torch.float64))
    seq_kept_tokens = torch.where(keeps_any, total_kept, 0.0)

    result = MicrobatchCorrection(out, seq_kept_tokens, batch_norm_pending=cfg.rollout_is_batch_normalize)
    if cfg.rollout_is_batch_normalize and is_weight_mean is not None:
        _apply_batch_norm(result, float(is_weight_mean), cfg)
    return result


def _local_survivors(seq: Partials, old_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor,
                     cfg: RolloutCorrectionConfig, advantages: Tensor | None) -> Tensor:
    """Per sequence `[batch]`: valid tokens of this rank that no token-level rejection removes.

    From phase 1's counts where one kind of token rejection is active; when token IS masking and
    token RS are both active their overlap is not in the partials, so a second pass over this
    rank's tokens counts the survivors directly.
    """
    valid = seq.sums["num_tokens"]
    if cfg.metrics_only:
        return valid  # nothing is rejected, only measured
    is_rejected = seq.sums.get("num_is_rejected")
    rs_rejected = seq.sums.get("num_rs_token_rejected")
    if is_rejected is not None and rs_rejected is not None:
        return _count_survivors(old_logprobs, rollout_logprobs, loss_mask, cfg, advantages)
    if is_rejected is not None:
        return valid - is_rejected
    if rs_rejected is not None:
        return valid - rs_rejected
    return valid


def _count_survivors(old_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor,
                     cfg: RolloutCorrectionConfig, advantages: Tensor | None) -> Tensor:
    batch, seq_len = old_logprobs.shape
    rows = max(1, CHUNK_ELEMENTS // max(seq_len, 1))
    adv = validate_advantages(advantages, old_logprobs, cfg.needs_advantages)
    counts = []
    for start in range(0, batch, rows):
        stop = min(start + rows, batch)
        tok = TokenChunk(old_logprobs[start:stop].detach(), rollout_logprobs[start:stop].detach(),
                         loss_mask[start:stop], None if adv is None else adv[start:stop])
        _, in_bounds = token_is_weights(tok, cfg)
        kept = tok.valid if in_bounds is None else tok.valid & in_bounds
        rejected = token_rs_rejected_any(tok, cfg)  # RS criteria and the token-level frontier masks
        if rejected is not None:
            kept = kept & ~rejected
        counts.append(kept.sum(dim=-1).to(torch.float64))
    return torch.cat(counts) if counts else torch.zeros(0, dtype=torch.float64)


def _apply_batch_norm(mb: MicrobatchCorrection, mean: float, cfg: RolloutCorrectionConfig) -> None:
    """Divide the microbatch's weights by the global mean, as core does on one process."""
    if not (math.isfinite(mean) and mean > 0):
        mean = 1.0  # nothing kept anywhere: nothing to rescale
    mb.output.partials.add_max(BATCH_NORM_FACTOR, torch.tensor(mean, dtype=torch.float64))
    if not cfg.metrics_only:
        normalize_is_weights_(mb.output.is_weights, mean)
    mb.batch_norm_pending = False


def _require_step_thresholds(cfg: RolloutCorrectionConfig) -> None:
    """Refuse a config whose step-level thresholds are unset: its metrics (rollout_is_p*, the M2PO cutoff) and its
    masks would silently read the configured cap instead of the step's chosen value."""
    if not cfg.step_thresholds_resolved:
        raise ValueError("this config chooses thresholds from the whole step (m2po_threshold, rollout_is_target_ess): "
                         "call resolve_step_config on the step's microbatches first "
                         "(RolloutCorrectedPolicyLoss.for_step)")


def reduce_step_partials(
    partials: Partials | Sequence[Partials],
    cfg: RolloutCorrectionConfig,
    groups: ParallelGroups,
    *,
    extremes: ExtremesMode = "auto",
    device: torch.device | None = None,
) -> Partials:
    """Merge a step's microbatch partials on this rank and reduce them over dp x cp (fused).

    Every rank of the dp x cp group must call this once per step, also with no microbatch at all
    (an empty sequence). Collectives: one SUM all-reduce, plus one MAX all-reduce only when the
    extremes do not fit the per-rank slots (`reduce.all_reduce_partials`); none on one rank.
    device: where the reduction buffers live (default: the partials' device; see
        `reduce.partials_device` for a rank without microbatches).
    """
    _require_step_thresholds(cfg)
    merged = Partials()
    for part in [partials] if isinstance(partials, Partials) else partials:
        merged.merge(part)
    return all_reduce_partials(merged, metric_schema(cfg), group=groups.dp_cp_group, group_size=groups.dp_cp_size,
                               group_rank=groups.dp_cp_rank, extremes=extremes, device=device)


def reduce_step(
    corrections: Sequence[MicrobatchCorrection],
    cfg: RolloutCorrectionConfig,
    groups: ParallelGroups,
    *,
    extremes: ExtremesMode = "auto",
    device: torch.device | None = None,
) -> StepReduction:
    """Reduce a step's corrections over dp x cp: denominators, global IS mean, checks, metrics.

    corrections: this rank's microbatches of the step (any number, also none; ranks may differ).
    With `rollout_is_batch_normalize` and no mean given in advance, divides each microbatch's
    weights in place by the step's global mean. Raises ValueError on every rank alike for
    `nonfinite_policy="raise"` or a non-finite fraction above `nonfinite_max_fraction`.
    Call it before the losses of the step: they divide by `num_global_tokens` / `num_global_seqs`.
    """
    reduced = reduce_step_partials([c.partials for c in corrections], cfg, groups, extremes=extremes, device=device)
    _check_nonfinite(reduced, cfg)
    mean: float | None = None
    if cfg.rollout_is_batch_normalize:
        mean = _complete_batch_norm(reduced)
        for correction in corrections:
            if correction.batch_norm_pending:
                _apply_batch_norm(correction, mean, cfg)
    return StepReduction(
        partials=reduced,
        metrics=finalize_metrics(reduced, cfg),
        num_global_tokens=reduced.get_sum(K.NUM_DENOMINATOR_TOKENS),
        num_global_seqs=reduced.get_sum(NUM_DENOMINATOR_SEQS),
        is_weight_mean=mean,
    )


def reduce_step_metrics(
    partials: Partials | Sequence[Partials],
    cfg: RolloutCorrectionConfig,
    groups: ParallelGroups,
    *,
    extremes: ExtremesMode = "auto",
    device: torch.device | None = None,
) -> dict[str, float]:
    """The step's `rollout_corr/<name>` metrics from this rank's (merged or per-microbatch) partials.

    The same reduction and checks as `reduce_step`, for callers that handle weights themselves.
    """
    reduced = reduce_step_partials(partials, cfg, groups, extremes=extremes, device=device)
    _check_nonfinite(reduced, cfg)
    if cfg.rollout_is_batch_normalize:
        _complete_batch_norm(reduced)
    return finalize_metrics(reduced, cfg)


def _complete_batch_norm(reduced: Partials) -> float:
    """The mean every rank divides by: the one given in advance (reduced MAX), else the global one."""
    given = float(reduced.maxs.get(BATCH_NORM_FACTOR, torch.tensor(float("-inf"))))
    if math.isfinite(given):
        return given
    mean = local_is_weight_mean(reduced)  # summed over dp x cp: the global mean
    if not (math.isfinite(mean) and mean > 0):
        mean = 1.0
    reduced.maxs[BATCH_NORM_FACTOR] = torch.tensor(mean, dtype=torch.float64)
    return mean


def _check_nonfinite(reduced: Partials, cfg: RolloutCorrectionConfig) -> None:
    bad = reduced.get_sum(K.NUM_NONFINITE_TOKENS)
    if cfg.nonfinite_policy == "raise" and bad > 0:
        raise ValueError(
            f"{int(bad)} non-finite logprob(s) on loss tokens in this step (over all dp x cp ranks) with "
            "nonfinite_policy='raise'; use 'mask_token' or 'reject_sequence' to train through them"
        )
    limit = cfg.nonfinite_max_fraction
    total = bad + reduced.get_sum(K.NUM_VALID_TOKENS)
    if limit is not None and total > 0 and bad / total > limit:
        raise ValueError(
            f"{bad / total:.4%} of the step's loss tokens have non-finite logprobs ({int(bad)} of {int(total)}, "
            f"over all dp x cp ranks), above nonfinite_max_fraction={limit}; check the rollout engine's logprobs"
        )
