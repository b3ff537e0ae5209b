"""Per-token policy-gradient losses with the importance-sampling hook.

Each loss returns a ``[batch, seq]`` per-token loss (reduce it with
:func:`nemo_rollout_correction.core.aggregation.aggregate_loss`) and unreduced partial sums for the
metrics, so a distributed caller can all-reduce them with the rest of the step's partials.

Conventions (docs/design.md): ``logprobs`` is pi_theta and carries the gradient; ``old_logprobs`` is
pi_old; ``is_weights`` are the applied rollout-correction weights and are always detached (decision
6), while the PPO ratio keeps its gradient. Masked positions give exactly 0 loss and 0 gradient
even if any input there is NaN/inf: inputs are replaced with ``torch.where`` *before* any
arithmetic, because a masked NaN that reaches ``exp`` turns into a NaN gradient even when the
output is masked afterwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from torch import Tensor

from nemo_rollout_correction.core.aggregation import LOSS_AGG_MODES, LossAggMode, masked_sum, safe_divide
from nemo_rollout_correction.core.objective_params import ObjectiveParams

__all__ = [
    "POLICY_LOSS_TYPES",
    "PolicyLossConfig",
    "PolicyLossOutput",
    "PolicyLossType",
    "add_rollout_log_ratio_penalty",
    "cispo_loss",
    "compute_policy_loss",
    "gmpo_clipped_log_ratio",
    "gmpo_loss",
    "gspo_loss",
    "ppo_clip_loss",
    "reinforce_loss",
    "stats_to_means",
    "vespo_log_weight_sums",
    "vespo_loss",
]

PolicyLossType = Literal["ppo_clip", "gspo", "reinforce", "cispo", "gmpo", "vespo"]
POLICY_LOSS_TYPES: tuple[str, ...] = get_args(PolicyLossType)

# Log-ratios are clamped before exp (DESIGN decision 3): an overflow caps instead of becoming inf.
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class PolicyLossOutput:
    """A per-token policy loss and its metric partial sums."""

    per_token_loss: Tensor
    """``[batch, seq]`` loss per token, 0 at masked positions."""
    stats: dict[str, Tensor] = field(default_factory=dict)
    """Detached float64 0-dim partial sums (``*_sum`` and ``num_tokens``); sum them across ranks."""


@dataclass(frozen=True)
class PolicyLossConfig(ObjectiveParams):
    """Which policy loss to use and how to clip and reduce it (the CISPO/GMPO/VESPO parameters are
    `ObjectiveParams`' fields)."""

    loss_type: PolicyLossType = "ppo_clip"
    """``ppo_clip`` (PPO, optional dual clip), ``gspo`` (sequence-level ratio), ``reinforce``, ``cispo`` or
    ``gmpo`` (geometric mean of the clipped token ratios) or ``vespo`` (Gamma-shaped sequence weight)."""
    clip_ratio_low: float = 0.2
    """eps_low: the ratio is clipped below at ``1 - clip_ratio_low``; in [0, 1)."""
    clip_ratio_high: float = 0.2
    """eps_high: the ratio is clipped above at ``1 + clip_ratio_high``; >= 0 (DAPO uses 0.28)."""
    clip_ratio_c: float | None = None
    """Dual-clip constant for negative advantages (> 1, typically 3.0); ``None`` disables it."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How the caller reduces the per-token loss; see ``aggregate_loss``."""
    def __post_init__(self) -> None:
        if self.loss_type not in POLICY_LOSS_TYPES:
            raise ValueError(
                f"loss_type must be one of {', '.join(POLICY_LOSS_TYPES)}; got {self.loss_type!r}"
            )
        _check_clip_ratios(self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c)
        if self.clip_ratio_c is not None and self.loss_type != "ppo_clip":
            raise ValueError(
                f"clip_ratio_c (dual clip) only applies to loss_type='ppo_clip'; "
                f"set it to None for loss_type={self.loss_type!r}"
            )
        self.check_objective_params()
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(
                f"loss_agg_mode must be one of {', '.join(LOSS_AGG_MODES)}; got {self.loss_agg_mode!r}"
            )


def compute_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig,
    *,
    is_weights: Tensor | None = None,
    seq_statistic: Tensor | None = None,
) -> PolicyLossOutput:
    """Dispatch to the loss named by ``cfg.loss_type``; all tensors ``[batch, seq]``.

    The result is per-token: reduce it with ``aggregate_loss(out.per_token_loss, mask,
    cfg.loss_agg_mode, ...)`` and the step's global denominator. ``seq_statistic`` (``[batch]``,
    GMPO and VESPO only): the per-sequence statistic over the whole sequence (GMPO's mean clipped
    log-ratio, VESPO's summed log weight), which a context-parallel caller completes over its CP
    group; None computes it from the local tokens.
    """
    if cfg.loss_type == "ppo_clip":
        return ppo_clip_loss(
            logprobs,
            old_logprobs,
            advantages,
            mask,
            is_weights=is_weights,
            clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high,
            clip_ratio_c=cfg.clip_ratio_c,
        )
    if cfg.loss_type == "gspo":
        return gspo_loss(
            logprobs,
            old_logprobs,
            advantages,
            mask,
            is_weights=is_weights,
            clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high,
        )
    if cfg.loss_type == "cispo":
        return cispo_loss(logprobs, old_logprobs, advantages, mask, is_weights=is_weights,
                          ratio_low=cfg.cispo_ratio_low, ratio_high=cfg.cispo_ratio_high)
    if cfg.loss_type == "gmpo":
        return gmpo_loss(logprobs, old_logprobs, advantages, mask, is_weights=is_weights,
                         ratio_low=cfg.gmpo_ratio_low, ratio_high=cfg.gmpo_ratio_high,
                         seq_mean_log_ratio=seq_statistic)
    if cfg.loss_type == "vespo":
        return vespo_loss(logprobs, old_logprobs, advantages, mask, is_weights=is_weights, k_pos=cfg.vespo_k_pos,
                          lambda_pos=cfg.vespo_lambda_pos, k_neg=cfg.vespo_k_neg, lambda_neg=cfg.vespo_lambda_neg,
                          seq_log_weight=seq_statistic)
    return reinforce_loss(logprobs, advantages, mask, is_weights=is_weights, old_logprobs=old_logprobs)


