"""One optimizer update's loss, from plan to metrics: `plan_step` -> `microbatch_loss` -> `finish_step`.

An update (one mini-batch, see `grpo.num_mini_batches`) needs its loss denominator before the first
microbatch's backward. Where it comes from is a property of the configuration, decided once
(`denominator_strategy`) and carried in a frozen `StepPlan`:

- `decoupled` (`bypass_mode=false`): corrections from `old_logprobs` (scored before any update),
  reduced over dp x cp;
- `rollout_only` (bypass, rejection independent of pi_theta): counted from the rollout logprobs alone;
- `prepass` (bypass, rejection by pi_theta, with batch-normalised IS or a KL penalty): a no-grad
  forward with the update's weights, then as `decoupled`;
- `post_scaled` (bypass, rejection by pi_theta, otherwise): none in advance; the numerators are
  backpropagated and Megatron's `finalize_model_grads` divides the gradients by the summed counts
  (its `calculate_per_token_loss` path), exact and without an extra forward.

`microbatch_loss` is the last-stage loss of one microbatch under the plan (policy loss plus the KL
penalty to the reference policy), returning what to backpropagate, the count Megatron divides by (only
for `post_scaled`) and the microbatch's statistics, which a `StepStats` accumulates. `finish_step` reduces
those statistics over dp x cp in one all-reduce and returns the update's loss and `rollout_corr/*`
metrics. docs/losses.md has the derivations; docs/training.md the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from torch import Tensor

from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.kl_penalty import KLEstimator, kl_penalty
from nemo_rollout_correction.core.segments import Segments
from nemo_rollout_correction.core.stats import Partials
from nemo_rollout_correction.distributed.correction import MicrobatchCorrection, reduce_step_metrics
from nemo_rollout_correction.distributed.groups import ParallelGroups
from nemo_rollout_correction.distributed.runtime import all_reduce_sums
from nemo_rollout_correction.losses.rollout_corrected_pg import (
    RolloutCorrectedPolicyLoss,
    StepDenominators,
    rejection_is_predictable,
)

__all__ = [
    "OBJECTIVE_SUMS",
    "DenominatorStrategy",
    "StepPlan",
    "StepResult",
    "StepStats",
    "denominator_strategy",
    "finish_step",
    "microbatch_loss",
    "objective_sum_keys",
    "plan_step",
]

DenominatorStrategy = Literal["decoupled", "rollout_only", "prepass", "post_scaled"]

# Policy-loss partial sums every rank reports, even with no microbatch (the all-reduce needs equal keys).
_POLICY_SUMS = ("num_tokens", "pg_clipfrac_sum", "pg_clipfrac_lower_sum", "ppo_kl_sum")


OBJECTIVE_SUMS = ("cispo_weight_sum", "rollout_sq_log_ratio_sum", "gmpo_seq_ratio_sum", "vespo_phi_sum")
"""Every objective-specific partial sum (`objective_sum_keys` picks those of a config): an update's
`StepResult.sums` holds exactly the configured ones, so a report can read them from the result."""


def objective_sum_keys(cfg: RolloutCorrectionConfig) -> tuple[str, ...]:
    """The policy-loss partial sums of `cfg`'s objective beyond the common ones (`cispo_weight_sum` for CISPO,
    `rollout_sq_log_ratio_sum` with the squared log-ratio penalty), per token like `pg_clipfrac_sum`. Keys
    that do not apply are absent rather than 0, so a log never shows a number that measured nothing."""
    keys: tuple[str, ...] = ()
    if cfg.loss_type == "cispo":
        keys += (OBJECTIVE_SUMS[0],)
    if cfg.rollout_log_ratio_penalty > 0:
        keys += (OBJECTIVE_SUMS[1],)
    if cfg.loss_type == "gmpo":
        keys += (OBJECTIVE_SUMS[2],)
    if cfg.loss_type == "vespo":
        keys += (OBJECTIVE_SUMS[3],)
    return keys


def denominator_strategy(cfg: RolloutCorrectionConfig, *, kl_penalty_on: bool) -> DenominatorStrategy:
    """How this configuration gets an update's loss denominator (see the module table).

    `old_logprob_source="loglinear"` is planned like bypass mode: its pi_old interpolates the rollout and the
    current policy's logprobs (`core.loglinear`), so it, and the correction judged on it, exist only inside
    the loss pass.
    """
    if not cfg.bypass_mode and cfg.old_logprob_source == "forward":
        return "decoupled"
    step_wide = cfg.rollout_is_batch_normalize or cfg.needs_step_thresholds  # need the whole step's values first
    if rejection_is_predictable(cfg) and not step_wide:
        return "rollout_only"
    if step_wide or kl_penalty_on:
        return "prepass"
    return "post_scaled"


@dataclass(frozen=True)
class StepPlan:
    """One update's loss plan on this rank (last pipeline stage; other stages hold an empty plan).

    corrections: per microbatch, from the pre-pass (`decoupled`, `prepass`), else None (the loss pass
        corrects). denominators: the update's global counts (None for `post_scaled`).
    metrics: `rollout_corr/*` of the pre-pass (empty otherwise: `finish_step` reduces the loss pass's).
    """

    strategy: DenominatorStrategy
    corrections: tuple[MicrobatchCorrection, ...] | None
    denominators: StepDenominators | None
    metrics: dict[str, float]
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"

    @property
    def needs_current_logprobs(self) -> bool:
        """Whether `plan_step` needs a no-grad pass of the current policy (`prepass`)."""
        return self.strategy == "prepass"


@dataclass
class StepStats:
    """Per-microbatch statistics of an update's loss pass, summed on this rank (`finish_step` reduces them)."""

    sums: dict[str, float] = field(default_factory=lambda: {"loss": 0.0, "kl_penalty": 0.0, "num_denominator": 0.0})
    partials: list[Partials] = field(default_factory=list)

    def add(self, key: str, value: float) -> None:
        """Add `value` to the sum `key`."""
        self.sums[key] = self.sums.get(key, 0.0) + value


@dataclass(frozen=True)
class StepResult:
    """An update's statistics over dp x cp: `sums` (loss, kl_penalty, policy partial sums), `rc_metrics`."""

    sums: dict[str, float]
    rc_metrics: dict[str, float]


def plan_step(
    loss_fn: RolloutCorrectedPolicyLoss,
    strategy: DenominatorStrategy,
    rollout_logprobs: Sequence[Tensor],
    loss_masks: Sequence[Tensor],
    groups: ParallelGroups,
    *,
    reference_logprobs: Sequence[Tensor] | None = None,
    advantages: Sequence[Tensor] | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    segments: Sequence[Segments | None] | None = None,
) -> StepPlan:
    """The update's plan from this rank's microbatch shards (`[rows, local_seq]` each).

    reference_logprobs: `old_logprobs` for `decoupled`, the current policy's no-grad logprobs for
        `prepass`; unused otherwise.
    advantages: per microbatch `[rows]`, for the masks that read them (OPSM, DPPO-TV); None when the
        configuration has none of them. segments: per microbatch, multi-turn turns (`sequence_unit=turn`).
        Collectives: a CP all-gather per microbatch and one all-reduce over
        dp x cp (not for `post_scaled`). Every dp x cp rank of the last stage calls it.
    """
    kl = {"kl_coef": kl_coef, "kl_estimator": kl_estimator}
    if strategy == "post_scaled":
        return StepPlan(strategy, None, None, {}, **kl)  # type: ignore[arg-type]
    if strategy == "rollout_only":
        pairs = list(zip(rollout_logprobs, loss_masks, strict=True))
        return StepPlan(strategy, None, loss_fn.rollout_only_denominators(pairs, groups, segments), {}, **kl)  # type: ignore[arg-type]
    if reference_logprobs is None:
        raise ValueError(f"the {strategy!r} plan needs reference logprobs (old_logprobs or a no-grad pre-pass)")
    per_microbatch = advantages if advantages is not None else [None] * len(rollout_logprobs)
    loss_fn = loss_fn.for_step(list(zip(reference_logprobs, rollout_logprobs, loss_masks, strict=True)), groups)
    turns = segments if segments is not None else [None] * len(rollout_logprobs)
    corrections = tuple(
        loss_fn.correct(ref, rollout, mask, groups, advantages=adv, segments=seg)
        for ref, rollout, mask, adv, seg in zip(reference_logprobs, rollout_logprobs, loss_masks, per_microbatch,
                                                turns, strict=True)
    )
    step = loss_fn.prepare_step(corrections, groups)
    return StepPlan(strategy, corrections, StepDenominators.from_step(step), step.metrics, **kl)  # type: ignore[arg-type]


def microbatch_loss(
    plan: StepPlan,
    loss_fn: RolloutCorrectedPolicyLoss,
    index: int,
    logprobs: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    groups: ParallelGroups,
    stats: StepStats,
    *,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    segments: Segments | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Microbatch `index`'s loss under `plan`: `(loss to backpropagate, count or None)`; adds to `stats`.

    logprobs: `[rows, local_seq]` pi_theta with gradient. The count (0-dim) is returned only for
    `post_scaled` (and not for `token-sum`): Megatron sums it over microbatches and dp x cp and divides
    the gradients by the total. The KL penalty (`kl_coef > 0` and `ref_logprobs` given) is
    `kl_coef * sum(kl over kept tokens) / num_global_tokens`.
    """
    correction = None if plan.corrections is None else plan.corrections[index]
    out = loss_fn(logprobs, rollout_logprobs, advantages, loss_mask, groups, plan.denominators,
                  old_logprobs=old_logprobs, correction=correction, segments=segments)
    post_scaled = plan.denominators is None
    loss = out.loss_sum if post_scaled else out.loss
    if plan.kl_coef > 0 and ref_logprobs is not None and plan.denominators is not None:
        kl = kl_penalty(logprobs, ref_logprobs, plan.kl_estimator, mask=out.correction.keep_mask)
        kl_term = kl.sum() / max(plan.denominators.num_global_tokens, 1.0)
        loss = loss + plan.kl_coef * kl_term
        stats.add("kl_penalty", float(kl_term.detach()))
    stats.add("loss", float((out.loss_sum if post_scaled else out.loss).detach()))  # the policy loss, without KL
    stats.add("num_denominator", float(out.num_denominator))
    stats.partials.append(out.partials)
    for key, value in out.policy_stats.items():
        stats.add(key, float(value))
    count = out.num_denominator if post_scaled and loss_fn.agg_mode != "token-sum" else None
    return loss, count


def finish_step(plan: StepPlan, stats: StepStats, rc_cfg: RolloutCorrectionConfig, groups: ParallelGroups,
                *, agg_mode: str) -> StepResult:
    """Reduce an update's statistics over dp x cp (one all-reduce; plus the metric reduction when the loss
    pass corrected). `sums["loss"]` is the update's policy loss (post-scaled: divided by the global count)."""
    rc_metrics = dict(plan.metrics)
    if plan.corrections is None:  # corrected inside the loss pass: metrics from its partials
        rc_metrics = reduce_step_metrics(stats.partials, rc_cfg, groups)
    local = dict(stats.sums)
    for key in _POLICY_SUMS + objective_sum_keys(rc_cfg):
        local.setdefault(key, 0.0)
    sums = all_reduce_sums(local, groups)
    if plan.denominators is None and agg_mode != "token-sum":
        sums["loss"] /= max(sums["num_denominator"], 1.0)
    return StepResult(sums=sums, rc_metrics=rc_metrics)
