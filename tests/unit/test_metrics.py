"""rollout_corr/* metrics on a hand-built batch: divergences, perplexities, chi^2, IS statistics,
quantiles within the histogram resolution, metrics-only parity, and no NaN/inf."""

from __future__ import annotations

import math
import statistics
from typing import Any

import pytest
import torch

from nemo_rollout_correction import RolloutCorrectionConfig, compute_rollout_correction

F = "rollout_corr/"

# Three sequences of different lengths and one without loss tokens (excluded from per-sequence means).
OLD = [[-0.5, -1.0, -2.0], [-0.2, -3.0], [-1.5], []]
ROLLOUT = [[-0.7, -0.9, -2.5], [-0.1, -2.0], [-1.0], []]
SEQ_LEN = 4


def cfg(**fields: Any) -> RolloutCorrectionConfig:
    return RolloutCorrectionConfig.from_dict({"rollout_token_veto_threshold": None, **fields})


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    old = torch.full((len(OLD), SEQ_LEN), -4.0)
    rollout = torch.full((len(OLD), SEQ_LEN), -0.01)  # padding with a big mismatch: must not count
    mask = torch.zeros(len(OLD), SEQ_LEN, dtype=torch.bool)
    for r, (o_row, ro_row) in enumerate(zip(OLD, ROLLOUT, strict=True)):
        old[r, : len(o_row)] = torch.tensor(o_row)
        rollout[r, : len(ro_row)] = torch.tensor(ro_row)
        mask[r, : len(o_row)] = True
    return old, rollout, mask


SEQS = [(o, ro) for o, ro in zip(OLD, ROLLOUT, strict=True) if o]
LRS = [[a - b for a, b in zip(o, ro, strict=True)] for o, ro in SEQS]
FLAT = [v for row in LRS for v in row]
N_TOK, N_SEQ = len(FLAT), len(SEQS)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def approx(value: float) -> Any:
    return pytest.approx(value, rel=2e-5, abs=1e-6)


# ---- mismatch metrics (present in every config) ----------------------------------------------


def test_divergence_and_perplexity_metrics() -> None:
    m = compute_rollout_correction(*batch(), cfg()).metrics
    assert m[F + "num_valid_tokens"] == N_TOK == 6
    assert m[F + "num_valid_seqs"] == N_SEQ == 3
    assert m[F + "kl"] == approx(mean([-v for v in FLAT]))
    assert m[F + "k3_kl"] == approx(mean([math.exp(v) - 1 - v for v in FLAT]))
    assert m[F + "training_ppl"] == approx(mean([math.exp(-mean(o)) for o, _ in SEQS]))
    assert m[F + "rollout_ppl"] == approx(mean([math.exp(-mean(ro)) for _, ro in SEQS]))
    assert m[F + "training_log_ppl"] == approx(mean([-mean(o) for o, _ in SEQS]))
    assert m[F + "rollout_log_ppl"] == approx(mean([-mean(ro) for _, ro in SEQS]))
    diffs = [mean(ro) - mean(o) for o, ro in SEQS]
    assert m[F + "log_ppl_diff"] == approx(mean(diffs))
    assert m[F + "log_ppl_abs_diff"] == approx(mean([abs(d) for d in diffs]))
    assert m[F + "log_ppl_diff_max"] == approx(max(diffs))
    assert m[F + "log_ppl_diff_min"] == approx(min(diffs))
    assert m[F + "ppl_ratio"] == approx(mean([math.exp(-mean(o)) / math.exp(-mean(ro)) for o, ro in SEQS]))
    assert m[F + "chi2_token"] == approx(mean([math.exp(2 * v) for v in FLAT]) - 1)
    assert m[F + "chi2_seq"] == approx(mean([math.exp(2 * sum(row)) for row in LRS]) - 1)
    assert m[F + "token_log_ratio_max"] == approx(max(FLAT))
    assert m[F + "token_log_ratio_min"] == approx(min(FLAT))
    assert m[F + "num_kept_tokens"] == 6 and m[F + "kept_token_fraction"] == 1.0
    assert m[F + "nonfinite_token_count"] == 0 and m[F + "nonfinite_seq_count"] == 0