def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    is_weights: Tensor | None = None,
    ratio_low: float = 0.0,
    ratio_high: float = 5.0,
) -> PolicyLossOutput:
    """CISPO (MiniMax-M1): clip the IS ratio, not the update; every token keeps its gradient.

    ``r = exp(clamp(logprobs - old_logprobs, -20, 20))``;
    ``loss = -sg(clamp(r, ratio_low, ratio_high)) * A * logprobs`` per token, times the detached IS
    weights. Unlike PPO's ``max(-A r, -A clip(r))``, a token whose ratio is out of bounds still
    contributes ``-clip(r) * A * grad(logprobs)``: the clip bounds the weight, it never zeroes a token.
    ``old_logprobs`` is the anchor: pi_old in decoupled mode, pi_rollout in bypass mode (SkyRL's
    ``cispo_anchor='old'`` / ``'rollout'``).

    Args:
        logprobs, old_logprobs, advantages, mask, is_weights: as in :func:`ppo_clip_loss`.
        ratio_low, ratio_high: bounds on the ratio r itself (design decision 1), ``0 <= low <= high``.

    Returns:
        per-token loss and stats: ``pg_clipfrac_sum`` (tokens whose ratio was outside the bounds),
        ``pg_clipfrac_lower_sum`` (those below ``ratio_low``), ``cispo_weight_sum`` (the applied
        clipped ratio), ``ppo_kl_sum`` and ``num_tokens``.
    """
    ObjectiveParams(cispo_ratio_low=ratio_low, cispo_ratio_high=ratio_high).check_objective_params()
    keep, (logprobs, old_logprobs, advantages) = _mask_inputs(
        mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages
    )
    log_ratio = (logprobs - old_logprobs).detach()
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weight = ratio.clamp(ratio_low, ratio_high)
    per_token_loss = _apply_is_weights(-advantages * weight * logprobs, is_weights, keep)
    below, above = ratio < ratio_low, ratio > ratio_high
    stats = _token_stats(keep, log_ratio, below | above, below, {"cispo_weight_sum": _sum64(weight, keep)})
    return PolicyLossOutput(per_token_loss, stats)


