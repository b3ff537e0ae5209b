"""The rollout-corrected policy objective: correction mode + policy loss + aggregation.

Modes (docs/design.md three-policy framework):
- decoupled (`bypass_mode=False`): IS weights between pi_old and pi_rollout correct the
  rollout mismatch; the policy loss (PPO clip / GSPO / REINFORCE) runs between pi_theta and
  pi_old. Needs `old_logprobs`.
- bypass (`bypass_mode=True`, `loss_type="ppo_clip"`): no old-logprob recompute; the PPO ratio
  is pi_theta / pi_rollout, which is itself the IS correction. Rejection still applies, judged
  on the current policy's (detached) log-ratio to the rollout.
- pure IS (`bypass_mode=True`, `loss_type="reinforce"`): off-policy REINFORCE,
  -sg(w) * A * log pi_theta with w = bound(pi_theta / pi_rollout), no clipping.
- metrics only (`metrics_only=True`): the diagnostics are computed, the loss is the
  uncorrected one (only non-finite tokens are dropped).

The loss denominator is passed in (the global count over all microbatches and dp x cp ranks,
docs/design.md decision 2); None uses this batch's own count.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor

from nemo_rollout_correction.core.aggregation import Count, aggregate_loss, count_for_denominator
from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.correction import RolloutCorrectionOutput, compute_rollout_correction
from nemo_rollout_correction.core.objective_params import objective_params
from nemo_rollout_correction.core.policy_loss import (
    PolicyLossConfig,
    PolicyLossOutput,
    add_rollout_log_ratio_penalty,
    compute_policy_loss,
)


@dataclass(frozen=True)
class CorrectedLossOutput:
    """loss: scalar with gradient w.r.t. `logprobs`; correction: IS weights, masks, metrics;
    policy: the per-token loss `[batch, seq]` and clip statistics (partial sums)."""

    loss: Tensor
    correction: RolloutCorrectionOutput
    policy: PolicyLossOutput


def policy_loss_for(rc_cfg: RolloutCorrectionConfig, loss_cfg: PolicyLossConfig | None) -> PolicyLossConfig:
    """The policy loss the correction config selects: `reinforce` (pure IS), `cispo`, `gmpo`, `vespo` override
    `loss_cfg.loss_type` (presets choose them); `ppo_clip` keeps `loss_cfg` as given."""
    loss_cfg = loss_cfg or PolicyLossConfig()
    if rc_cfg.pure_is:
        return replace(loss_cfg, loss_type="reinforce", clip_ratio_c=None)
    if rc_cfg.loss_type in ("cispo", "gmpo", "vespo"):
        return replace(loss_cfg, loss_type=rc_cfg.loss_type, clip_ratio_c=None, **objective_params(rc_cfg))
    return loss_cfg


def rollout_corrected_policy_loss(
    logprobs: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    rc_cfg: RolloutCorrectionConfig,
    loss_cfg: PolicyLossConfig | None = None,
    *,
    old_logprobs: Tensor | None = None,
    num_global_tokens: Count | None = None,
    num_global_seqs: Count | None = None,
    norm_length: int | float | None = None,
    is_weight_mean: float | Tensor | None = None,
) -> CorrectedLossOutput:
    """The rollout-corrected policy loss of one (micro)batch.

    logprobs: `[batch, seq]` pi_theta, with gradient. rollout_logprobs: `[batch, seq]`.
    advantages: `[batch, seq]` (or `[batch]`, broadcast over tokens). loss_mask: `[batch, seq]`.
    old_logprobs: `[batch, seq]` pi_old; required in decoupled mode, ignored in bypass mode.
    num_global_tokens / num_global_seqs: the loss denominator (see `aggregate_loss`).
    """
    loss_cfg = policy_loss_for(rc_cfg, loss_cfg)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)
    if rc_cfg.bypass_mode:
        # pi_old is pi_rollout: judge and weight the current policy against the rollout.
        reference = rollout_logprobs
        correction = compute_rollout_correction(logprobs.detach(), rollout_logprobs, loss_mask, rc_cfg,
                                                is_weight_mean=is_weight_mean, advantages=advantages)
    else:
        if old_logprobs is None:
            raise ValueError("decoupled mode (bypass_mode=false) needs old_logprobs: the trainer's re-scored "
                             "logprobs of the rollout tokens; set bypass_mode=true to skip that pass")
        reference = old_logprobs
        correction = compute_rollout_correction(old_logprobs, rollout_logprobs, loss_mask, rc_cfg,
                                                is_weight_mean=is_weight_mean, advantages=advantages)

    # Where no IS applies the weights are exactly 1 on kept tokens, so passing them is a no-op.
    is_weights = correction.is_weights if rc_cfg.rollout_is is not None and not rc_cfg.metrics_only else None
    policy = compute_policy_loss(logprobs, reference.detach(), advantages, correction.keep_mask, loss_cfg,
                                 is_weights=is_weights)
    if rc_cfg.rollout_log_ratio_penalty > 0:
        policy = add_rollout_log_ratio_penalty(policy, logprobs, rollout_logprobs, correction.keep_mask,
                                               rc_cfg.rollout_log_ratio_penalty)
    if num_global_tokens is None:
        num_global_tokens = count_for_denominator(correction.denominator_mask, "token-mean")
    if num_global_seqs is None:
        num_global_seqs = count_for_denominator(correction.denominator_mask, "seq-mean-token-mean")
    loss = aggregate_loss(policy.per_token_loss, correction.keep_mask, loss_cfg.loss_agg_mode,
                          num_global_tokens=num_global_tokens, num_global_seqs=num_global_seqs,
                          norm_length=norm_length)
    return CorrectedLossOutput(loss=loss, correction=correction, policy=policy)


__all__ = ["CorrectedLossOutput", "policy_loss_for", "rollout_corrected_policy_loss"]