def test_metric_names_are_prefixed_and_finite() -> None:
    for name in RolloutCorrectionConfig.preset_names():
        old = batch()[0]
        advantages = torch.where(torch.arange(old.shape[0]) % 2 == 0, 1.0, -1.0)  # OPSM / DPPO-TV presets
        preset = RolloutCorrectionConfig.from_preset(name)
        m = compute_rollout_correction(*batch(), preset, advantages=advantages).metrics
        assert all(k.startswith(F) for k in m)
        assert all(isinstance(v, float) and _defined(k, v) for k, v in m.items())


# ---- IS metrics ---------------------------------------------------------------------------------


def test_token_is_metrics() -> None:
    upper, lower = 1.5, 1 / 1.5
    m = compute_rollout_correction(*batch(), cfg(rollout_is="token", rollout_is_threshold=upper)).metrics
    w = [min(math.exp(v), upper) for v in FLAT]
    mu, second = mean(w), mean([x * x for x in w])
    assert m[F + "rollout_is_mean"] == approx(mu)
    assert m[F + "rollout_is_std"] == approx(math.sqrt(second - mu * mu))
    assert m[F + "rollout_is_eff_sample_size"] == approx(mu * mu / second)
    assert m[F + "rollout_is_max"] == approx(max(w))
    assert m[F + "rollout_is_min"] == approx(min(w))
    assert m[F + "rollout_is_ratio_fraction_high"] == approx(sum(math.exp(v) > upper for v in FLAT) / N_TOK)
    assert m[F + "rollout_is_ratio_fraction_low"] == approx(sum(math.exp(v) < lower for v in FLAT) / N_TOK)
    seq_means = [mean([min(math.exp(v), upper) for v in row]) for row in LRS]
    assert m[F + "rollout_is_seq_mean"] == approx(mean(seq_means))
    assert m[F + "rollout_is_seq_std"] == approx(statistics.stdev(seq_means))
    assert m[F + "rollout_is_seq_max"] == approx(max(seq_means))
    assert m[F + "rollout_is_seq_min"] == approx(min(seq_means))
    assert m[F + "rollout_is_seq_max_deviation"] == approx(max(abs(max(seq_means) - 1), abs(min(seq_means) - 1)))
    raw_seq_means = [mean([math.exp(v) for v in row]) for row in LRS]
    assert m[F + "rollout_is_seq_fraction_high"] == approx(sum(x > upper for x in raw_seq_means) / N_SEQ)
    assert m[F + "rollout_is_seq_fraction_low"] == approx(sum(x < lower for x in raw_seq_means) / N_SEQ)


def test_token_mask_is_metrics() -> None:
    m = compute_rollout_correction(*batch(), cfg(rollout_is="token", rollout_is_mode="mask",
                                                 rollout_is_threshold=1.5)).metrics
    inside = [1 / 1.5 <= math.exp(v) <= 1.5 for v in FLAT]
    w = [math.exp(v) if ok else 0.0 for v, ok in zip(FLAT, inside, strict=True)]
    assert 0 < sum(inside) < N_TOK
    assert m[F + "rollout_is_masked_fraction"] == approx(1 - sum(inside) / N_TOK)
    assert m[F + "rollout_is_mean"] == approx(mean(w))
    assert m[F + "rollout_is_min"] == 0.0
    assert m[F + "num_kept_tokens"] == sum(inside)


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_sequence_level_is_metrics(level: str) -> None:
    upper = 1.2
    m = compute_rollout_correction(*batch(), cfg(rollout_is=level, rollout_is_threshold=upper)).metrics
    logs = [sum(row) if level == "sequence" else mean(row) for row in LRS]
    w = [min(math.exp(x), upper) for x in logs]
    n = [len(row) for row in LRS]
    # token-weighted, as if every token carried its sequence's weight
    mu = sum(ni * wi for ni, wi in zip(n, w, strict=True)) / N_TOK
    second = sum(ni * wi * wi for ni, wi in zip(n, w, strict=True)) / N_TOK
    assert m[F + "rollout_is_mean"] == approx(mu)
    assert m[F + "rollout_is_std"] == approx(math.sqrt(max(second - mu * mu, 0)))
    assert m[F + "rollout_is_eff_sample_size"] == approx(mu * mu / second)
    assert m[F + "rollout_is_seq_mean"] == approx(mean(w))
    assert m[F + "rollout_is_seq_std"] == approx(statistics.stdev(w))
    assert m[F + "rollout_is_seq_max"] == approx(max(w))
    assert m[F + "rollout_is_seq_min"] == approx(min(w))
    assert m[F + "rollout_is_ratio_fraction_high"] == approx(sum(math.exp(x) > upper for x in logs) / N_SEQ)
    assert m[F + "rollout_is_ratio_fraction_low"] == approx(sum(math.exp(x) < 1 / upper for x in logs) / N_SEQ)