def gmpo_clipped_log_ratio(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *, ratio_low: float, ratio_high: float
) -> Tensor:
    """GMPO's per-token clipped log-ratio ``[batch, seq]`` (gradient through ``logprobs`` where unclipped).

    PPO's pessimistic one-sided clip written in log space: ``min(l, log high)`` where ``A > 0`` and
    ``max(l, log low)`` where ``A <= 0``, ``l = logprobs - old_logprobs`` (TRL's
    ``where(A > 0, minimum(l, clamp(l)), maximum(l, clamp(l)))``, the same values).
    Inputs must already be finite (see ``_mask_inputs``).
    """
    log_ratio = logprobs - old_logprobs
    clamped = log_ratio.clamp(math.log(ratio_low), math.log(ratio_high))
    return torch.where(advantages > 0, torch.minimum(log_ratio, clamped), torch.maximum(log_ratio, clamped))


def gmpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    is_weights: Tensor | None = None,
    ratio_low: float = math.exp(-0.4),
    ratio_high: float = math.exp(0.4),
    seq_mean_log_ratio: Tensor | None = None,
) -> PolicyLossOutput:
    """GMPO (geometric-mean policy optimisation): the token ratios of a sequence combined by their
    geometric mean, each clipped first (PPO's one-sided clip, in log space).

    Sequence objective: ``-A_i * G_i`` with ``G_i = exp(mean_t c_t)`` over the kept tokens, ``c_t`` the
    clipped log-ratio (:func:`gmpo_clipped_log_ratio`). Per token the loss is
    ``-A * exp(sg(m_i) + c_t - sg(c_t))``: its value is ``-A_i G_i`` on every token of the sequence and
    its gradient ``-A_i G_i grad(c_t)``, so the ``seq-mean-token-mean`` aggregation gives exactly the
    gradient of ``-A_i G_i`` averaged over sequences (TRL's GMPO). Other aggregation modes weight each
    sequence's term by its token count instead. IS weights (decoupled mode) multiply per token.

    Args:
        logprobs, old_logprobs, advantages, mask, is_weights: as in :func:`ppo_clip_loss`.
        ratio_low, ratio_high: the clip range of each token ratio, ``0 < low <= 1 <= high``.
        seq_mean_log_ratio: ``[batch]`` ``m_i``, the masked mean of the clipped log-ratios over the
            whole sequence; a context-parallel caller passes it (CP-reduced). ``None``: from the local
            tokens.

    Returns:
        per-token loss and stats ``pg_clipfrac_sum`` (tokens whose clip was active: ``A > 0`` above
        ``high`` or ``A < 0`` below ``low``), ``pg_clipfrac_lower_sum`` (the latter),
        ``gmpo_seq_ratio_sum`` (``G_i`` summed over the kept tokens), ``ppo_kl_sum``, ``num_tokens``.
    """
    ObjectiveParams(gmpo_ratio_low=ratio_low, gmpo_ratio_high=ratio_high).check_objective_params()
    keep, (logprobs, old_logprobs, advantages) = _mask_inputs(
        mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages
    )
    clipped = gmpo_clipped_log_ratio(logprobs, old_logprobs, advantages, ratio_low=ratio_low, ratio_high=ratio_high)
    clipped = torch.where(keep, clipped, torch.zeros_like(clipped))
    if seq_mean_log_ratio is None:
        seq_mean_log_ratio = safe_divide(clipped.detach().sum(dim=-1), keep.sum(dim=-1).to(clipped.dtype))
    elif seq_mean_log_ratio.shape != logprobs.shape[:1]:
        raise ValueError(
            f"seq_mean_log_ratio must be [batch] = {tuple(logprobs.shape[:1])}, got {tuple(seq_mean_log_ratio.shape)}"
        )
    log_seq = seq_mean_log_ratio.detach().to(clipped.dtype).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    seq_ratio = torch.exp(log_seq.unsqueeze(-1) + clipped - clipped.detach())
    per_token_loss = _apply_is_weights(-advantages * seq_ratio, is_weights, keep)
    log_ratio = (logprobs - old_logprobs).detach()
    low = (advantages < 0) & (log_ratio < math.log(ratio_low))
    high = (advantages > 0) & (log_ratio > math.log(ratio_high))
    stats = _token_stats(keep, log_ratio, low | high, low, {"gmpo_seq_ratio_sum": _sum64(seq_ratio, keep)})
    return PolicyLossOutput(per_token_loss, stats)


