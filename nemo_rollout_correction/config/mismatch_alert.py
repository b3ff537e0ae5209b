"""`rollout_correction.alert`: the thresholds of the mismatch alarm, and the section that carries them.

The `rollout_correction` section is core's `RolloutCorrectionConfig` (one definition of verl's knobs, shared
with the preset YAML files) plus this one `alert` sub-section. The alarm is the trainer's business, not the
correction's, so it is added here by a subclass (`RolloutCorrectionSection`) instead of a field of the core
class: the presets, the correction math and the distributed reductions never see it. The alarm itself is
`trainer/mismatch_alert.py`; what the thresholds mean is docs/acceptable_mismatch.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from nemo_rollout_correction.core.config import RolloutCorrectionConfig

__all__ = ["ALERT_THRESHOLDS", "MismatchAlertConfig", "RolloutCorrectionSection"]

ALERT_THRESHOLDS = ("k3_kl", "kl", "max_abs_log_ratio")
"""The watched mismatch statistics, one absolute threshold (and one floor override) each:
`k3_kl` = `rollout_corr/k3_kl`, `kl` = `rollout_corr/kl` (k1), `max_abs_log_ratio` =
max(|`rollout_corr/token_log_ratio_max`|, |`rollout_corr/token_log_ratio_min`|), the step's max |dlogp|."""


def _help(default: Any, text: str) -> Any:
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class MismatchAlertConfig:
    """When a step's trainer/engine mismatch raises the alarm (trainer/mismatch_alert.py).

    A statistic fires when it exceeds its absolute threshold, or `factor_over_floor` x its floor (the healthy
    value of this run's engine dtype x trainer dtype x dense/MoE setting, docs/audit.md, or `floor_<name>`).
    Every threshold null (the default): no alarm.
    """

    factor_over_floor: float | None = _help(
        None, "Fire when k3_kl or max |dlogp| exceeds this factor x the healthy floor of the run's setting "
              "(docs/audit.md's table, or floor_*); null: off.")
    k3_kl: float | None = _help(None, "Absolute threshold on rollout_corr/k3_kl; null: off.")
    kl: float | None = _help(None, "Absolute threshold on rollout_corr/kl (k1); null: off.")
    max_abs_log_ratio: float | None = _help(
        None, "Absolute threshold on the step's max |trainer - engine| token logprob; null: off.")
    floor_k3_kl: float | None = _help(
        None, "Your model's healthy k3_kl (from nrc audit) for factor_over_floor; null: the built-in table.")
    floor_max_abs_log_ratio: float | None = _help(
        None, "Your model's healthy max |dlogp| (from nrc audit) for factor_over_floor; null: the built-in table.")
    strict: bool = _help(False, "Stop the run with an error (MLflow run FAILED) at the first step that fires.")
    lag_reference_steps: int = _help(
        3, "Async / partial rollouts: factor_over_floor holds tokens L >= 1 versions old to factor x the least "
           "lag-L k3 of the run's earlier steps (checked once this many steps had such tokens), not to the floor.")

    def __post_init__(self) -> None:
        for name in ("factor_over_floor", *ALERT_THRESHOLDS, "floor_k3_kl", "floor_max_abs_log_ratio"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(f"alert.{name}={value!r} is not allowed: a finite number > 0, or null (off)")
        if self.factor_over_floor is not None and self.factor_over_floor < 1:
            raise ValueError(f"alert.factor_over_floor={self.factor_over_floor!r} is not allowed: must be >= 1 "
                             "(a healthy run sits at its floor)")
        if (isinstance(self.lag_reference_steps, bool) or not isinstance(self.lag_reference_steps, int)
                or self.lag_reference_steps < 1):
            raise ValueError(f"alert.lag_reference_steps={self.lag_reference_steps!r} is not allowed: an integer >= 1")
        if not isinstance(self.strict, bool):
            raise ValueError(f"alert.strict must be true or false, got {self.strict!r}")

    @property
    def enabled(self) -> bool:
        """Whether any threshold is set."""
        return self.factor_over_floor is not None or any(getattr(self, n) is not None for n in ALERT_THRESHOLDS)


@dataclass(frozen=True, eq=False)
class RolloutCorrectionSection(RolloutCorrectionConfig):
    """The `rollout_correction` section: core's `RolloutCorrectionConfig` plus the `alert` sub-section."""

    alert: MismatchAlertConfig = field(default_factory=MismatchAlertConfig)
    """The mismatch alarm (docs/acceptable_mismatch.md): thresholds over the per-step rollout_corr metrics,
    a warning and an MLflow tag when one fires, and with alert.strict a stop."""

    def __post_init__(self) -> None:
        if isinstance(self.alert, dict):  # from_dict / from_preset with a plain mapping
            object.__setattr__(self, "alert", MismatchAlertConfig(**self.alert))
        super().__post_init__()
        values = super().to_dict()
        values.pop("alert", None)
        object.__setattr__(self, "_core", RolloutCorrectionConfig.from_dict(values))  # for __eq__ and __hash__

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> RolloutCorrectionSection:
        """The preset `name` with `overrides` (`alert` among them) applied."""
        section = super().from_preset(name, **overrides)
        assert isinstance(section, RolloutCorrectionSection)
        return section

    def to_dict(self) -> dict[str, Any]:
        """Every user-settable field as plain data (`alert` as a mapping)."""
        out = super().to_dict()
        out["alert"] = dataclasses.asdict(self.alert)
        return out

    def correction(self) -> RolloutCorrectionConfig:
        """The core config alone (without `alert`)."""
        core: RolloutCorrectionConfig = self.__dict__["_core"]
        return core

    # A section with the default (off) alarm equals the core config with the same fields, so code and tests
    # that compare with `RolloutCorrectionConfig.from_preset(...)` keep working; the hash is the core one.
    def __eq__(self, other: object) -> bool:
        if isinstance(other, RolloutCorrectionSection):
            return self.correction() == other.correction() and self.alert == other.alert
        if isinstance(other, RolloutCorrectionConfig):
            return self.alert == MismatchAlertConfig() and self.correction() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.correction())