def test_sequence_level_is_max_is_the_raw_weight_as_in_verl() -> None:
    # Deliberately verl's definition (dashboards port): at sequence/geometric level rollout_is_max/min
    # are the raw pre-bound sequence ratios (clamped to e^+-20), unlike the token level.
    m = compute_rollout_correction(*batch(), cfg(rollout_is="sequence", rollout_is_threshold=1.2)).metrics
    w = [math.exp(sum(row)) for row in LRS]
    assert m[F + "rollout_is_max"] == approx(max(w))
    assert m[F + "rollout_is_min"] == approx(min(w))


def test_token_mask_is_min_ignores_padding_when_bounds_exclude_one() -> None:
    old = torch.full((2, 3), -1.0)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    c = cfg(rollout_is="token", rollout_is_mode="mask", rollout_is_threshold=2.0, rollout_is_threshold_lower=1.2)
    out = compute_rollout_correction(old, old - 0.3, mask, c)  # every valid rho = e^0.3 = 1.35, all kept
    assert out.keep_mask.equal(mask)
    assert out.metrics[F + "rollout_is_min"] == approx(math.exp(0.3))
    assert out.metrics[F + "rollout_is_max"] == approx(math.exp(0.3))


# ---- quantiles -----------------------------------------------------------------------------------


