"""IS weights from log-ratios: truncation (TIS) and masking (MIS/IcePop), in log space.

`[lower, upper]` always bound the IS ratio rho at the configured level: the token ratio, the
sequence product, or the geometric mean (docs/design.md decision 1).
"""

from __future__ import annotations

import math

from torch import Tensor

from nemo_rollout_correction.core.config import RolloutCorrectionConfig


def bound_weights(ratio: Tensor, log_ratio: Tensor, cfg: RolloutCorrectionConfig) -> tuple[Tensor, Tensor | None]:
    """Apply the configured bound to raw IS ratios.

    ratio: rho (any shape), log_ratio: log rho clamped to +-20 (same shape).
    Returns `(weights, in_bounds)`: truncate mode gives min(rho, upper) (and max(., lower) when
    two-sided) with in_bounds None; mask mode gives rho inside [lower, upper] and 0 outside,
    with the boolean in_bounds the caller uses to edit the keep mask (decision 2).
    """
    upper, lower = cfg.rollout_is_threshold, cfg.is_lower
    if cfg.rollout_is_mode == "truncate":
        if cfg.rollout_is_two_sided:
            return ratio.clamp(min=lower, max=upper), None
        return ratio.clamp(max=upper), None
    # Compare in log space: exact for the tiny geometric bounds (1 +- 1e-3) where a ratio
    # rounded to float32 could land on the wrong side.
    in_bounds = (log_ratio >= math.log(lower)) & (log_ratio <= math.log(upper))
    # ratio is finite (its log was clamped), so a float 0/1 product is exact and cheaper than where.
    return ratio * in_bounds.to(ratio.dtype), in_bounds


def normalize_is_weights_(is_weights: Tensor, mean: float | Tensor) -> None:
    """Divide `is_weights` `[batch, seq]` in place by `mean` (the global mean of kept weights).

    A non-positive or non-finite mean leaves the weights unchanged (nothing kept: nothing to scale).
    """
    mean_value = float(mean)
    if math.isfinite(mean_value) and mean_value > 0:
        is_weights.div_(mean_value)