VESPO_LOG_W_MIN = math.log(1e-8)
"""VESPO's floor on the log sequence weight (TRL's clamp, log 1e-8)."""


def vespo_log_weight_sums(logprobs: Tensor, old_logprobs: Tensor, keep: Tensor,
                          is_weights: Tensor | None = None) -> Tensor:
    """VESPO's per-sequence log weight over this rank's tokens ``[batch]`` (detached; sum them over CP).

    ``sum_t clamp(logprobs - old_logprobs, +-20) + sum_t clamp(log is_weight_t, log 1e-8, 20)`` over the
    kept tokens: the log of the sequence ratio pi_theta / pi_old times the token IS weights (TRL folds its
    vLLM correction into the weight). Inputs at masked positions are ignored.
    """
    zeros = torch.zeros_like(logprobs)
    log_ratio = torch.where(keep, (logprobs.detach() - old_logprobs.detach()), zeros).clamp(-LOG_RATIO_CLAMP,
                                                                                           LOG_RATIO_CLAMP)
    total = log_ratio.sum(dim=-1)
    if is_weights is not None:
        ones = torch.ones_like(is_weights)
        log_is = torch.log(torch.where(keep, is_weights.detach(), ones)).clamp(VESPO_LOG_W_MIN, LOG_RATIO_CLAMP)
        total = total + log_is.to(total.dtype).sum(dim=-1)
    return total


