"""Hypothesis properties of compute_rollout_correction over random logprobs (extreme ones included),
masks and configs: bounded weights, shrinking masks, monotone rejection, no NaN/inf, and the
non-finite policies."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_rollout_correction import RolloutCorrectionConfig, compute_rollout_correction
from nemo_rollout_correction.core.config import RS_OPTIONS

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PPL_KEYS = ("rollout_corr/training_ppl", "rollout_corr/rollout_ppl")

LOG_RATIO = st.one_of(
    st.floats(-0.5, 0.5, width=32),
    st.floats(-30.0, 30.0, width=32),
    st.sampled_from([1e4, -1e4, 0.0, 20.0, -20.0]),
)
ROLLOUT = st.floats(-20.0, 0.0, width=32)
SPECIAL = st.sampled_from([math.nan, math.inf, -math.inf])


@st.composite
def batches(draw: Any, nonfinite: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    n = rows * cols
    lr = torch.tensor(draw(st.lists(LOG_RATIO, min_size=n, max_size=n)), dtype=torch.float64).view(rows, cols)
    rollout = torch.tensor(draw(st.lists(ROLLOUT, min_size=n, max_size=n)), dtype=torch.float64).view(rows, cols)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))).view(rows, cols)
    old = (rollout + lr).float()
    rollout = rollout.float()
    if nonfinite:
        for _ in range(draw(st.integers(0, 4))):
            r, c = draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1))
            target = old if draw(st.booleans()) else rollout
            target[r, c] = draw(SPECIAL)
    return old, rollout, mask


def criterion(draw: Any, name: str) -> str:
    if name.endswith("k1"):
        if draw(st.booleans()):
            return repr(draw(st.floats(1.0, 4.0)))
        return f"{draw(st.floats(0.2, 1.0))!r}_{draw(st.floats(1.0, 4.0))!r}"
    return repr(draw(st.floats(1e-3, 2.0)))


@st.composite
def configs(draw: Any, **fixed: Any) -> RolloutCorrectionConfig:
    level = draw(st.sampled_from([None, "token", "sequence", "geometric"]))
    fields: dict[str, Any] = {
        "rollout_is": level,
        "rollout_is_mode": draw(st.sampled_from(["truncate", "mask"])),
        "rollout_is_threshold": draw(st.floats(1.0, 10.0)),
        "rollout_is_threshold_lower": draw(st.none() | st.floats(0.05, 1.0)),
        "rollout_is_two_sided": draw(st.booleans()),
        "rollout_is_batch_normalize": level is not None and draw(st.booleans()),
        "rollout_token_veto_threshold": draw(st.none() | st.floats(1e-6, 0.5)),
        "nonfinite_policy": draw(st.sampled_from(["mask_token", "reject_sequence"])),
        "metrics_only": draw(st.booleans()),
        "rejected_tokens_in_denominator": draw(st.booleans()),
    }
    names = draw(st.lists(st.sampled_from(RS_OPTIONS), max_size=3, unique=True))
    if names:
        fields["rollout_rs"] = ",".join(names)
        fields["rollout_rs_threshold"] = ",".join(criterion(draw, name) for name in names)
    fields.update(fixed)
    if draw(st.booleans()):  # sometimes start from a preset instead
        # Presets that mask by advantage are covered with advantages in test_frontier_masks.py.
        preset = draw(st.sampled_from([p for p in RolloutCorrectionConfig.preset_names()
                                       if not RolloutCorrectionConfig.from_preset(p).bypass_mode
                                       and not RolloutCorrectionConfig.from_preset(p).needs_advantages]))
        keep = {k: fields[k] for k in ("nonfinite_policy", "metrics_only", "rejected_tokens_in_denominator")}
        return RolloutCorrectionConfig.from_preset(preset, **{**keep, **fixed})
    return RolloutCorrectionConfig.from_dict(fields)


def assert_sane(out: Any, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> None:
    w, keep = out.is_weights, out.keep_mask
    assert w.shape == mask.shape and w.dtype == torch.float32 and keep.dtype == torch.bool
    assert torch.isfinite(w).all()
    assert (w >= 0).all()
    assert not (keep & ~mask).any()  # masks only shrink
    assert not (out.denominator_mask & ~mask).any()
    assert (w[~keep] == 0).all()
    # exp(-mean logprob) overflows for mean logprobs below -709 (test_metrics.py::test_ppl_metrics_never_overflow)
    n = mask.sum(-1).clamp(min=1)
    finite = mask & torch.isfinite(old) & torch.isfinite(rollout)
    means = torch.stack([torch.where(finite, x.double(), 0.0).sum(-1) / n for x in (old, rollout)])
    skip = PPL_KEYS if bool((means < -700).any()) else ()
    bad = {k: v for k, v in out.metrics.items() if not _defined(k, v) and k not in skip}
    assert not bad


def assert_weight_bounds(out: Any, cfg: RolloutCorrectionConfig) -> None:
    w = out.is_weights[out.keep_mask].double()
    if cfg.metrics_only or cfg.rollout_is is None:
        assert (w == 1).all()
        return
    if cfg.rollout_is_batch_normalize:
        return  # checked against the unnormalised run in test_batch_normalisation_is_a_division
    upper, lower = cfg.rollout_is_threshold, cfg.is_lower
    slack = 1e-6 * upper  # float32 rounding of a float64 bound
    assert (w <= upper + slack).all()
    if cfg.rollout_is_mode == "mask" or cfg.rollout_is_two_sided:
        assert (w >= lower * (1 - 1e-6)).all()


@SETTINGS
@given(batch=batches(), cfg=configs())
def test_outputs_are_bounded_and_finite(batch: tuple[torch.Tensor, ...], cfg: RolloutCorrectionConfig) -> None:
    out = compute_rollout_correction(*batch, cfg)
    assert_sane(out, *batch)
    assert_weight_bounds(out, cfg)
    if cfg.metrics_only:
        assert torch.equal(out.is_weights, out.keep_mask.float())
        assert torch.equal(out.keep_mask, batch[2])  # finite batch: nothing leaves
    if not cfg.rejected_tokens_in_denominator:
        assert torch.equal(out.denominator_mask, out.keep_mask)


@SETTINGS
@given(batch=batches(), cfg=configs(rollout_is="token", rollout_is_batch_normalize=False, metrics_only=False))
def test_token_weights_follow_the_formula(batch: tuple[torch.Tensor, ...], cfg: RolloutCorrectionConfig) -> None:
    old, rollout, mask = batch
    out = compute_rollout_correction(old, rollout, mask, cfg)
    rho = torch.exp((old.double() - rollout.double()).clamp(-20, 20))
    upper, lower = cfg.rollout_is_threshold, cfg.is_lower
    if cfg.rollout_is_mode == "mask":
        expected = torch.where((rho >= lower * (1 - 1e-6)) & (rho <= upper * (1 + 1e-6)), rho, 0.0)
    else:
        expected = rho.clamp(min=lower if cfg.rollout_is_two_sided else None, max=upper)
    expected = torch.where(out.keep_mask, expected, 0.0)
    # absolute slack: small ratios lose absolute precision ~6e-8 (test_small_token_ratios_keep_relative_precision)
    torch.testing.assert_close(out.is_weights.double(), expected, rtol=1e-5, atol=1e-7)


@SETTINGS
@given(batch=batches(), cfg=configs(), extra=st.data())
def test_adding_a_criterion_never_grows_keep_mask(batch: tuple[torch.Tensor, ...], cfg: RolloutCorrectionConfig,
                                                  extra: Any) -> None:
    base = compute_rollout_correction(*batch, cfg)
    names = [c.name for c in cfg.rejection_criteria]
    new = extra.draw(st.sampled_from([n for n in RS_OPTIONS if n not in names]))
    specs = [f"{c.lower!r}_{c.upper!r}" if c.lower is not None else repr(c.upper) for c in cfg.rejection_criteria]
    fields = {**cfg.to_dict(), "rollout_rs": ",".join([*names, new]),
              "rollout_rs_threshold": ",".join([*specs, criterion(extra.draw, new)])}
    stricter = compute_rollout_correction(*batch, RolloutCorrectionConfig.from_dict(fields))
    assert not (stricter.keep_mask & ~base.keep_mask).any()
    if cfg.rollout_token_veto_threshold is None:
        vetoed = RolloutCorrectionConfig.from_dict({**cfg.to_dict(), "rollout_token_veto_threshold": 0.5})
        assert not (compute_rollout_correction(*batch, vetoed).keep_mask & ~base.keep_mask).any()


@SETTINGS
@given(batch=batches(), cfg=configs(rollout_is_batch_normalize=False, metrics_only=False))
def test_batch_normalisation_is_a_division(batch: tuple[torch.Tensor, ...], cfg: RolloutCorrectionConfig) -> None:
    if cfg.rollout_is is None:
        return
    plain = compute_rollout_correction(*batch, cfg)
    normed_cfg = RolloutCorrectionConfig.from_dict({**cfg.to_dict(), "rollout_is_batch_normalize": True})
    normed = compute_rollout_correction(*batch, normed_cfg)
    assert torch.equal(normed.keep_mask, plain.keep_mask)
    factor = normed.metrics["rollout_corr/rollout_is_batch_norm_factor"]
    assert math.isfinite(factor) and factor >= 0
    if factor > 0:
        torch.testing.assert_close(normed.is_weights.double() * factor, plain.is_weights.double(), rtol=1e-5,
                                   atol=1e-30)
    given_mean = compute_rollout_correction(*batch, normed_cfg, is_weight_mean=4.0)
    torch.testing.assert_close(given_mean.is_weights * 4.0, plain.is_weights, rtol=1e-6, atol=1e-30)


@SETTINGS
@given(batch=batches(nonfinite=True), cfg=configs(), policy=st.sampled_from(["raise", "mask_token",
                                                                           "reject_sequence"]))
def test_nonfinite_inputs_follow_the_policy(batch: tuple[torch.Tensor, ...], cfg: RolloutCorrectionConfig,
                                            policy: str) -> None:
    old, rollout, mask = batch
    cfg = RolloutCorrectionConfig.from_dict({**cfg.to_dict(), "nonfinite_policy": policy})
    bad = mask & ~(torch.isfinite(old) & torch.isfinite(rollout))
    if policy == "raise" and bad.any():
        with pytest.raises(ValueError, match="non-finite"):
            compute_rollout_correction(old, rollout, mask, cfg)
        return
    out = compute_rollout_correction(old, rollout, mask, cfg)
    assert_sane(out, old, rollout, mask)
    assert not (out.keep_mask & bad).any()
    bad_rows = bad.any(-1)
    if policy == "reject_sequence":
        assert not out.keep_mask[bad_rows].any()
    if cfg.metrics_only:
        expected = mask & ~bad
        if policy == "reject_sequence":
            expected &= ~bad_rows.unsqueeze(-1)
        assert torch.equal(out.keep_mask, expected)
    assert out.metrics["rollout_corr/nonfinite_token_count"] == int(bad.sum())
    assert out.metrics["rollout_corr/nonfinite_seq_count"] == int(bad_rows.sum())


def _defined(key: str, value: float) -> bool:
    """A finite metric, or NaN for prob_pearson where Pearson's r is undefined (docs/metrics.md)."""
    return math.isfinite(value) or (key.endswith("prob_pearson") and math.isnan(value))