def ref_quantile(values: list[float], q: float) -> float:
    """The element the histogram's cdf search returns: rank ceil(q * n) (1-based) of the sorted values."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def assert_within_resolution(value: float, log_ref: float) -> None:
    """LogHistogram keeps 7 mantissa bits of the float32 log-value: 128 bins per octave of |u|, so a bin
    spans at most |u| / 128 and the reported bin center is within that of the true log-value."""
    assert value > 0
    assert abs(math.log(value) - log_ref) <= abs(log_ref) / 128 + 1e-6, (value, math.exp(log_ref))


@pytest.mark.parametrize(("label", "q"), [("p1", 0.01), ("p10", 0.1), ("p50", 0.5), ("p90", 0.9), ("p99", 0.99)])
def test_quantiles_within_histogram_resolution(label: str, q: float) -> None:
    m = compute_rollout_correction(*batch(), cfg(rollout_is="token", rollout_is_threshold=1.5)).metrics
    raw = ref_quantile(FLAT, q)
    assert_within_resolution(m[F + f"token_ratio_{label}"], raw)
    assert_within_resolution(m[F + f"rollout_is_raw_{label}"], raw)
    applied = m[F + f"rollout_is_{label}"]
    if math.exp(raw) >= 1.5:
        assert applied == 1.5
    else:
        assert_within_resolution(applied, raw)

    seq = compute_rollout_correction(*batch(), cfg(rollout_is="sequence", rollout_is_threshold=1.2)).metrics
    # sequence level: each sequence's log weight counted once per token
    weighted = [sum(row) for row in LRS for _ in row]
    seq_raw = ref_quantile(weighted, q)
    assert_within_resolution(seq[F + f"rollout_is_raw_{label}"], seq_raw)
    if math.exp(seq_raw) >= 1.2:
        assert seq[F + f"rollout_is_{label}"] == 1.2
    else:
        assert_within_resolution(seq[F + f"rollout_is_{label}"], seq_raw)


def test_mask_mode_quantiles_put_rejected_mass_at_zero() -> None:
    m = compute_rollout_correction(*batch(), cfg(rollout_is="token", rollout_is_mode="mask",
                                                 rollout_is_threshold=1.5)).metrics
    values = sorted(math.exp(v) if 1 / 1.5 <= math.exp(v) <= 1.5 else 0.0 for v in FLAT)
    for label, q in [("p1", 0.01), ("p50", 0.5), ("p99", 0.99)]:
        expected = values[max(math.ceil(q * len(values)) - 1, 0)]
        if expected == 0.0:
            assert m[F + f"rollout_is_{label}"] == 0.0
        else:
            assert_within_resolution(m[F + f"rollout_is_{label}"], math.log(expected))


def test_quantiles_of_tiny_mismatches_resolve_one() -> None:
    old, _, mask = batch()
    out = compute_rollout_correction(old, old.clone(), mask, cfg(rollout_is="token"))
    for label in ("p1", "p50", "p99"):
        assert out.metrics[F + f"token_ratio_{label}"] == 1.0
        assert out.metrics[F + f"rollout_is_{label}"] == 1.0


# ---- metrics-only parity ---------------------------------------------------------------------------

KEPT_KEYS = ("num_kept_tokens", "num_kept_seqs", "kept_token_fraction", "num_denominator_tokens",
             "prob_pearson")  # prob_pearson is over kept tokens by definition

PARITY_CONFIGS = [
    cfg(rollout_is="token", rollout_is_threshold=1.5),
    cfg(rollout_is="token", rollout_is_mode="mask", rollout_is_threshold=1.5),
    cfg(rollout_is="sequence", rollout_is_mode="mask", rollout_is_threshold=1.5),
    cfg(rollout_is="geometric", rollout_is_threshold=1.1, rollout_rs="token_k1,seq_max_k3",
        rollout_rs_threshold="0.8_1.3,0.1", rollout_token_veto_threshold=0.5),
    cfg(rollout_is="sequence", rollout_is_batch_normalize=True),
    cfg(rollout_is="token", rollout_is_batch_normalize=True),
]


@pytest.mark.parametrize("c", PARITY_CONFIGS)
def test_metrics_only_parity(c: RolloutCorrectionConfig) -> None:
    only_cfg = RolloutCorrectionConfig.from_dict({**c.to_dict(), "metrics_only": True})
    applied = compute_rollout_correction(*batch(), c)
    only = compute_rollout_correction(*batch(), only_cfg)
    mask = batch()[2]
    assert torch.equal(only.keep_mask, mask)
    assert torch.equal(only.is_weights, mask.float())
    assert torch.equal(only.denominator_mask, mask)
    assert applied.metrics.keys() == only.metrics.keys()
    for key, value in applied.metrics.items():
        if key.endswith(KEPT_KEYS):
            continue
        assert only.metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert only.metrics[F + "num_kept_tokens"] == int(mask.sum())


# ---- robustness ----------------------------------------------------------------------------------


def test_ppl_metrics_never_overflow() -> None:
    old = torch.tensor([[-800.0, -800.0], [-1.0, -1.0]])
    rollout = torch.tensor([[-800.5, -799.5], [-1.0, -1.0]])
    m = compute_rollout_correction(old, rollout, torch.ones(2, 2, dtype=torch.bool), cfg()).metrics
    assert all(_defined(k, v) for k, v in m.items())


def test_metrics_ignore_sequences_without_tokens() -> None:
    old, rollout, mask = batch()
    trimmed = compute_rollout_correction(old[:3], rollout[:3], mask[:3], cfg(rollout_is="sequence")).metrics
    full = compute_rollout_correction(old, rollout, mask, cfg(rollout_is="sequence")).metrics
    for key, value in trimmed.items():
        assert full[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def _defined(key: str, value: float) -> bool:
    """A finite metric, or NaN for prob_pearson where Pearson's r is undefined (docs/metrics.md)."""
    return math.isfinite(value) or (key.endswith("prob_pearson") and math.isnan(value))