def vespo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    is_weights: Tensor | None = None,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
    seq_log_weight: Tensor | None = None,
) -> PolicyLossOutput:
    """VESPO (variational sequence-level soft policy optimisation): a smooth Gamma-shaped weight of the
    sequence's importance ratio instead of a clip.

    ``w = exp(clamp(log w_seq, log 1e-8, 20))`` with ``log w_seq`` from :func:`vespo_log_weight_sums` (the token
    IS weights enter there, not as a factor on the loss); ``phi(w) = exp(lambda + k log w - lambda w)``
    (``phi(1) = 1``, largest at ``w = k / lambda``, vanishing for ``w -> 0`` and ``w -> inf``), ``(k, lambda)``
    by the sign of the advantage (``A >= 0``: the ``_pos`` pair); per token ``-sg(phi) * A * logprobs``.

    Args:
        logprobs, old_logprobs, advantages, mask: as in :func:`ppo_clip_loss`.
        is_weights: the token IS weights (decoupled mode), folded into ``w``.
        k_pos, lambda_pos, k_neg, lambda_neg: the kernel's parameters, ``k >= 0``, ``lambda > 0``.
        seq_log_weight: ``[batch]`` ``log w_seq`` over the whole sequence (a context-parallel caller passes the
            CP sum); None: from the local tokens.

    Returns:
        per-token loss and stats ``vespo_phi_sum`` (``phi`` summed over the kept tokens), ``ppo_kl_sum``,
        ``num_tokens`` and zero clip counts (VESPO has no clip).
    """
    ObjectiveParams(vespo_k_pos=k_pos, vespo_lambda_pos=lambda_pos, vespo_k_neg=k_neg,
                    vespo_lambda_neg=lambda_neg).check_objective_params()
    keep, (logprobs, old_logprobs, advantages) = _mask_inputs(
        mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages
    )
    if is_weights is not None and is_weights.shape != logprobs.shape:
        raise ValueError(f"is_weights shape {tuple(is_weights.shape)} does not match {tuple(logprobs.shape)}")
    if seq_log_weight is None:
        seq_log_weight = vespo_log_weight_sums(logprobs, old_logprobs, keep, is_weights)
    elif seq_log_weight.shape != logprobs.shape[:1]:
        raise ValueError(f"seq_log_weight must be [batch] = {tuple(logprobs.shape[:1])}, "
                         f"got {tuple(seq_log_weight.shape)}")
    log_w = seq_log_weight.detach().to(logprobs.dtype).clamp(VESPO_LOG_W_MIN, LOG_RATIO_CLAMP).unsqueeze(-1)
    nonneg = advantages >= 0
    k = torch.where(nonneg, k_pos, k_neg).to(logprobs.dtype)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).to(logprobs.dtype)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    per_token_loss = torch.where(keep, -phi * advantages * logprobs, torch.zeros_like(logprobs))
    log_ratio = (logprobs - old_logprobs).detach()
    stats = _token_stats(keep, log_ratio, None, None, {"vespo_phi_sum": _sum64(phi, keep)})  # nothing is clipped
    return PolicyLossOutput(per_token_loss, stats)


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    is_weights: Tensor | None = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate per token, optionally dual-clipped, times the detached IS weights.

    ``ratio = exp(clamp(logprobs - old_logprobs, -20, 20))``;
    ``loss = max(-A * ratio, -A * clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))``;
    with ``clip_ratio_c`` and ``A < 0`` the loss is further capped at ``-A * clip_ratio_c`` so a huge
    ratio on a bad token cannot blow up the update (dual-clip PPO).

    Args:
        logprobs: ``[batch, seq]`` pi_theta, with gradient.
        old_logprobs: ``[batch, seq]`` pi_old.
        advantages: ``[batch, seq]`` (see ``advantages.broadcast_to_tokens``).
        mask: ``[batch, seq]`` keep mask.
        is_weights: ``[batch, seq]`` rollout-correction weights, detached here; ``None`` means 1.

    Returns:
        per-token loss and stats ``pg_clipfrac_sum`` (tokens where clipping changed the loss),
        ``pg_clipfrac_lower_sum`` (tokens where the dual clip bound), ``ppo_kl_sum`` (sum of
        ``old_logprobs - logprobs``) and ``num_tokens``.
    """
    _check_clip_ratios(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    keep, (logprobs, old_logprobs, advantages) = _mask_inputs(
        mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages
    )
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))

    loss, is_clipped = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    is_dual_clipped = torch.zeros_like(is_clipped)
    if clip_ratio_c is not None:
        dual_bound = -advantages * clip_ratio_c
        is_dual_clipped = (advantages < 0) & (loss > dual_bound)
        loss = torch.where(is_dual_clipped, dual_bound, loss)

    per_token_loss = _apply_is_weights(loss, is_weights, keep)
    stats = _token_stats(keep, log_ratio, is_clipped, is_dual_clipped)
    return PolicyLossOutput(per_token_loss, stats)


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    is_weights: Tensor | None = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    seq_mean_log_ratio: Tensor | None = None,
) -> PolicyLossOutput:
    """GSPO: PPO clipping on the sequence-level ratio ``s_i = exp(mean_t(logprobs - old_logprobs))``.

    Per token the ratio is ``exp(logprobs - sg(logprobs) + sg(seq_mean_log_ratio))``: its value is
    ``s_i`` and its gradient ``s_i * grad(logprobs_t)``, so with ``seq-mean-token-mean`` aggregation
    the gradient is GSPO's ``s_i * mean_t grad(log pi_t)``.

    Args:
        logprobs, old_logprobs, advantages, mask, is_weights: as in :func:`ppo_clip_loss`.
        seq_mean_log_ratio: ``[batch]`` precomputed masked mean of ``logprobs - old_logprobs`` per
            sequence. A context-parallel caller must pass it (per-sequence sums and counts
            all-reduced over cp), because each cp rank only sees part of a sequence. ``None``:
            computed from the local tokens.

    Returns:
        per-token loss and stats as :func:`ppo_clip_loss` (clip fraction counted per token;
        ``pg_clipfrac_lower_sum`` is always 0).
    """
    _check_clip_ratios(clip_ratio_low, clip_ratio_high, None)
    keep, (logprobs, old_logprobs, advantages) = _mask_inputs(
        mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages
    )
    log_ratio = logprobs - old_logprobs
    if seq_mean_log_ratio is None:
        num_seq_tokens = keep.sum(dim=-1).to(log_ratio.dtype)
        seq_mean_log_ratio = safe_divide(log_ratio.sum(dim=-1), num_seq_tokens)
    elif seq_mean_log_ratio.shape != logprobs.shape[:1]:
        raise ValueError(
            f"seq_mean_log_ratio must be [batch] = {tuple(logprobs.shape[:1])}, "
            f"got {tuple(seq_mean_log_ratio.shape)}"
        )

    log_seq_ratio = logprobs - logprobs.detach() + seq_mean_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(log_seq_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    loss, is_clipped = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)

    per_token_loss = _apply_is_weights(loss, is_weights, keep)
    stats = _token_stats(keep, log_ratio, is_clipped, None)
    return PolicyLossOutput(per_token_loss, stats)


def reinforce_loss(
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    is_weights: Tensor | None = None,
    old_logprobs: Tensor | None = None,
) -> PolicyLossOutput:
    """Off-policy REINFORCE, no clipping: ``-sg(w) * A * logprobs`` per token.

    With ``w = pi_theta / pi_rollout`` (detached) this is the pure-IS estimator; ``w = 1`` is plain
    REINFORCE.

    Args:
        logprobs, advantages, mask, is_weights: as in :func:`ppo_clip_loss`.
        old_logprobs: optional ``[batch, seq]``, used only for the ``ppo_kl_sum`` metric.

    Returns:
        per-token loss and stats with the same keys as :func:`ppo_clip_loss` (clip counts are 0;
        ``ppo_kl_sum`` only when ``old_logprobs`` is given).
    """
    inputs = {"logprobs": logprobs, "advantages": advantages}
    if old_logprobs is not None:
        inputs["old_logprobs"] = old_logprobs
    keep, masked = _mask_inputs(mask, **inputs)
    logprobs, advantages = masked[0], masked[1]

    per_token_loss = _apply_is_weights(-advantages * logprobs, is_weights, keep)
    no_clip = torch.zeros_like(keep)
    stats = {"pg_clipfrac_sum": _count(no_clip), "pg_clipfrac_lower_sum": _count(no_clip)}
    if old_logprobs is not None:
        stats["ppo_kl_sum"] = _sum64(masked[2] - logprobs, keep)
    stats["num_tokens"] = _count(keep)
    return PolicyLossOutput(per_token_loss, stats)


def add_rollout_log_ratio_penalty(
    out: PolicyLossOutput, logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, coef: float
) -> PolicyLossOutput:
    """``out`` plus the squared log-ratio penalty towards the rollout policy on the kept tokens.

    ``penalty = coef * (logprobs - sg(rollout_logprobs))**2`` per token (gradient
    ``2 * coef * (logprobs - rollout_logprobs)``), not multiplied by the IS weights: prime-rl's
    ``kl_tau * log_importance_ratio**2`` (after Kimi K2.5), a trust region towards the policy that
    sampled the data that stays smooth where a clip or mask would be a step. Adds the partial sum
    ``rollout_sq_log_ratio_sum`` (sum of the squared log-ratios over kept tokens).

    Args:
        out: the policy loss of the same tokens.
        logprobs: ``[batch, seq]`` pi_theta, with gradient.
        rollout_logprobs: ``[batch, seq]`` pi_rollout (may be NaN/inf outside ``mask``).
        mask: ``[batch, seq]`` keep mask.
        coef: tau >= 0.
    """
    if not (coef >= 0.0 and math.isfinite(coef)):
        raise ValueError(f"rollout_log_ratio_penalty must be a finite number >= 0, got {coef}")
    keep, (logprobs, rollout_logprobs) = _mask_inputs(mask, logprobs=logprobs, rollout_logprobs=rollout_logprobs)
    sq_log_ratio = (logprobs - rollout_logprobs.detach()).square()
    penalty = torch.where(keep, coef * sq_log_ratio, torch.zeros_like(sq_log_ratio))
    stats = {**out.stats, "rollout_sq_log_ratio_sum": _sum64(sq_log_ratio, keep)}
    return PolicyLossOutput(out.per_token_loss + penalty, stats)


def stats_to_means(stats: dict[str, Tensor]) -> dict[str, Tensor]:
    """Turn (already reduced) partial sums into per-token means, for single-process use.

    ``"<name>_sum"`` becomes ``"<name>" = sum / num_tokens`` (0.0 when there are no tokens);
    ``num_tokens`` is passed through. Example: ``pg_clipfrac_sum`` -> ``pg_clipfrac``.
    """
    if "num_tokens" not in stats:
        raise ValueError(f"stats need a 'num_tokens' entry to divide by; got keys {sorted(stats)}")
    num_tokens = stats["num_tokens"]
    means = {"num_tokens": num_tokens}
    for name, value in stats.items():
        if name.endswith("_sum"):
            means[name.removesuffix("_sum")] = safe_divide(value, num_tokens.to(value.dtype))
    return means


def _check_clip_ratios(clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float | None) -> None:
    # Written as "not (ok)" so that NaN fails every check.
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(
            f"clip_ratio_low must be in [0, 1) so that 1 - clip_ratio_low > 0; got {clip_ratio_low}"
        )
    if not clip_ratio_high >= 0.0:
        raise ValueError(f"clip_ratio_high must be >= 0; got {clip_ratio_high}")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1 or None; got {clip_ratio_c}")


def _mask_inputs(mask: Tensor, **tensors: Tensor) -> tuple[Tensor, list[Tensor]]:
    """Check shapes and zero every input at masked positions (before any arithmetic)."""
    first_name, first = next(iter(tensors.items()))
    if first.dim() != 2:
        raise ValueError(f"{first_name} must be [batch, seq], got shape {tuple(first.shape)}")
    for name, tensor in tensors.items():
        if tensor.shape != first.shape:
            hint = " (see broadcast_to_tokens for [batch] advantages)" if name == "advantages" else ""
            raise ValueError(
                f"{name} shape {tuple(tensor.shape)} does not match {first_name} shape "
                f"{tuple(first.shape)}{hint}"
            )
    if mask.shape != first.shape:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} does not match {first_name} shape {tuple(first.shape)}"
        )
    keep = mask if mask.dtype == torch.bool else mask != 0
    return keep, [torch.where(keep, t, torch.zeros_like(t)) for t in tensors.values()]


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip_ratio_low: float, clip_ratio_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic ``max(-A * r, -A * clip(r))`` and where the clipped term won."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _apply_is_weights(loss: Tensor, is_weights: Tensor | None, keep: Tensor) -> Tensor:
    """Multiply by the detached IS weights and zero the masked positions."""
    if is_weights is not None:
        if is_weights.shape != loss.shape:
            raise ValueError(f"is_weights shape {tuple(is_weights.shape)} does not match {tuple(loss.shape)}")
        # Replace masked weights first: 0 * inf in the product would be NaN in the gradient.
        weights = torch.where(keep, is_weights.detach(), torch.ones_like(is_weights))
        loss = loss * weights
    return torch.where(keep, loss, torch.zeros_like(loss))


def _count(flags: Tensor) -> Tensor:
    return flags.sum().to(torch.float64)


def _sum64(values: Tensor, keep: Tensor) -> Tensor:
    # float64 partial sums stay exact for counts and accurate for long batches once all-reduced.
    return masked_sum(values.detach().to(torch.float64), keep)


def _token_stats(keep: Tensor, log_ratio: Tensor, clipped: Tensor | None, clipped_lower: Tensor | None,
                 extra: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """The per-token losses' shared stats over `keep` (`[batch, seq]`): clip counts (None = never clipped), the
    objective's own sums (`extra`), the PPO KL sum and the token count, in that order."""
    nothing = torch.zeros_like(keep)
    return {
        "pg_clipfrac_sum": _count((nothing if clipped is None else clipped) & keep),
        "pg_clipfrac_lower_sum": _count((nothing if clipped_lower is None else clipped_lower) & keep),
        **(extra or {}),
        "ppo_kl_sum": _sum64(-log_ratio, keep),
        "num_tokens": _count(keep),
    }
