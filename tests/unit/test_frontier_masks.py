"""OPSM, KPop (binary KL) and DPPO-TV masks and the prob_pearson metric: hand-derived cases, the
reference formulas of TRL / slime, AReaL and prime-rl re-derived in float64 here, and hypothesis
properties."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_rollout_correction import RolloutCorrectionConfig, compute_rollout_correction
from nemo_rollout_correction.core.frontier import binary_kl
from nemo_rollout_correction.core.metrics import finalize_metrics
from nemo_rollout_correction.core.stats import Partials

F = "rollout_corr/"
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def cfg(**fields: Any) -> RolloutCorrectionConfig:
    return RolloutCorrectionConfig(rollout_token_veto_threshold=None, **fields)


def from_log_ratio(log_ratio: list[list[float]], rollout: float = -1.0) -> tuple[torch.Tensor, torch.Tensor]:
    lr = torch.tensor(log_ratio, dtype=torch.float64)
    roll = torch.full_like(lr, rollout)
    return (roll + lr).float(), roll.float()


# ---- OPSM -------------------------------------------------------------------------------------


def test_opsm_rejects_negative_off_policy_sequences() -> None:
    # Sequence KL = mean(rollout - old) = -mean(log-ratio): 0.2, 0.05, 0.5, 0.2 (padding excluded).
    old, rollout = from_log_ratio([[-0.1, -0.3, 9.0], [-0.05, -0.05, -0.05], [-0.5, -0.5, -0.5],
                                   [-0.2, -0.2, -0.2]])
    mask = torch.tensor([[True, True, False], [True, True, True], [True, True, True], [True, True, True]])
    advantages = torch.tensor([-1.0, -1.0, 1.0, 0.0])
    out = compute_rollout_correction(old, rollout, mask, cfg(opsm_threshold=0.1), advantages=advantages)
    # Row 0: negative and KL 0.2 > 0.1 -> rejected. Row 1: KL 0.05. Row 2: positive. Row 3: A = 0 is not negative.
    expected = mask.clone()
    expected[0] = False
    assert torch.equal(out.keep_mask, expected)
    m = out.metrics
    assert m[F + "opsm_seq_masked_fraction"] == pytest.approx(1 / 4)
    assert m[F + "opsm_masked_fraction"] == pytest.approx(2 / 11)
    assert m[F + "opsm_negative_advantage_seq_fraction"] == pytest.approx(2 / 4)
    assert m[F + "opsm_seq_kl_mean"] == pytest.approx((0.2 + 0.05 + 0.5 + 0.2) / 4, rel=1e-6)
    assert m[F + "opsm_seq_kl_max"] == pytest.approx(0.5, rel=1e-6)
    assert m[F + "num_kept_seqs"] == 3


def test_opsm_threshold_is_strict_and_token_advantages_use_their_mean() -> None:
    old, rollout = from_log_ratio([[-0.25, -0.25], [-0.25, -0.25]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    # Row 0: advantages mean -0.5 (negative); row 1: mean +0.5 even though one token is negative.
    advantages = torch.tensor([[-2.0, 1.0], [2.0, -1.0]])
    out = compute_rollout_correction(old, rollout, mask, cfg(opsm_threshold=0.2), advantages=advantages)
    assert out.keep_mask.tolist() == [[False, False], [True, True]]
    # KL exactly at the threshold is kept (slime and TRL reject only KL > delta).
    at = compute_rollout_correction(old, rollout, mask, cfg(opsm_threshold=0.25), advantages=advantages)
    assert at.keep_mask.all()


def reference_opsm_keep(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor,
                        delta: float) -> torch.Tensor:
    """TRL's get_off_policy_mask / slime's compute_opsm_mask, re-derived: keep A >= 0 or KL <= delta."""
    kl = (rollout.double() - old.double()) * mask
    seq_kl = kl.sum(-1) / mask.sum(-1).clamp(min=1)
    return (adv >= 0) | (seq_kl <= delta)


@SETTINGS
@given(st.integers(1, 6), st.integers(1, 8), st.integers(0, 2**31 - 1), st.floats(0.0, 0.3))
def test_opsm_matches_trl_and_slime(rows: int, cols: int, seed: int, delta: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(rows, cols, generator=gen) * 4
    old = rollout + 0.3 * torch.randn(rows, cols, generator=gen)
    mask = torch.rand(rows, cols, generator=gen) > 0.3
    adv = torch.randn(rows, generator=gen)
    out = compute_rollout_correction(old, rollout, mask, cfg(opsm_threshold=delta), advantages=adv)
    keep_seq = reference_opsm_keep(old, rollout, mask, adv, delta)
    assert torch.equal(out.keep_mask, mask & keep_seq.unsqueeze(-1))


# ---- KPop -------------------------------------------------------------------------------------


def bernoulli_kl(p: float, q: float, eps: float = 1e-8) -> float:
    """AReaL's compute_binary_kl_divergence, in float64 Python."""
    p, q = min(max(p, eps), 1 - eps), min(max(q, eps), 1 - eps)
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def test_binary_kl_matches_the_bernoulli_formula() -> None:
    pairs = [(0.9, 0.8), (0.2, 0.6), (0.5, 0.5), (1e-3, 0.3), (0.999999, 0.99), (1e-12, 0.5)]
    log_p = torch.tensor([math.log(p) for p, _ in pairs], dtype=torch.float64)
    log_q = torch.tensor([math.log(q) for _, q in pairs], dtype=torch.float64)
    got = binary_kl(log_p, log_q)
    want = torch.tensor([bernoulli_kl(p, q) for p, q in pairs], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    # float32 near p = 1: finite and accurate (1 - p is taken as -expm1(log p), not rounded to 0).
    near_one = binary_kl(torch.tensor([-1e-7]), torch.tensor([-1e-3]))
    assert torch.isfinite(near_one).all()
    assert float(near_one) == pytest.approx(bernoulli_kl(math.exp(-1e-7), math.exp(-1e-3)), rel=1e-3)


def test_kpop_masks_tokens_whose_symmetric_binary_kl_exceeds_the_threshold() -> None:
    p = [[0.9, 0.5, 0.999], [0.2, 0.01, 0.7]]
    q = [[0.8, 0.5, 0.9], [0.6, 0.02, 0.69]]
    old = torch.tensor(p).log()
    rollout = torch.tensor(q).log()
    mask = torch.ones(2, 3, dtype=torch.bool)
    phi = 0.05
    stat = [[max(bernoulli_kl(a, b), bernoulli_kl(b, a)) for a, b in zip(pr, qr, strict=True)]
            for pr, qr in zip(p, q, strict=True)]
    expected = torch.tensor([[s <= phi for s in row] for row in stat])
    assert (~expected).any() and expected.any()  # informative
    out = compute_rollout_correction(old, rollout, mask, cfg(kpop_threshold=phi))
    assert torch.equal(out.keep_mask, expected)
    flat = [s for row in stat for s in row]
    assert out.metrics[F + "kpop_masked_fraction"] == pytest.approx(float((~expected).sum()) / 6)
    assert out.metrics[F + "kpop_binary_kl_mean"] == pytest.approx(sum(flat) / 6, rel=1e-4)
    assert out.metrics[F + "kpop_binary_kl_max"] == pytest.approx(max(flat), rel=1e-4)


# ---- DPPO-TV ----------------------------------------------------------------------------------


def reference_dppo_keep(old: torch.Tensor, rollout: torch.Tensor, adv: torch.Tensor, high: float,
                        low: float) -> torch.Tensor:
    """prime-rl's default_loss_fn mask, re-derived: invalid = where(A > 0, d > high, d < -low)."""
    diff = old.double().exp() - rollout.double().exp()
    invalid = torch.where(adv > 0, diff > high, diff < -low)
    return ~invalid


def test_dppo_tv_is_one_sided_by_advantage_sign() -> None:
    p = torch.tensor([[0.9, 0.3, 0.5], [0.2, 0.6, 0.5], [0.1, 0.45, 0.5]])
    q = torch.tensor([[0.5, 0.2, 0.5], [0.6, 0.3, 0.5], [0.5, 0.3, 0.5]])
    adv = torch.tensor([1.0, -1.0, 0.0])
    mask = torch.ones(3, 3, dtype=torch.bool)
    out = compute_rollout_correction(p.log(), q.log(), mask, cfg(dppo_tv_threshold=0.2, dppo_tv_threshold_low=0.3),
                                     advantages=adv)
    # Row 0 (A > 0): p - q = 0.4 > 0.2 rejected; 0.1 kept; 0 kept.
    # Row 1 (A < 0): q - p = 0.4 > 0.3 rejected; p - q = 0.3 is an increase: kept.
    # Row 2 (A = 0, prime-rl's low side): q - p = 0.4 > 0.3 rejected; the rest kept.
    assert out.keep_mask.tolist() == [[False, True, True], [False, True, True], [False, True, True]]
    m = out.metrics
    assert m[F + "dppo_tv_masked_fraction"] == pytest.approx(3 / 9)
    assert m[F + "dppo_tv_masked_fraction_high"] == pytest.approx(1 / 9)
    assert m[F + "dppo_tv_masked_fraction_low"] == pytest.approx(2 / 9)
    assert m[F + "dppo_tv_prob_diff_max"] == pytest.approx(0.4, rel=1e-5)
    assert m[F + "dppo_tv_prob_diff_min"] == pytest.approx(-0.4, rel=1e-5)
    assert m[F + "dppo_tv_prob_diff_abs_mean"] == pytest.approx((0.4 + 0.1 + 0.4 + 0.3 + 0.4 + 0.15) / 9, rel=1e-5)


@SETTINGS
@given(st.integers(1, 5), st.integers(1, 7), st.integers(0, 2**31 - 1), st.floats(0.0, 0.5), st.floats(0.0, 0.5))
def test_dppo_tv_matches_prime_rl(rows: int, cols: int, seed: int, high: float, low: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(rows, cols, generator=gen) * 3
    old = (rollout + 0.5 * torch.randn(rows, cols, generator=gen)).clamp(max=0.0)
    mask = torch.rand(rows, cols, generator=gen) > 0.3
    adv = torch.randn(rows, cols, generator=gen)
    out = compute_rollout_correction(old, rollout, mask, cfg(dppo_tv_threshold=high, dppo_tv_threshold_low=low),
                                     advantages=adv)
    keep = reference_dppo_keep(old, rollout, adv, high, low)
    diff = (old.double().exp() - rollout.double().exp())
    # float32 vs float64 probabilities may disagree within rounding of the thresholds: skip those tokens.
    clear = ((diff - high).abs() > 1e-6) & ((diff + low).abs() > 1e-6)
    assert torch.equal((out.keep_mask & clear), (mask & keep & clear))


# ---- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fields", [{"opsm_threshold": 0.1}, {"dppo_tv_threshold": 0.2}])
def test_masks_by_advantage_need_advantages(fields: dict[str, float]) -> None:
    old, rollout = from_log_ratio([[0.1, 0.2]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="advantages"):
        compute_rollout_correction(old, rollout, mask, cfg(**fields))
    with pytest.raises(ValueError, match=r"advantages must be \[batch\]"):
        compute_rollout_correction(old, rollout, mask, cfg(**fields), advantages=torch.zeros(3))


@pytest.mark.parametrize(("field", "value"), [("opsm_threshold", -0.1), ("kpop_threshold", 0.0),
                                              ("dppo_tv_threshold", float("nan")), ("dppo_tv_threshold", True)])
def test_bad_thresholds_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        cfg(**{field: value})
    with pytest.raises(ValueError, match="dppo_tv_threshold_low needs dppo_tv_threshold"):
        cfg(dppo_tv_threshold_low=0.1)


def test_metrics_only_measures_but_applies_nothing() -> None:
    old, rollout = from_log_ratio([[-2.0, 0.0], [0.0, 0.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    fields = {"opsm_threshold": 0.1, "kpop_threshold": 0.01, "dppo_tv_threshold": 0.01}
    adv = torch.tensor([-1.0, 1.0])
    applied = compute_rollout_correction(old, rollout, mask, cfg(**fields), advantages=adv)
    only = compute_rollout_correction(old, rollout, mask, cfg(metrics_only=True, **fields), advantages=adv)
    assert not applied.keep_mask[0].any() and torch.equal(only.keep_mask, mask)
    for key in ("opsm_seq_masked_fraction", "kpop_masked_fraction", "dppo_tv_masked_fraction"):
        assert only.metrics[F + key] == applied.metrics[F + key] > 0


# ---- prob_pearson -----------------------------------------------------------------------------


def test_prob_pearson_matches_numpy_over_kept_tokens() -> None:
    gen = torch.Generator().manual_seed(3)
    rollout = -torch.rand(6, 10, generator=gen) * 4
    old = rollout + 0.2 * torch.randn(6, 10, generator=gen)
    mask = torch.rand(6, 10, generator=gen) > 0.2
    out = compute_rollout_correction(old, rollout, mask, cfg(rollout_is="token", rollout_is_mode="mask",
                                                               rollout_is_threshold=1.2))
    kept = out.keep_mask
    assert (mask & ~kept).any()  # the token IS mask removed some: the metric follows keep_mask
    want = np.corrcoef(old.exp()[kept].double().numpy(), rollout.exp()[kept].double().numpy())[0, 1]
    # float32 accumulation per chunk (docs/metrics.md): within 1e-6 of the float64 reference.
    assert out.metrics[F + "prob_pearson"] == pytest.approx(want, abs=1e-6)


def test_prob_pearson_is_exact_across_microbatches() -> None:
    gen = torch.Generator().manual_seed(4)
    rollout = -torch.rand(9, 7, generator=gen) * 3
    old = rollout + 0.1 * torch.randn(9, 7, generator=gen)
    mask = torch.rand(9, 7, generator=gen) > 0.25
    c = cfg(rollout_rs="token_k1", rollout_rs_threshold="0.9_1.1")
    whole = compute_rollout_correction(old, rollout, mask, c).metrics[F + "prob_pearson"]
    merged = Partials()
    for start, stop in ((0, 2), (2, 3), (3, 9)):
        merged.merge(compute_rollout_correction(old[start:stop], rollout[start:stop], mask[start:stop], c).partials)
    # The merged moments give the correlation of all kept tokens (equal up to float32 rounding of
    # each microbatch's sums), not an average of per-microbatch correlations.
    assert finalize_metrics(merged, c)[F + "prob_pearson"] == pytest.approx(whole, abs=1e-6)
    kept = compute_rollout_correction(old, rollout, mask, c).keep_mask
    exact = np.corrcoef(old.exp()[kept].double().numpy(), rollout.exp()[kept].double().numpy())[0, 1]
    assert whole == pytest.approx(exact, abs=1e-6)
    p_all, q_all = old.exp().double(), rollout.exp().double()
    per_mb = [np.corrcoef(p_all[a:b][kept[a:b]].numpy(), q_all[a:b][kept[a:b]].numpy())[0, 1]
              for a, b in ((0, 3), (3, 9))]
    assert abs(float(np.mean(per_mb)) - exact) > 1e-4  # averaging per microbatch would be wrong
    want = np.corrcoef(old.exp()[mask].double().numpy(), rollout.exp()[mask].double().numpy())[0, 1]
    assert whole != pytest.approx(want, abs=1e-4)  # rejections matter: kept tokens, not all loss tokens


def test_prob_pearson_undefined_cases_are_nan_not_zero() -> None:
    """Issue 24: r is undefined for a constant side or fewer than 2 tokens; it is NaN there, never 0.0 (which
    reads as a measured "no correlation"). A near-constant side (the tiny-model case) is undefined too."""
    rollout = torch.full((2, 3), -1.0)
    old = rollout + torch.tensor([[0.1, 0.2, 0.3], [0.0, -0.1, 0.05]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    assert math.isnan(compute_rollout_correction(old, rollout, mask, cfg()).metrics[F + "prob_pearson"])  # q constant
    one = torch.zeros(2, 3, dtype=torch.bool)
    one[0, 0] = True
    assert math.isnan(compute_rollout_correction(old, rollout, one, cfg()).metrics[F + "prob_pearson"])  # n < 2
    empty = torch.zeros(2, 3, dtype=torch.bool)
    assert math.isnan(compute_rollout_correction(old, rollout, empty, cfg()).metrics[F + "prob_pearson"])
    # near-constant within float32 rounding of the raw sums (both sides vary by ~1e-9): undefined, not a number
    tiny = rollout + 1e-9 * torch.arange(6.0).reshape(2, 3)
    near = compute_rollout_correction(tiny + 1e-9, tiny, mask, cfg()).metrics[F + "prob_pearson"]
    assert math.isnan(near)
    # defined cases stay numbers in [-1, 1]
    varied = torch.tensor([[-0.5, -1.0, -2.0], [-0.2, -3.0, -1.5]])
    r = compute_rollout_correction(varied + 0.01, varied, mask, cfg()).metrics[F + "prob_pearson"]
    assert 0.99 < r <= 1.0


# ---- properties -------------------------------------------------------------------------------


@st.composite
def frontier_cases(draw: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    n = rows * cols
    roll = torch.tensor(draw(st.lists(st.floats(-15.0, 0.0, width=32), min_size=n, max_size=n))).view(rows, cols)
    lr = torch.tensor(draw(st.lists(st.floats(-25.0, 25.0, width=32), min_size=n, max_size=n))).view(rows, cols)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))).view(rows, cols)
    adv = torch.tensor(draw(st.lists(st.floats(-2.0, 2.0, width=32), min_size=rows, max_size=rows)))
    fields = {
        "opsm_threshold": draw(st.none() | st.floats(0.0, 1.0)),
        "kpop_threshold": draw(st.none() | st.floats(1e-3, 3.0)),
        "dppo_tv_threshold": draw(st.none() | st.floats(0.0, 0.5)),
        "rollout_is": draw(st.sampled_from([None, "token", "sequence"])),
        "rejected_tokens_in_denominator": draw(st.booleans()),
    }
    return (roll + lr).clamp(max=0.0), roll, mask, adv, fields


@SETTINGS
@given(frontier_cases())
def test_frontier_masks_only_shrink_the_keep_mask_and_stay_finite(case: Any) -> None:
    old, rollout, mask, adv, fields = case
    base_fields = {**fields, "opsm_threshold": None, "kpop_threshold": None, "dppo_tv_threshold": None}
    base = compute_rollout_correction(old, rollout, mask, cfg(**base_fields))
    out = compute_rollout_correction(old, rollout, mask, cfg(**fields), advantages=adv)
    assert not (out.keep_mask & ~base.keep_mask).any()
    assert torch.isfinite(out.is_weights).all() and (out.is_weights[~out.keep_mask] == 0).all()
    assert all(_defined(k, v) for k, v in out.metrics.items())
    r = out.metrics[F + "prob_pearson"]
    assert math.isnan(r) or -1.0 <= r <= 1.0  # NaN exactly where r is undefined
    if fields["kpop_threshold"] is None and fields["dppo_tv_threshold"] is None:
        positive = adv >= 0  # OPSM (the only mask left) never touches a sequence with advantage >= 0
        assert torch.equal(out.keep_mask[positive], base.keep_mask[positive])
    if fields["kpop_threshold"] is not None:
        assert out.metrics[F + "kpop_binary_kl_max"] >= 0.0


def test_existing_properties_still_hold_for_the_new_presets() -> None:
    gen = torch.Generator().manual_seed(0)
    rollout = -torch.rand(4, 9, generator=gen) * 3
    old = rollout + 0.3 * torch.randn(4, 9, generator=gen)
    mask = torch.rand(4, 9, generator=gen) > 0.2
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    for name in ("opsm", "kpop", "dppo_tv"):
        c = RolloutCorrectionConfig.from_preset(name)
        out = compute_rollout_correction(old, rollout, mask, c, advantages=adv)
        assert not (out.keep_mask & ~mask).any()
        assert out.metrics[F + "num_valid_tokens"] == int(mask.sum())


def test_undefined_prob_pearson_survives_the_metric_sinks(tmp_path: Any) -> None:
    """A NaN metric goes through the tracker's conversion, metrics.jsonl's JSON and the run summary."""
    import json

    from nemo_rollout_correction.tracking.tracker import to_float
    from nemo_rollout_correction.trainer.console import RunSummary

    rollout = torch.full((2, 3), -1.0)
    metrics = compute_rollout_correction(rollout + 0.1, rollout, torch.ones(2, 3, dtype=torch.bool), cfg()).metrics
    value = metrics[F + "prob_pearson"]
    assert math.isnan(to_float(F + "prob_pearson", value))
    line = json.dumps({"step": 1, **metrics})  # what the trainer appends to metrics.jsonl
    assert math.isnan(json.loads(line)[F + "prob_pearson"])
    summary = RunSummary.from_history([{**metrics, "reward/mean": 0.5}], output_dir=str(tmp_path),
                                      checkpoint_dir=str(tmp_path), log_path=None, mlflow_run_id=None,
                                      tracking_uri=None)
    assert all(isinstance(text, str) for text in summary.lines())


def _defined(key: str, value: float) -> bool:
    """A finite metric, or NaN for prob_pearson where Pearson's r is undefined (docs/metrics.md)."""
    return math.isfinite(value) or (key.endswith("prob_pearson") and math.isnan(value))
