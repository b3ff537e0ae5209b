"""The typed rollout-correction configuration and its validation.

One frozen dataclass holds every knob. Field names follow verl's `rollout_correction` section
where the concept is the same (so YAML and dashboards port), with our additions for the
geometric level, the veto, non-finite handling and metrics-only mode. Cross-field rules raise
`ValueError` naming the field and what is allowed; nothing here asserts on user input.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from nemo_rollout_correction.core.objective_params import ObjectiveParams

IsLevel = Literal["token", "sequence", "geometric"]
IsMode = Literal["truncate", "mask"]
LossType = Literal["ppo_clip", "reinforce", "cispo", "gmpo", "vespo"]
NonFinitePolicy = Literal["raise", "mask_token", "reject_sequence"]
OldLogprobSource = Literal["forward", "loglinear"]
RsStatistic = Literal["k1", "k2", "k3"]
RsGranularity = Literal["token", "seq_sum", "seq_mean", "seq_max"]
SequenceUnit = Literal["trajectory", "turn"]
SEQUENCE_UNITS: tuple[str, ...] = ("trajectory", "turn")

IS_LEVELS: tuple[str, ...] = get_args(IsLevel)
IS_MODES: tuple[str, ...] = get_args(IsMode)
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
NONFINITE_POLICIES: tuple[str, ...] = get_args(NonFinitePolicy)
OLD_LOGPROB_SOURCES: tuple[str, ...] = get_args(OldLogprobSource)

# Every rejection criterion we accept: granularity x statistic. A k1 maximum is not offered
# (its two-sided ratio bound has no single "worst token"); use token_k1 or the veto instead.
RS_OPTIONS: tuple[str, ...] = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


@dataclass(frozen=True)
class RejectionCriterion:
    """One parsed rejection-sampling criterion (for example `seq_mean_k1` with `[0.999, 1.001]`).

    For k1 criteria `[lower, upper]` bound the IS ratio rho itself (token ratio, sequence
    product, or geometric mean), as docs/design.md decision 1 demands. For k2/k3 criteria `upper`
    bounds the divergence statistic and `lower` is None.
    """

    name: str
    granularity: RsGranularity
    statistic: RsStatistic
    upper: float
    lower: float | None

    @property
    def is_token_level(self) -> bool:
        """True when the criterion rejects single tokens rather than whole sequences."""
        return self.granularity == "token"


@dataclass(frozen=True)
class RolloutCorrectionConfig(ObjectiveParams):
    """How to measure and correct the rollout/training mismatch.

    Build one with `RolloutCorrectionConfig.from_preset(name, **overrides)` or directly.
    Construction validates every field; invalid values raise `ValueError`. The CISPO/GMPO/VESPO parameters
    are `ObjectiveParams`' fields (shared with `PolicyLossConfig`).
    """

    rollout_is: IsLevel | None = None
    """IS level: `token`, `sequence` (product of ratios) or `geometric` (length-normalised); None = no IS."""

    rollout_is_mode: IsMode = "truncate"
    """`truncate` (TIS: min(rho, upper)) or `mask` (MIS/IcePop: rho outside [lower, upper] is rejected)."""

    rollout_is_threshold: float = 2.0
    """Upper bound on the IS ratio rho; must be > 0 (and > 1 for a meaningful truncation)."""

    rollout_is_threshold_lower: float | None = None
    """Lower bound on rho for `mask` mode or a two-sided truncation; None means 1 / rollout_is_threshold."""

    rollout_is_target_ess: float | None = None
    """Adaptive threshold: each step the upper bound becomes the largest U <= rollout_is_threshold (now a cap) whose
    truncated token weights min(rho, U) keep an effective sample size fraction >= this target, in (0, 1]; None = off."""

    rollout_is_two_sided: bool = False
    """In `truncate` mode also clamp from below: w = clamp(rho, lower, upper)."""

    rollout_is_batch_normalize: bool = False
    """Divide the applied weights by their (global, when passed in) mean so they average to 1."""

    rollout_rs: str | None = None
    """Rejection criteria, comma separated, combined with AND (e.g. `token_k1,seq_mean_k3`); None = off."""

    rollout_rs_threshold: str | float | None = None
    """Thresholds, one per criterion or one shared: k1 takes ratio bounds `lower_upper` or `upper` (lower =
    1/upper); k2/k3 take an upper bound on the divergence."""

    rollout_token_veto_threshold: float | None = 1e-4
    """Reject a whole sequence if any token ratio is below this (a catastrophic token); None = no veto."""

    bypass_mode: bool = False
    """Bypass: no old-logprob recompute; PPO clips against pi_rollout (pass the current logprobs as old_logprobs)."""

    # ---- pi_old without a forward (core/loglinear.py) ----
    old_logprob_source: OldLogprobSource = "forward"
    """Decoupled mode's pi_old: `forward` (a no-grad re-scoring pass) or `loglinear` (interpolate rollout and
    current logprobs, AReaL's prox_logp_method=loglinear; no pass)."""

    loglinear_check_every: int = 0
    """With old_logprob_source=loglinear: also run the forward every N steps and log the approximation error
    (0: never)."""

    loss_type: LossType = "ppo_clip"
    """Policy loss: `ppo_clip`, `reinforce` (bypass only: pure IS, -sg(w) * A * log pi_theta), `cispo`, `gmpo` or
    `vespo` (math.md)."""

    metrics_only: bool = False
    """Compute every diagnostic but apply nothing: weights are 1 and only the non-finite policy edits the mask."""

    nonfinite_policy: NonFinitePolicy = "reject_sequence"
    """What a NaN/inf logprob on a loss token does: `raise`, `mask_token`, or `reject_sequence`."""

    nonfinite_max_fraction: float | None = None
    """Fail fast (ValueError) when more than this fraction of loss tokens is non-finite; None = never."""

    rejected_tokens_in_denominator: bool = False
    """Keep rejected tokens in the loss denominator (they still contribute 0 to the numerator)."""

    # -- advantage- and probability-aware masks (docs/math.md, "Frontier masks") ---------------
    opsm_threshold: float | None = None
    """OPSM: reject a sequence with advantage < 0 whose mean(rollout_logprobs - old_logprobs) exceeds it; None = off."""

    kpop_threshold: float | None = None
    """KPop: reject a token whose symmetric binary KL of its trainer vs rollout probability exceeds this; None = off."""

    dppo_tv_threshold: float | None = None
    """DPPO-TV: reject a token with advantage > 0 whose p_train - p_rollout exceeds this; None = off."""

    dppo_tv_threshold_low: float | None = None
    """DPPO-TV bound for advantage <= 0: reject when p_rollout - p_train exceeds it; None = dppo_tv_threshold."""

    rollout_log_ratio_penalty: float = 0.0
    """tau: add tau * (log pi_theta - log pi_rollout)^2 to each kept token's loss (prime-rl's kl_tau); 0 = off."""

    seq_logprob_error_threshold: float | None = None
    """Reject a sequence whose mean_t exp(|log pi_train - log pi_rollout|) exceeds this (>= 1; NeMo-RL); None = off."""

    m2po_threshold: float | None = None
    """M2PO: mask the tokens with the largest squared log-ratio until the step's mean squared log-ratio over the
    rest is below this bound (AReaL's m2_threshold, 0.04 in its example); None = off."""
    sequence_unit: SequenceUnit = "trajectory"
    """Multi-turn: the unit of sequence-level/geometric IS, sequence rejection and the veto: `trajectory` (the whole
    response) or `turn` (each policy turn alone; needs the turn of each token, core/segments.py)."""

    _criteria: tuple[RejectionCriterion, ...] = field(default=(), init=False, repr=False, compare=False)
    _m2po_cutoff: float | None = field(default=None, init=False, repr=False, compare=False)
    """The step's M2PO cutoff on the squared log-ratio (kept: <= cutoff), set by `with_step_thresholds`."""
    _is_threshold_cap: float | None = field(default=None, init=False, repr=False, compare=False)
    """With rollout_is_target_ess: the configured cap, once rollout_is_threshold holds the step's chosen bound."""

    def __post_init__(self) -> None:
        _check_choice("rollout_is", self.rollout_is, IS_LEVELS, allow_none=True)
        _check_choice("rollout_is_mode", self.rollout_is_mode, IS_MODES)
        _check_choice("loss_type", self.loss_type, LOSS_TYPES)
        _check_choice("nonfinite_policy", self.nonfinite_policy, NONFINITE_POLICIES)
        _check_choice("sequence_unit", self.sequence_unit, SEQUENCE_UNITS)
        _check_old_logprob_source(self.old_logprob_source, self.loglinear_check_every, self.bypass_mode)
        for name in ("rollout_is_two_sided", "rollout_is_batch_normalize", "bypass_mode", "metrics_only",
                     "rejected_tokens_in_denominator"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        _check_positive("rollout_is_threshold", self.rollout_is_threshold)
        if self.rollout_is_threshold_lower is not None:
            _check_positive("rollout_is_threshold_lower", self.rollout_is_threshold_lower)
        if self.is_lower > self.rollout_is_threshold:
            source = "rollout_is_threshold_lower" if self.rollout_is_threshold_lower is not None else (
                "the implied lower bound 1/rollout_is_threshold")
            raise ValueError(
                f"{source} ({self.is_lower:g}) must be <= rollout_is_threshold ({self.rollout_is_threshold:g}); "
                "a single upper bound must be >= 1"
            )
        if self.rollout_token_veto_threshold is not None:
            _check_positive("rollout_token_veto_threshold", self.rollout_token_veto_threshold)
            if self.rollout_token_veto_threshold >= 1.0:
                raise ValueError("rollout_token_veto_threshold is a token ratio below which a sequence is "
                                 f"rejected; it must be in (0, 1) or null, got {self.rollout_token_veto_threshold!r}")
        if self.nonfinite_max_fraction is not None and not 0.0 <= self.nonfinite_max_fraction <= 1.0:
            raise ValueError(f"nonfinite_max_fraction must be in [0, 1] or null, got {self.nonfinite_max_fraction!r}")
        if self.bypass_mode and self.loss_type == "ppo_clip" and self.rollout_is is not None:
            raise ValueError("rollout_is must be null with bypass_mode=true and loss_type='ppo_clip': the PPO "
                             "ratio pi_theta/pi_rollout already is the IS correction (weights would apply twice); "
                             "use loss_type='reinforce' for explicit IS weights")
        if self.bypass_mode and self.loss_type == "cispo" and self.rollout_is is not None:
            raise ValueError("rollout_is must be null with bypass_mode=true and loss_type='cispo': CISPO's clipped "
                             "ratio pi_theta/pi_rollout already is the IS correction (SkyRL's cispo_anchor='rollout' "
                             "refuses TIS for the same reason)")
        if self.bypass_mode and self.loss_type == "gmpo" and self.rollout_is is not None:
            raise ValueError("rollout_is must be null with bypass_mode=true and loss_type='gmpo': GMPO's clipped "
                             "ratio pi_theta/pi_rollout already is the IS correction (weights would apply twice)")
        if self.bypass_mode and self.loss_type == "vespo" and self.rollout_is is not None:
            raise ValueError("rollout_is must be null with bypass_mode=true and loss_type='vespo': VESPO's sequence "
                             "weight of pi_theta/pi_rollout already is the IS correction (weights would apply twice)")
        self.check_objective_params()
        if self.loss_type == "reinforce" and not self.bypass_mode:
            raise ValueError("loss_type='reinforce' (pure IS) needs bypass_mode=true; in decoupled mode choose "
                             "the policy loss with PolicyLossConfig.loss_type")
        if self.rollout_is is None and self.rollout_is_batch_normalize:
            raise ValueError("rollout_is_batch_normalize=true needs an IS level: set rollout_is to one of "
                             f"{list(IS_LEVELS)}")
        for name in ("opsm_threshold", "dppo_tv_threshold", "dppo_tv_threshold_low"):
            value = getattr(self, name)
            if value is not None:
                _check_nonnegative(name, value)
        if self.kpop_threshold is not None:
            _check_positive("kpop_threshold", self.kpop_threshold)
        if self.dppo_tv_threshold_low is not None and self.dppo_tv_threshold is None:
            raise ValueError("dppo_tv_threshold_low needs dppo_tv_threshold (the bound for positive advantages); "
                             "set both or leave both null")
        _check_nonnegative("rollout_log_ratio_penalty", self.rollout_log_ratio_penalty)
        if self.seq_logprob_error_threshold is not None:
            _check_positive("seq_logprob_error_threshold", self.seq_logprob_error_threshold)
            if self.seq_logprob_error_threshold < 1.0:
                raise ValueError("seq_logprob_error_threshold bounds a mean of exp(|log-ratio|) (always >= 1): it must "
                                 f"be >= 1 (NVIDIA's recipes use 2) or null, got {self.seq_logprob_error_threshold!r}")
        if self.rollout_is_target_ess is not None:
            _check_target_ess(self)
        if self.m2po_threshold is not None:
            _check_positive("m2po_threshold", self.m2po_threshold)
            if self.old_logprob_source == "loglinear":
                raise ValueError("m2po_threshold needs the step's log-ratios before the update (a pre-pass); "
                                 "old_logprob_source='loglinear' has none: use 'forward' or set m2po_threshold null")
        object.__setattr__(self, "_criteria", _parse_rejection(self.rollout_rs, self.rollout_rs_threshold))

    # ---- derived views -------------------------------------------------------------------

    @property
    def is_lower(self) -> float:
        """The effective lower IS bound: the explicit one, or 1 / upper."""
        if self.rollout_is_threshold_lower is not None:
            return self.rollout_is_threshold_lower
        return 1.0 / self.rollout_is_threshold

    @property
    def rejection_criteria(self) -> tuple[RejectionCriterion, ...]:
        """The parsed `rollout_rs` criteria, in the order given (duplicates removed)."""
        return self._criteria

    @property
    def dppo_tv_low(self) -> float | None:
        """The effective DPPO-TV bound for tokens with advantage <= 0 (None when DPPO-TV is off)."""
        return self.dppo_tv_threshold_low if self.dppo_tv_threshold_low is not None else self.dppo_tv_threshold

    @property
    def needs_advantages(self) -> bool:
        """True when a mask reads the advantages (OPSM, DPPO-TV): the correction must be given them."""
        return self.opsm_threshold is not None or self.dppo_tv_threshold is not None

    @property
    def needs_step_thresholds(self) -> bool:
        """True when a threshold is chosen from the whole step's log-ratios (M2PO): the correction of a
        microbatch needs `with_step_thresholds` first (`distributed.resolve_step_config` across ranks)."""
        return self.m2po_threshold is not None or self.rollout_is_target_ess is not None

    @property
    def step_thresholds_resolved(self) -> bool:
        """Whether every step-level threshold this config needs has been set (`with_step_thresholds`)."""
        return ((self.m2po_threshold is None or self._m2po_cutoff is not None)
                and (self.rollout_is_target_ess is None or self._is_threshold_cap is not None))

    @property
    def is_threshold_cap(self) -> float:
        """The largest upper IS bound an adaptive step may choose: the configured rollout_is_threshold."""
        return self._is_threshold_cap if self._is_threshold_cap is not None else self.rollout_is_threshold

    @property
    def m2po_cutoff(self) -> float | None:
        """The step's M2PO cutoff on the squared log-ratio (tokens above it are masked); None until resolved."""
        return self._m2po_cutoff

    def with_step_thresholds(self, *, m2po_cutoff: float | None = None,
                             is_threshold: float | None = None) -> RolloutCorrectionConfig:
        """A copy with the step-level thresholds set: M2PO's cutoff (equal to `self` under ==, step data) and the
        adaptive IS bound (it replaces rollout_is_threshold; the configured value is kept as the cap)."""
        cap = self.is_threshold_cap
        new = dataclasses.replace(self) if is_threshold is None else dataclasses.replace(
            self, rollout_is_threshold=is_threshold)
        object.__setattr__(new, "_m2po_cutoff", m2po_cutoff)
        object.__setattr__(new, "_is_threshold_cap", cap if is_threshold is not None else None)
        return new

    def carry_step_thresholds(self, other: RolloutCorrectionConfig) -> RolloutCorrectionConfig:
        """`other` (a `dataclasses.replace` of self) with self's step-level thresholds (replace drops them)."""
        object.__setattr__(other, "_m2po_cutoff", self._m2po_cutoff)
        object.__setattr__(other, "_is_threshold_cap", self._is_threshold_cap)
        return other

    @property
    def pure_is(self) -> bool:
        """Off-policy REINFORCE against pi_rollout (bypass + reinforce): no PPO clipping."""
        return self.bypass_mode and self.loss_type == "reinforce"

    # ---- construction helpers ------------------------------------------------------------

    @classmethod
    def field_names(cls) -> list[str]:
        """Every user-settable field name."""
        return [f.name for f in dataclasses.fields(cls) if f.init]

    @classmethod
    def preset_names(cls) -> list[str]:
        """Every accepted preset name (seed names, verl's names and aliases), sorted."""
        from nemo_rollout_correction.core.presets import preset_names

        return preset_names()

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> RolloutCorrectionConfig:
        """The preset `name` with `overrides` applied (field=value); unknown names raise ValueError."""
        from nemo_rollout_correction.core.presets import preset_fields

        return cls.from_dict({**preset_fields(name), **overrides})

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RolloutCorrectionConfig:
        """Build from a plain mapping, rejecting unknown keys with a close-match suggestion."""
        known = cls.field_names()
        for key in values:
            if key not in known:
                hint = difflib.get_close_matches(key, known, n=1)
                suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
                raise ValueError(f"unknown rollout-correction field {key!r}{suggestion}; valid fields: {known}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """All user-settable fields as a plain dict (the inverse of `from_dict`)."""
        return {name: getattr(self, name) for name in self.field_names()}


def _check_choice(name: str, value: object, allowed: tuple[str, ...], *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value not in allowed:
        options = list(allowed) + (["null"] if allow_none else [])
        raise ValueError(f"{name} must be one of {options}, got {value!r}")


def _check_old_logprob_source(source: str, check_every: object, bypass_mode: bool) -> None:
    _check_choice("old_logprob_source", source, OLD_LOGPROB_SOURCES)
    if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 0:
        raise ValueError(f"loglinear_check_every must be an integer >= 0 (0: never), got {check_every!r}")
    if source == "loglinear" and bypass_mode:
        raise ValueError("old_logprob_source='loglinear' replaces decoupled mode's old-logprob forward; "
                         "bypass_mode=true has no such pass: set bypass_mode=false or old_logprob_source='forward'")
    if check_every and source != "loglinear":
        raise ValueError(f"loglinear_check_every={check_every} only applies with old_logprob_source='loglinear' "
                         f"(got {source!r}); set it to 0")


def _check_target_ess(cfg: RolloutCorrectionConfig) -> None:
    value = cfg.rollout_is_target_ess
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"rollout_is_target_ess is an effective-sample-size fraction: a number in (0, 1] or null, "
                         f"got {value!r}")
    if cfg.rollout_is != "token" or cfg.rollout_is_mode != "truncate" or cfg.rollout_is_two_sided:
        raise ValueError("rollout_is_target_ess (the adaptive threshold) tunes the upper bound of one-sided token "
                         "TIS: it needs rollout_is='token', rollout_is_mode='truncate', rollout_is_two_sided=false "
                         f"(got {cfg.rollout_is!r}, {cfg.rollout_is_mode!r}, {cfg.rollout_is_two_sided})")
    if cfg.rollout_is_threshold < 1.0:
        raise ValueError("rollout_is_threshold is the cap of the adaptive threshold (rollout_is_target_ess): it must "
                         f"be >= 1, got {cfg.rollout_is_threshold!r}")
    if cfg.old_logprob_source == "loglinear":
        raise ValueError("rollout_is_target_ess needs the step's log-ratios before the update (a pre-pass); "
                         "old_logprob_source='loglinear' has none: use 'forward' or set rollout_is_target_ess null")


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _check_nonnegative(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _parse_rejection(options: str | None, thresholds: str | float | None) -> tuple[RejectionCriterion, ...]:
    """Parse verl-style `rollout_rs` / `rollout_rs_threshold` strings into criteria."""
    if options is None:
        return ()
    if not isinstance(options, str):
        raise ValueError(f"rollout_rs must be a comma-separated string of {list(RS_OPTIONS)}, got {options!r}")
    names: list[str] = []
    for raw in options.split(","):
        name = raw.strip()
        if not name:
            continue
        if name not in RS_OPTIONS:
            raise ValueError(f"rollout_rs option {name!r} is not supported; choose from {list(RS_OPTIONS)}")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"rollout_rs is empty; give one or more of {list(RS_OPTIONS)} or null")
    if thresholds is None:
        raise ValueError(f"rollout_rs={options!r} needs rollout_rs_threshold (one value per criterion or one "
                         "shared; k1 takes 'lower_upper' ratio bounds, k2/k3 an upper bound)")
    if isinstance(thresholds, bool) or not isinstance(thresholds, (str, int, float)):
        raise ValueError(f"rollout_rs_threshold must be a number or a string, got {thresholds!r}")
    specs = [s.strip() for s in str(thresholds).split(",") if s.strip()]
    if len(specs) == 1:
        specs = specs * len(names)
    if len(specs) != len(names):
        raise ValueError(f"rollout_rs_threshold has {len(specs)} entries for {len(names)} criteria {names}; "
                         "give one shared value or one per criterion")
    return tuple(_parse_criterion(name, spec) for name, spec in zip(names, specs, strict=True))


def _parse_criterion(name: str, spec: str) -> RejectionCriterion:
    granularity, statistic = name.rsplit("_", 1)
    parts = spec.split("_")
    try:
        numbers = [float(p) for p in parts]
    except ValueError as exc:
        raise ValueError(f"rollout_rs_threshold entry {spec!r} for {name} is not a number") from exc
    for value in numbers:
        _check_positive(f"rollout_rs_threshold ({name})", value)
    if statistic == "k1":
        if len(numbers) == 1:
            upper = numbers[0]
            lower = 1.0 / upper
        elif len(numbers) == 2:
            lower, upper = numbers
        else:
            raise ValueError(f"rollout_rs_threshold for {name} must be 'upper' or 'lower_upper', got {spec!r}")
        if lower > upper:
            raise ValueError(f"rollout_rs_threshold for {name}: lower ({lower}) must be <= upper ({upper})")
        return RejectionCriterion(name, granularity, "k1", upper, lower)  # type: ignore[arg-type]
    if len(numbers) != 1:
        raise ValueError(f"rollout_rs_threshold for {name} takes a single upper bound on the divergence, "
                         f"got {spec!r}")
    return RejectionCriterion(name, granularity, statistic, numbers[0], None)  # type: ignore[arg-type]
