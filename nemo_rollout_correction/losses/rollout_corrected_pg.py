"""The rollout-corrected policy loss of one microbatch on one rank, under any TP x CP x DP layout.

`RolloutCorrectedPolicyLoss` binds a `RolloutCorrectionConfig` (how to measure and correct the
vLLM / trainer mismatch) to a `PolicyLossConfig` (PPO clip, GSPO or REINFORCE and the aggregation
mode) and evaluates, for one microbatch held by this rank:

    loss = sum over kept tokens of per_token_loss * is_weight / num_global_tokens

(docs/design.md decision 2 and the reduction contract; the sequence modes divide by the global number
of kept sequences instead). The inputs are this rank's CP shard of the microbatch; TP ranks hold
replicated logprobs (after `distributed.vocab_parallel_logprobs`) and compute identical values.

The denominator is a property of the whole optimizer step, so it must exist before the first
microbatch's backward. Where it comes from (docs/losses.md has the long version):

- Decoupled mode: `old_logprobs` exist before the update (the trainer's re-scoring pass), so the
  correction of every microbatch is computed first (`correct`), then `reduce_step` all-reduces the
  counts once over dp x cp (`prepare_step`). This is exact, and the same corrections are passed
  back into `__call__`, so the correction math runs once per microbatch.
- Bypass mode: rejection depends on the current policy pi_theta. Two honest options:
  (a) exact: a no-grad forward over the step's microbatches before the first backward. The weights
      do not change within an optimizer step, so those logprobs equal the ones the grad forward
      produces (with deterministic kernels and no dropout), and `prepare_step` on them gives the
      exact denominator. Cost: one extra forward, the pass bypass mode exists to avoid.
  (b) cheap: `rollout_only_denominators` counts the loss tokens left after non-finite handling of
      the rollout logprobs (one CP all-gather per microbatch, one all-reduce per step, no model
      pass). Tokens that the current-policy rejection later removes stay in the denominator, so
      this is exact only when `rejection_is_predictable(cfg)` (no token/sequence rejection, or
      `rejected_tokens_in_denominator=True`); otherwise it over-counts and the loss is scaled by
      (kept / valid) <= 1. Batch-normalised IS cannot be done this way (its mean needs pi_theta).
- With Megatron's `calculate_per_token_loss=True` neither pass is needed for the count:
  `MicrobatchLoss.loss_sum` and `num_denominator` are what Megatron sums, all-reduces over dp x cp
  and divides by after the step (see `losses.megatron`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from nemo_rollout_correction.core.aggregation import LossAggMode, safe_divide
from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.objective import policy_loss_for
from nemo_rollout_correction.core.policy_loss import (
    PolicyLossConfig,
    add_rollout_log_ratio_penalty,
    compute_policy_loss,
    gmpo_clipped_log_ratio,
    vespo_log_weight_sums,
)
from nemo_rollout_correction.core.segments import Segments
from nemo_rollout_correction.core.stats import Partials
from nemo_rollout_correction.distributed.context_parallel import gather_sequence_partials
from nemo_rollout_correction.distributed.correction import (
    NUM_DENOMINATOR_SEQS,
    MicrobatchCorrection,
    StepReduction,
    distributed_rollout_correction,
    reduce_step,
    resolve_step_config,
)
from nemo_rollout_correction.distributed.groups import ParallelGroups

__all__ = [
    "TOKEN_DENOMINATOR_MODES",
    "MicrobatchLoss",
    "RolloutCorrectedPolicyLoss",
    "StepDenominators",
    "rejection_is_predictable",
]

TOKEN_DENOMINATOR_MODES: tuple[str, ...] = ("token-mean", "token-sum")
"""Aggregation modes whose denominator counts tokens (the others count sequences)."""


@dataclass(frozen=True)
class StepDenominators:
    """The step-level quantities a microbatch loss needs, identical on every dp x cp rank.

    num_global_tokens: denominator tokens over all microbatches of the step and all dp x cp ranks.
    num_global_seqs: sequences with at least one denominator token, counted once each.
    is_weight_mean: the global mean for `rollout_is_batch_normalize` (None without it).
    """

    num_global_tokens: float
    num_global_seqs: float
    is_weight_mean: float | None = None

    @classmethod
    def from_step(cls, step: StepReduction) -> StepDenominators:
        """The denominators of a `distributed.reduce_step` result."""
        return cls(step.num_global_tokens, step.num_global_seqs, step.is_weight_mean)


@dataclass
class MicrobatchLoss:
    """One microbatch's loss on this rank.

    loss: 0-dim, gradient w.r.t. the logprobs: `loss_sum / global denominator` (or `loss_sum` for
        `token-sum`). Summing it over the step's microbatches and dp x cp ranks gives the
        full-batch loss.
    loss_sum: 0-dim, the numerator before the global division (per-sequence means already taken
        for `seq-mean-token-mean`, `/ norm_length` already applied for `seq-mean-token-sum-norm`).
    num_denominator: 0-dim int64, this microbatch's share of the global denominator (denominator
        tokens for token modes, denominator sequences it owns for sequence modes); summed over
        the step's microbatches and dp x cp ranks it equals the global denominator.
    correction: IS weights / keep mask `[batch, local_seq]` and the unreduced metric partials.
    policy_stats: the policy loss's float64 0-dim partial sums (clip fractions, KL, token count);
        sum them over microbatches and dp x cp.
    """

    loss: Tensor
    loss_sum: Tensor
    num_denominator: Tensor
    correction: MicrobatchCorrection
    policy_stats: dict[str, Tensor]

    @property
    def partials(self) -> Partials:
        """The rollout-correction metric partials of this microbatch (unreduced)."""
        return self.correction.partials


def rejection_is_predictable(cfg: RolloutCorrectionConfig) -> bool:
    """Whether the loss denominator depends on the rollout logprobs and loss mask alone.

    True when no rejection by the policy ratio can remove a token from the denominator: no RS
    criterion, no veto, no masking IS, no OPSM / KPop / DPPO-TV mask and no sequence log-prob error
    threshold, or
    `rejected_tokens_in_denominator=True`. Then
    `rollout_only_denominators` is exact in bypass mode too.
    """
    if cfg.rejected_tokens_in_denominator or cfg.metrics_only:
        return True
    masking_is = cfg.rollout_is is not None and cfg.rollout_is_mode == "mask"
    frontier = (cfg.opsm_threshold is not None or cfg.kpop_threshold is not None or cfg.dppo_tv_threshold is not None
                or cfg.seq_logprob_error_threshold is not None or cfg.m2po_threshold is not None)
    return not (cfg.rejection_criteria or cfg.rollout_token_veto_threshold is not None or masking_is or frontier)


class RolloutCorrectedPolicyLoss:
    """Rollout-corrected policy loss of a microbatch shard (see the module doc for the step flow).

    rc_cfg: the rollout correction (mode, IS, RS, veto, non-finite policy).
    loss_cfg: the policy loss and aggregation mode (default: PPO clip, `token-mean`). With
        `rc_cfg.pure_is` (bypass + reinforce) the loss type is forced to `reinforce`, with
        `rc_cfg.loss_type='cispo'` / `'gmpo'` to that loss (`core.objective.policy_loss_for`).
    norm_length: the constant length of `seq-mean-token-sum-norm` (default: the padded length of
        the full sequence, `local_seq * cp_size`); pass the maximum response length when
        microbatches are padded differently.
    """

    def __init__(self, rc_cfg: RolloutCorrectionConfig, loss_cfg: PolicyLossConfig | None = None, *,
                 norm_length: float | None = None) -> None:
        loss_cfg = policy_loss_for(rc_cfg, loss_cfg)
        if norm_length is not None and not norm_length > 0:
            raise ValueError(f"norm_length must be > 0, got {norm_length}")
        if rc_cfg.sequence_unit == "turn" and loss_cfg.loss_agg_mode not in TOKEN_DENOMINATOR_MODES:
            raise ValueError(f"rollout_correction.sequence_unit=turn supports the token-denominator aggregation modes "
                             f"{list(TOKEN_DENOMINATOR_MODES)}, got grpo.loss_agg_mode={loss_cfg.loss_agg_mode!r} (its "
                             "sequence counts would count turns)")
        self.rc_cfg = rc_cfg
        self.loss_cfg = loss_cfg
        self.norm_length = norm_length

    @property
    def agg_mode(self) -> LossAggMode:
        """The aggregation mode of the policy loss."""
        return self.loss_cfg.loss_agg_mode

    @property
    def counts_tokens(self) -> bool:
        """True when the denominator counts tokens, False when it counts sequences."""
        return self.agg_mode in TOKEN_DENOMINATOR_MODES

    # ---- the step-level pre-pass ---------------------------------------------------------------

    def for_step(self, microbatches: Sequence[tuple[Tensor, Tensor, Tensor]],
                 groups: ParallelGroups) -> RolloutCorrectedPolicyLoss:
        """This loss with the step-level thresholds (M2PO) chosen from the whole step; `self` without any.

        microbatches: this rank's `(reference_logprobs, rollout_logprobs, loss_mask)` shards of the step
        (reference as for `correct`). Call it before `correct`; every dp x cp rank of the last stage calls it.
        """
        cfg = resolve_step_config(self.rc_cfg, microbatches, groups)
        if cfg is self.rc_cfg:
            return self
        return RolloutCorrectedPolicyLoss(cfg, self.loss_cfg, norm_length=self.norm_length)

    def correct(self, reference_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor,
                groups: ParallelGroups, *, is_weight_mean: float | None = None,
                advantages: Tensor | None = None, segments: Segments | None = None) -> MicrobatchCorrection:
        """The rollout correction of one microbatch shard, before its loss (the pre-pass).

        reference_logprobs: `[batch, local_seq]` pi_old in decoupled mode; in bypass mode the
            current policy's logprobs from a no-grad forward with the step's weights.
        rollout_logprobs, loss_mask: `[batch, local_seq]` this rank's CP shard.
        advantages: `[batch, local_seq]` or `[batch]`, the same the loss gets; required when
            `rc_cfg.needs_advantages` (OPSM, DPPO-TV), ignored otherwise.
        segments: multi-turn, the turn of each token (`rc_cfg.sequence_unit=turn`; core/segments.py).
        Collectives: one CP all-gather when cp > 1. Every CP rank must call it for the same rows.
        """
        return distributed_rollout_correction(reference_logprobs.detach(), rollout_logprobs, loss_mask,
                                              self.rc_cfg, groups, is_weight_mean=is_weight_mean,
                                              advantages=advantages, segments=segments)

    def prepare_step(self, corrections: Sequence[MicrobatchCorrection], groups: ParallelGroups) -> StepReduction:
        """Reduce the step's corrections over dp x cp (one fused all-reduce): denominators, metrics.

        Also divides batch-normalised IS weights in place by the global mean. Every dp x cp rank
        of the last pipeline stage must call it once per step (with its own, possibly empty, list).
        Use `StepDenominators.from_step(result)` for `__call__`.
        """
        return reduce_step(corrections, self.rc_cfg, groups)

    def rollout_only_denominators(self, microbatches: Sequence[tuple[Tensor, Tensor]],
                                  groups: ParallelGroups,
                                  segments: Sequence[Segments | None] | None = None) -> StepDenominators:
        """Denominators from `(rollout_logprobs, loss_mask)` shards alone, without any model pass.

        Counts the loss tokens (and sequences) that survive the non-finite policy on the rollout
        logprobs. Exact when `rejection_is_predictable(rc_cfg)`; otherwise an upper bound (tokens
        the current-policy rejection removes are still counted). Collectives: one CP all-gather
        per microbatch when cp > 1 and one all-reduce over dp x cp.
        """
        if self.rc_cfg.rollout_is_batch_normalize:
            raise ValueError("rollout_is_batch_normalize needs the global mean of the IS weights, which depends "
                             "on the current policy: run a no-grad pre-pass and prepare_step instead")
        cfg = dataclasses.replace(self.rc_cfg, rollout_is=None, rollout_rs=None, rollout_rs_threshold=None,
                                  rollout_token_veto_threshold=None, bypass_mode=False, loss_type="ppo_clip",
                                  metrics_only=False, opsm_threshold=None, kpop_threshold=None,
                                  dppo_tv_threshold=None, dppo_tv_threshold_low=None,
                                  seq_logprob_error_threshold=None, m2po_threshold=None,
                                  rollout_is_target_ess=None)
        per_microbatch = list(segments) if segments is not None else [None] * len(microbatches)
        corrections = [distributed_rollout_correction(rollout, rollout, mask, cfg, groups, segments=seg)
                       for (rollout, mask), seg in zip(microbatches, per_microbatch, strict=True)]
        step = reduce_step(corrections, cfg, groups)
        return StepDenominators(step.num_global_tokens, step.num_global_seqs, None)

    # ---- the loss ------------------------------------------------------------------------------

    def __call__(
        self,
        logprobs: Tensor,
        rollout_logprobs: Tensor,
        advantages: Tensor,
        loss_mask: Tensor,
        groups: ParallelGroups,
        denominators: StepDenominators | None = None,
        *,
        old_logprobs: Tensor | None = None,
        correction: MicrobatchCorrection | None = None,
        segments: Segments | None = None,
    ) -> MicrobatchLoss:
        """The loss of one microbatch shard.

        logprobs: `[batch, local_seq]` pi_theta with gradient (replicated over TP).
        rollout_logprobs: `[batch, local_seq]` vLLM's logprobs; may be NaN/inf (non-finite policy).
        advantages: `[batch, local_seq]` or `[batch]`.
        loss_mask: `[batch, local_seq]` bool (or 0/1) trainable response tokens.
        groups: this rank's process groups; with cp > 1 all CP ranks call this for the same rows.
        denominators: the step's global counts (`StepDenominators.from_step(prepare_step(...))` or
            `rollout_only_denominators`); None divides by this microbatch's own count, right only
            for a single microbatch on a single dp x cp rank (`loss_sum` / `num_denominator` are
            meaningful either way).
        old_logprobs: `[batch, local_seq]` pi_old; required in decoupled mode, ignored in bypass.
        correction: this microbatch's pre-pass result from `correct` (after `prepare_step`);
            None computes it here (one CP all-gather when cp > 1). In bypass mode it is then
            computed from the detached current logprobs.
        segments: multi-turn, the turn of each token (used when the correction is computed here).
        """
        cfg = self.rc_cfg
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(-1).expand_as(logprobs)
        if cfg.bypass_mode:
            reference = rollout_logprobs
        elif old_logprobs is None:
            raise ValueError("decoupled mode (bypass_mode=false) needs old_logprobs: the trainer's re-scored "
                             "logprobs of the rollout tokens; set bypass_mode=true to skip that pass")
        else:
            reference = old_logprobs
        if correction is None:
            mean = None if denominators is None else denominators.is_weight_mean
            if cfg.rollout_is_batch_normalize and mean is None:
                raise ValueError("rollout_is_batch_normalize needs the step's global IS-weight mean before the "
                                 "loss: pass denominators from prepare_step (or a precomputed correction)")
            judged = logprobs.detach() if cfg.bypass_mode else reference
            stepped = self
            if not cfg.step_thresholds_resolved:
                # This microbatch is the whole step only without step denominators on a single dp x cp rank.
                if denominators is not None or groups.dp_cp_size > 1:
                    raise ValueError("m2po_threshold / rollout_is_target_ess choose a threshold from the whole step: "
                                     "pass a correction from the step's pre-pass (for_step, correct, prepare_step)")
                stepped = self.for_step([(judged, rollout_logprobs, loss_mask)], groups)
            correction = stepped.correct(judged, rollout_logprobs, loss_mask, groups, is_weight_mean=mean,
                                         advantages=advantages, segments=segments)
        elif correction.batch_norm_pending:
            raise ValueError("the correction still awaits batch normalisation: call prepare_step on the step's "
                             "corrections before the loss")

        use_weights = cfg.rollout_is is not None and not cfg.metrics_only
        keep = correction.keep_mask
        policy = compute_policy_loss(logprobs, reference.detach(), advantages, keep, self.loss_cfg,
                                     is_weights=correction.is_weights if use_weights else None,
                                     seq_statistic=self.sequence_statistic(logprobs, reference, advantages,
                                                                           correction, groups, use_weights))
        if cfg.rollout_log_ratio_penalty > 0:
            policy = add_rollout_log_ratio_penalty(policy, logprobs, rollout_logprobs, keep,
                                                   cfg.rollout_log_ratio_penalty)
        loss_sum, num_denominator = self._numerator(policy.per_token_loss, correction, groups)
        if self.agg_mode == "token-sum":
            loss = loss_sum
        else:
            if denominators is None:
                global_count = num_denominator.to(loss_sum.dtype)
            else:
                count = denominators.num_global_tokens if self.counts_tokens else denominators.num_global_seqs
                global_count = torch.tensor(count, dtype=loss_sum.dtype, device=loss_sum.device)
            loss = safe_divide(loss_sum, global_count)
        return MicrobatchLoss(loss=loss, loss_sum=loss_sum, num_denominator=num_denominator,
                              correction=correction, policy_stats=policy.stats)

    def sequence_statistic(self, logprobs: Tensor, reference: Tensor, advantages: Tensor,
                           correction: MicrobatchCorrection, groups: ParallelGroups,
                           use_weights: bool = True) -> Tensor | None:
        """The per-sequence statistic `[batch]` the GMPO / VESPO loss needs over the whole sequence (detached):
        GMPO's mean clipped log-ratio, VESPO's summed log weight. Under CP each rank holds part of a sequence,
        so the sums travel in one CP all-gather; None otherwise (the loss takes it from the local tokens)."""
        cfg = self.loss_cfg
        if cfg.loss_type not in ("gmpo", "vespo") or groups.cp_size == 1:
            return None
        keep = correction.keep_mask
        zeros = torch.zeros_like(logprobs)
        current, ref = torch.where(keep, logprobs.detach(), zeros), torch.where(keep, reference.detach(), zeros)
        if cfg.loss_type == "vespo":
            local = vespo_log_weight_sums(current, ref, keep, correction.is_weights if use_weights else None)
        else:
            clipped = gmpo_clipped_log_ratio(current, ref, torch.where(keep, advantages, zeros),
                                             ratio_low=cfg.gmpo_ratio_low, ratio_high=cfg.gmpo_ratio_high)
            local = torch.where(keep, clipped, zeros).sum(dim=-1)
        total = gather_sequence_partials(Partials(sums={"seq": local.to(torch.float64)}), groups).reduced.sums["seq"]
        if cfg.loss_type == "vespo":
            return total
        return safe_divide(total, correction.seq_kept_tokens.to(device=total.device, dtype=torch.float64))

    def _numerator(self, per_token_loss: Tensor, correction: MicrobatchCorrection,
                   groups: ParallelGroups) -> tuple[Tensor, Tensor]:
        """(loss_sum, this microbatch's share of the denominator) for the aggregation mode."""
        keep = correction.keep_mask
        kept = torch.where(keep, per_token_loss, torch.zeros_like(per_token_loss))
        if self.counts_tokens:
            return kept.sum(), correction.denominator_mask.sum().to(torch.int64)
        num_seqs = correction.partials.sums.get(NUM_DENOMINATOR_SEQS)
        owned = (torch.zeros((), dtype=torch.int64, device=kept.device) if num_seqs is None
                 else num_seqs.round().to(torch.int64))
        seq_sum = kept.sum(dim=-1)  # [batch]
        if self.agg_mode == "seq-mean-token-mean":
            # The token count of each sequence over all its CP pieces (distributed correction).
            per_seq = safe_divide(seq_sum, correction.seq_kept_tokens.to(device=seq_sum.device, dtype=seq_sum.dtype))
            return per_seq.sum(), owned
        total = seq_sum.sum()
        if self.agg_mode == "seq-mean-token-sum-norm":
            length = self.norm_length if self.norm_length is not None else max(keep.shape[-1] * groups.cp_size, 1)
            total = total / float(length)
        return total, owned
