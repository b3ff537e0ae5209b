"""Rejection sampling by hand: every criterion, k1 ratio bounds (asymmetric), AND-combination, shared
thresholds, the veto, their metrics, and metrics-only mode."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from nemo_rollout_correction import RolloutCorrectionConfig, compute_rollout_correction
from nemo_rollout_correction.core.config import RS_OPTIONS

F = "rollout_corr/"


def cfg(**fields: Any) -> RolloutCorrectionConfig:
    return RolloutCorrectionConfig.from_dict({"rollout_token_veto_threshold": None, **fields})


LOG_RATIOS: list[list[float | None]] = [
    [0.3, -0.1, 0.05, None],
    [-0.6, 0.02, None, None],
    [0.01, -0.02, 0.015, 0.0],
    [1.2, None, None, None],
    [None, None, None, None],  # a sequence without loss tokens: never rejected, never counted
]


def batch(log_ratios: list[list[float | None]] = LOG_RATIOS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = torch.tensor([[v is not None for v in row] for row in log_ratios])
    lr = torch.tensor([[-9.0 if v is None else v for v in row] for row in log_ratios], dtype=torch.float64)
    rollout = torch.full(mask.shape, -2.0, dtype=torch.float64)
    return (rollout + lr).float(), rollout.float(), mask


def k1(lr: float) -> float:
    return math.exp(lr)  # k1 criteria bound the ratio itself


def k2(lr: float) -> float:
    return 0.5 * lr * lr


def k3(lr: float) -> float:
    return math.exp(lr) - 1.0 - lr


def parse(spec: str, stat: str) -> tuple[float | None, float]:
    parts = [float(p) for p in spec.split("_")]
    if stat != "k1":
        return None, parts[0]
    return (parts[0], parts[1]) if len(parts) == 2 else (1.0 / parts[0], parts[0])


def reference_keep(name: str, spec: str, log_ratios: list[list[float | None]] = LOG_RATIOS) -> list[list[bool]]:
    """keep_mask of one criterion, from the definition."""
    granularity, stat = name.rsplit("_", 1)
    lower, upper = parse(spec, stat)

    def inside(value: float) -> bool:
        return (lower is None or value >= lower) and value <= upper

    out = []
    for row in log_ratios:
        lrs = [v for v in row if v is not None]
        if granularity == "token":
            fn = {"k1": k1, "k2": k2, "k3": k3}[stat]
            out.append([v is not None and inside(fn(v)) for v in row])
            continue
        if not lrs:
            keep_seq = True
        elif stat == "k1":
            log_rho = sum(lrs) if granularity == "seq_sum" else sum(lrs) / len(lrs)
            keep_seq = inside(math.exp(log_rho))
        else:
            fn = k2 if stat == "k2" else k3
            values = [fn(v) for v in lrs]
            agg = {"seq_sum": sum(values), "seq_mean": sum(values) / len(values), "seq_max": max(values)}
            keep_seq = inside(agg[granularity])
        out.append([v is not None and keep_seq for v in row])
    return out


THRESHOLDS = {
    "token_k1": "0.9_1.5",
    "token_k2": "0.02",
    "token_k3": "0.02",
    "seq_sum_k1": "0.6_1.5",
    "seq_sum_k2": "0.06",
    "seq_sum_k3": "0.06",
    "seq_mean_k1": "0.9_1.1",
    "seq_mean_k2": "0.02",
    "seq_mean_k3": "0.02",
    "seq_max_k2": "0.02",
    "seq_max_k3": "0.04",
}


def test_every_option_has_a_case() -> None:
    assert set(THRESHOLDS) == set(RS_OPTIONS)


@pytest.mark.parametrize("name", sorted(THRESHOLDS))
def test_single_criterion_matches_definition(name: str) -> None:
    spec = THRESHOLDS[name]
    expected = torch.tensor(reference_keep(name, spec))
    mask = batch()[2]
    # the case is informative: something rejected, something kept
    assert (mask & ~expected).any() and expected.any()
    out = compute_rollout_correction(*batch(), cfg(rollout_rs=name, rollout_rs_threshold=spec))
    assert torch.equal(out.keep_mask, expected)
    assert torch.equal(out.is_weights, expected.float())

    num_valid, num_seqs = int(mask.sum()), int(mask.any(-1).sum())
    rejected = mask & ~expected
    assert out.metrics[F + f"rollout_rs_{name}_masked_fraction"] == pytest.approx(int(rejected.sum()) / num_valid)
    assert out.metrics[F + f"rollout_rs_{name}_seq_masked_fraction"] == pytest.approx(
        int(rejected.any(-1).sum()) / num_seqs)
    assert out.metrics[F + "rollout_rs_masked_fraction"] == pytest.approx(int(rejected.sum()) / num_valid)
    assert out.metrics[F + "rollout_rs_seq_masked_fraction"] == pytest.approx(int(rejected.any(-1).sum()) / num_seqs)
    assert out.metrics[F + "num_kept_tokens"] == int(expected.sum())


@pytest.mark.parametrize("name", sorted(THRESHOLDS))
def test_metrics_only_reports_rejections_but_applies_none(name: str) -> None:
    spec = THRESHOLDS[name]
    c = cfg(rollout_rs=name, rollout_rs_threshold=spec)
    applied = compute_rollout_correction(*batch(), c)
    only = compute_rollout_correction(*batch(), cfg(rollout_rs=name, rollout_rs_threshold=spec, metrics_only=True))
    mask = batch()[2]
    assert torch.equal(only.keep_mask, mask)
    assert torch.equal(only.is_weights, mask.float())
    for key, value in applied.metrics.items():
        if key.endswith(("num_kept_tokens", "num_kept_seqs", "kept_token_fraction", "num_denominator_tokens",
                             "prob_pearson")):  # over kept tokens: differs by definition
            continue
        assert only.metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_k1_asymmetric_bounds_bound_the_ratio_not_its_inverse() -> None:
    # "0.9_1.5": rho = 1.4 is kept and rho = 0.85 rejected (verl's sign quirk does the opposite).
    lrs: list[list[float | None]] = [[math.log(1.4)], [math.log(0.85)], [math.log(1.6)], [math.log(0.95)]]
    for name in ("token_k1", "seq_sum_k1", "seq_mean_k1"):
        out = compute_rollout_correction(*batch(lrs), cfg(rollout_rs=name, rollout_rs_threshold="0.9_1.5"))
        assert out.keep_mask.flatten().tolist() == [True, False, False, True], name


def test_k1_single_upper_implies_reciprocal_lower() -> None:
    lrs: list[list[float | None]] = [[math.log(1.9)], [math.log(0.52)], [math.log(2.1)], [math.log(0.48)]]
    for name in ("token_k1", "seq_sum_k1", "seq_mean_k1"):
        out = compute_rollout_correction(*batch(lrs), cfg(rollout_rs=name, rollout_rs_threshold=2.0))
        assert out.keep_mask.flatten().tolist() == [True, True, False, False], name


def test_seq_sum_vs_seq_mean_k1() -> None:
    # Three tokens of rho = 1.2: product 1.728 (outside [0.5, 1.5]), geometric mean 1.2 (inside).
    lrs: list[list[float | None]] = [[math.log(1.2)] * 3]
    c_sum = cfg(rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_1.5")
    c_mean = cfg(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.5_1.5")
    assert not compute_rollout_correction(*batch(lrs), c_sum).keep_mask.any()
    assert compute_rollout_correction(*batch(lrs), c_mean).keep_mask.all()


def test_geometric_bounds_are_exact_at_tiny_tolerances() -> None:
    # verl's 0.999_1.001 geometric bound: mean log-ratios just inside / outside log(1.001) = 9.995e-4.
    lrs: list[list[float | None]] = [[0.00099, 0.00099], [0.00101, 0.00101], [-0.00099, -0.00099],
                                     [-0.00101, -0.00101]]
    out = compute_rollout_correction(*batch(lrs), cfg(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"))
    assert out.keep_mask[:, 0].tolist() == [True, False, True, False]


COMBOS = [
    ("token_k1,seq_mean_k3", "0.9_1.5,0.02"),
    ("seq_sum_k1,token_k2", "0.6_1.5,0.02"),
    ("seq_max_k2,seq_mean_k1", "0.05,0.8_1.2"),
    ("token_k3,seq_sum_k2,seq_mean_k1", "0.02,0.06,0.9_1.1"),
]


@pytest.mark.parametrize(("names", "specs"), COMBOS)
def test_criteria_are_and_combined(names: str, specs: str) -> None:
    expected = batch()[2]
    for name, spec in zip(names.split(","), specs.split(","), strict=True):
        expected = expected & torch.tensor(reference_keep(name, spec))
    out = compute_rollout_correction(*batch(), cfg(rollout_rs=names, rollout_rs_threshold=specs))
    assert torch.equal(out.keep_mask, expected)
    mask = batch()[2]
    rejected = mask & ~expected
    assert out.metrics[F + "rollout_rs_masked_fraction"] == pytest.approx(int(rejected.sum()) / int(mask.sum()))


def test_shared_threshold_applies_to_each_criterion() -> None:
    shared = cfg(rollout_rs="token_k2,seq_max_k3", rollout_rs_threshold=0.02)
    expected = (torch.tensor(reference_keep("token_k2", "0.02")) & torch.tensor(reference_keep("seq_max_k3", "0.02")))
    assert torch.equal(compute_rollout_correction(*batch(), shared).keep_mask, expected)


def test_rs_composes_with_is() -> None:
    c = cfg(rollout_is="token", rollout_is_threshold=1.3, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.9_1.1")
    out = compute_rollout_correction(*batch(), c)
    keep = torch.tensor(reference_keep("seq_mean_k1", "0.9_1.1"))
    expected = torch.tensor([[min(math.exp(v), 1.3) if keep[r][t] else 0.0 for t, v in enumerate(row)]
                             for r, row in enumerate(LOG_RATIOS)])
    assert torch.equal(out.keep_mask, keep)
    torch.testing.assert_close(out.is_weights, expected, rtol=1e-6, atol=0)


def test_criterion_value_metrics() -> None:
    c = cfg(rollout_rs="token_k3,seq_mean_k1", rollout_rs_threshold="0.02,0.9_1.1")
    out = compute_rollout_correction(*batch(), c)
    valid = [v for row in LOG_RATIOS for v in row if v is not None]
    k3s = [k3(v) for v in valid]
    assert out.metrics[F + "rollout_rs_token_k3_mean"] == pytest.approx(sum(k3s) / len(k3s), rel=1e-5)
    assert out.metrics[F + "rollout_rs_token_k3_max"] == pytest.approx(max(k3s), rel=1e-5)
    assert out.metrics[F + "rollout_rs_token_k3_fraction_high"] == pytest.approx(
        sum(v > 0.02 for v in k3s) / len(k3s))
    # seq_mean_k1 reports its statistic log rho_geo per sequence (the log of the bounded ratio)
    stats = [sum(v for v in row if v is not None) / sum(v is not None for v in row) for row in LOG_RATIOS[:4]]
    assert out.metrics[F + "rollout_rs_seq_mean_k1_seq_mean"] == pytest.approx(sum(stats) / 4, rel=1e-5)
    assert out.metrics[F + "rollout_rs_seq_mean_k1_seq_max"] == pytest.approx(max(stats), rel=1e-5)
    assert out.metrics[F + "rollout_rs_seq_mean_k1_seq_min"] == pytest.approx(min(stats), rel=1e-5)
    # rho above the upper bound is "high", below the lower bound "low", per sequence
    rhos = [math.exp(-s) for s in stats]
    assert out.metrics[F + "rollout_rs_seq_mean_k1_fraction_high"] == pytest.approx(sum(r > 1.1 for r in rhos) / 4)
    assert out.metrics[F + "rollout_rs_seq_mean_k1_fraction_low"] == pytest.approx(sum(r < 0.9 for r in rhos) / 4)


# ---- veto ----------------------------------------------------------------------------------------


def test_veto_rejects_whole_sequence() -> None:
    lrs: list[list[float | None]] = [
        [0.1, math.log(5e-5), 0.0],  # one catastrophic token: the whole row goes
        [0.1, math.log(2e-4), 0.0],  # above the threshold: kept
        [0.0, 0.0, None],
        [None, None, None],
    ]
    old, rollout, mask = batch(lrs)
    old[2, 2] = rollout[2, 2] - 50.0  # catastrophic, but padding: ignored
    out = compute_rollout_correction(old, rollout, mask, cfg(rollout_token_veto_threshold=1e-4))
    assert out.keep_mask.tolist() == [[False] * 3, [True] * 3, [True, True, False], [False] * 3]
    assert out.metrics[F + "veto_fraction"] == pytest.approx(1 / 3)
    assert out.metrics[F + "catastrophic_token_fraction"] == pytest.approx(1 / 8)

    only = compute_rollout_correction(old, rollout, mask, cfg(rollout_token_veto_threshold=1e-4, metrics_only=True))
    assert torch.equal(only.keep_mask, mask)
    assert only.metrics[F + "veto_fraction"] == pytest.approx(1 / 3)


def test_veto_is_the_default() -> None:
    lrs: list[list[float | None]] = [[0.1, math.log(5e-5)], [0.1, 0.0]]
    out = compute_rollout_correction(*batch(lrs), RolloutCorrectionConfig())
    if RolloutCorrectionConfig().rollout_token_veto_threshold is None:
        assert out.keep_mask.all()
    else:
        assert out.keep_mask.tolist() == [[False, False], [True, True]]


def test_veto_with_sequence_is() -> None:
    lrs: list[list[float | None]] = [[0.1, math.log(5e-5)], [0.1, 0.2]]
    c = cfg(rollout_is="sequence", rollout_is_threshold=2.0, rollout_token_veto_threshold=1e-4)
    out = compute_rollout_correction(*batch(lrs), c)
    assert out.keep_mask.tolist() == [[False, False], [True, True]]
    assert out.is_weights[0].tolist() == [0.0, 0.0]
    assert out.is_weights[1, 0].item() == pytest.approx(math.exp(0.3), rel=1e-6)


def test_veto_below_clamp_range() -> None:
    lrs: list[list[float | None]] = [[0.0, -50.0], [0.0, 0.0]]
    out = compute_rollout_correction(*batch(lrs), cfg(rollout_token_veto_threshold=1e-12))
    assert out.keep_mask.tolist() == [[False, False], [True, True]]
