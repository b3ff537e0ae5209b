"""The parameters of the CISPO, GMPO and VESPO policy losses, written once.

Both `RolloutCorrectionConfig` (the user-facing `rollout_correction` section: a preset picks the loss) and
`PolicyLossConfig` (what `compute_policy_loss` reads) carry these fields. They inherit them from
`ObjectiveParams` so that each field, its default, its documentation and its check exist in one place; the
correction config hands them to the loss config with `objective_params(cfg)`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["ObjectiveParams", "objective_params"]


@dataclass(frozen=True)
class ObjectiveParams:
    """Bounds and shapes of the 2026 objectives (docs/math.md); only the selected `loss_type` reads its own."""

    cispo_ratio_low: float = 0.0
    """CISPO: lower bound on the ratio r before the stop-gradient, >= 0 (0 = no lower bound, ScaleRL / SkyRL
    default)."""

    cispo_ratio_high: float = 5.0
    """CISPO: upper bound on the ratio r, > 0 and >= cispo_ratio_low (5.0 = SkyRL's default
    1 + cispo_eps_clip_high = 1 + 4)."""

    gmpo_ratio_low: float = math.exp(-0.4)
    """GMPO: lower clip bound on each token ratio, in (0, 1] (TRL's default exp(-epsilon), epsilon = 0.4)."""

    gmpo_ratio_high: float = math.exp(0.4)
    """GMPO: upper clip bound on each token ratio, >= 1 (TRL's default exp(epsilon_high) = exp(0.4))."""

    vespo_k_pos: float = 2.0
    """VESPO: power k of the Gamma kernel phi(w) = exp(lambda + k log w - lambda w) for advantages >= 0, >= 0
    (TRL: 2)."""

    vespo_lambda_pos: float = 3.0
    """VESPO: decay lambda of the kernel for advantages >= 0, > 0 (TRL: 3)."""

    vespo_k_neg: float = 3.0
    """VESPO: power k for advantages < 0, >= 0 (TRL: 3)."""

    vespo_lambda_neg: float = 2.0
    """VESPO: decay lambda for advantages < 0, > 0 (TRL: 2)."""

    def check_objective_params(self) -> None:
        """Raise `ValueError` naming the first field out of its range (NaN and inf included)."""
        for name in ("cispo_ratio_low", "vespo_k_pos", "vespo_k_neg"):
            _check_number(name, getattr(self, name), minimum=0.0, strict=False)
        for name in ("cispo_ratio_high", "gmpo_ratio_low", "gmpo_ratio_high", "vespo_lambda_pos",
                     "vespo_lambda_neg"):
            _check_number(name, getattr(self, name), minimum=0.0, strict=True)
        if self.cispo_ratio_low > self.cispo_ratio_high:
            raise ValueError(f"cispo_ratio_low ({self.cispo_ratio_low:g}) must be <= cispo_ratio_high "
                             f"({self.cispo_ratio_high:g}): they bound the ratio r = pi_theta / pi_old")
        if self.gmpo_ratio_low > 1.0:
            raise ValueError(f"gmpo_ratio_low must be in (0, 1] (it clips the token ratio from below), got "
                             f"{self.gmpo_ratio_low!r}")
        if self.gmpo_ratio_high < 1.0:
            raise ValueError(f"gmpo_ratio_high must be >= 1 (it clips the token ratio from above), got "
                             f"{self.gmpo_ratio_high!r}")


def objective_params(cfg: ObjectiveParams) -> dict[str, Any]:
    """{field: value} of `cfg`'s objective parameters, for `dataclasses.replace` onto another config."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ObjectiveParams)}


def _check_number(name: str, value: object, *, minimum: float, strict: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < minimum or (strict and value == minimum):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
