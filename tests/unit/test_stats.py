"""Partials (SUM/MAX/MIN merge, concat, slicing) and LogHistogram (bin resolution, merging, quantiles at
sizes torch.quantile refuses)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_rollout_correction import RolloutCorrectionConfig, compute_rollout_correction
from nemo_rollout_correction.core.stats import LogHistogram, Partials

# ---- Partials -------------------------------------------------------------------------------------


def test_partials_combine_by_kind() -> None:
    a, b = Partials(), Partials()
    a.add_sum("n", torch.tensor(2))
    a.add_sum("n", torch.tensor(3.5))
    a.add_max("hi", torch.tensor(1.0))
    a.add_min("lo", torch.tensor(-1.0))
    b.add_sum("n", torch.tensor(1.0))
    b.add_sum("only_b", torch.tensor(7.0))
    b.add_max("hi", torch.tensor(4.0))
    b.add_min("lo", torch.tensor(0.5))
    a.merge(b)
    assert a.get_sum("n") == 6.5 and a.get_sum("only_b") == 7.0
    # A missing partial is an error, never 0.0 (a misspelt denominator key would zero the loss).
    with pytest.raises(KeyError, match=r"absent.*present"):
        a.get_sum("absent")
    assert float(a.maxs["hi"]) == 4.0 and float(a.mins["lo"]) == -1.0
    assert all(v.dtype == torch.float64 for d in (a.sums, a.maxs, a.mins) for v in d.values())


def test_partials_concat_and_slice_rows() -> None:
    p1 = Partials(sums={"s": torch.tensor([1.0, 2.0])}, maxs={"m": torch.tensor([3.0, 4.0])},
                  mins={"n": torch.tensor([5.0, 6.0])})
    p2 = Partials(sums={"s": torch.tensor([7.0])}, maxs={"m": torch.tensor([8.0])}, mins={"n": torch.tensor([9.0])})
    cat = Partials.concat([p1, p2])
    assert cat.sums["s"].tolist() == [1.0, 2.0, 7.0]
    assert cat.maxs["m"].tolist() == [3.0, 4.0, 8.0]
    assert cat.mins["n"].tolist() == [5.0, 6.0, 9.0]
    sl = cat.slice_rows(1, 3)
    assert sl.sums["s"].tolist() == [2.0, 7.0] and sl.mins["n"].tolist() == [6.0, 9.0]
    empty = Partials.concat([])
    assert empty.sums == {} and empty.maxs == {} and empty.mins == {}


# ---- LogHistogram ---------------------------------------------------------------------------------


def bin_of(u: float) -> int:
    counts = LogHistogram.count(torch.tensor([u], dtype=torch.float32))
    assert counts.sum() == 1
    return int(counts.argmax())


def test_histogram_shape_and_centers() -> None:
    centers = LogHistogram.centers()
    assert centers.shape == (LogHistogram.NUM_BINS,)
    assert torch.all(centers[1:] > centers[:-1])  # ordered by value
    assert centers[LogHistogram.CENTER] == 0.0
    assert torch.equal(centers, -centers.flip(0))  # symmetric
    assert centers[-1] > 20 and centers[0] < -20  # covers the clamp range
    # 128 bins per octave: neighbouring centers differ by at most 1/128 relative
    positive = centers[LogHistogram.CENTER + 1:]
    assert float(((positive[1:] - positive[:-1]) / positive[:-1]).max()) <= 1 / 128 + 1e-12


@settings(max_examples=150, deadline=None)
@given(st.floats(min_value=-20.0, max_value=20.0, allow_nan=False, width=32))
def test_every_value_lands_within_resolution(u: float) -> None:
    center = float(LogHistogram.centers()[bin_of(u)])
    if abs(u) < 2.0**-24:
        assert center == 0.0
    else:
        assert math.copysign(1.0, center) == math.copysign(1.0, u)
        assert abs(center - u) <= abs(u) / 256 + 1e-12  # bin center: within half a bin of 1/128


def test_zero_and_negative_zero_share_the_central_bin() -> None:
    assert bin_of(0.0) == bin_of(-0.0) == bin_of(1e-9) == bin_of(-1e-9) == LogHistogram.CENTER


def test_ignored_zeros_are_removed() -> None:
    u = torch.tensor([0.0, 0.0, 0.0, 0.5, -0.25])
    counts = LogHistogram.count(u, num_ignored_zeros=2)
    assert counts.sum() == 3 and counts[LogHistogram.CENTER] == 1


def test_counts_merge_by_addition() -> None:
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(1000, generator=gen), torch.randn(337, generator=gen) * 5
    assert torch.equal(LogHistogram.count(a) + LogHistogram.count(b), LogHistogram.count(torch.cat([a, b])))
    assert torch.equal(LogHistogram.count(a.view(10, 100)), LogHistogram.count(a))


def test_count_weighted_equals_repeated_counts() -> None:
    u = torch.tensor([0.3, -1.7, 0.0, 4.2], dtype=torch.float64)
    w = torch.tensor([3.0, 1.0, 2.0, 0.0])
    repeated = torch.repeat_interleave(u.float(), w.long())
    assert torch.equal(LogHistogram.count_weighted(u, w), LogHistogram.count(repeated))


def test_quantiles_empty_and_zero_mass() -> None:
    empty = torch.zeros(LogHistogram.NUM_BINS, dtype=torch.float64)
    assert LogHistogram.quantiles(empty, [0.1, 0.5]) == [0.0, 0.0]
    counts = LogHistogram.count(torch.tensor([0.0, 0.0, math.log(2.0)]))
    # 3 ones-and-twos plus 3 zeros: the lower half is exactly 0
    q = LogHistogram.quantiles(counts, [0.25, 0.5, 0.75, 1.0], zero_count=3.0)
    assert q[0] == 0.0 and q[1] == 0.0 and q[2] == 1.0
    assert abs(math.log(q[3]) - math.log(2.0)) <= math.log(2.0) / 128
    only_zeros = LogHistogram.quantiles(empty, [0.5], zero_count=2.0)
    assert only_zeros == [0.0]


def bracket_ok(data: np.ndarray, value: float, q: float) -> bool:
    """`value` is a q-quantile of `data` (log-values) up to the histogram resolution |u| / 128."""
    u = math.log(value)
    tol = abs(u) / 128 + 1e-6
    n = data.size
    return bool((data <= u + tol).sum() >= q * n and (data < u - tol).sum() <= q * n)


def test_quantiles_at_twenty_million_elements() -> None:
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(20_000_000, generator=gen) * 0.7
    u[:1000] = 20.0  # the clamp edges
    u[1000:2000] = -20.0
    with pytest.raises(RuntimeError, match="too large"):
        torch.quantile(u, 0.5)  # why the histogram exists
    qs = [0.00001, 0.001, 0.01, 0.1, 0.5, 0.9, 0.99, 0.999, 0.99999]
    values = LogHistogram.quantiles(LogHistogram.count(u), qs)
    data = u.numpy()
    ranks = [max(math.ceil(q * data.size) - 1, 0) for q in qs]
    exact = np.partition(data, ranks)[ranks]
    for q, value, ref in zip(qs, values, exact, strict=True):
        assert abs(math.log(value) - float(ref)) <= abs(float(ref)) / 128 + 1e-6, (q, value, math.exp(ref))
    assert bracket_ok(data, values[4], 0.5)


@pytest.mark.slow
def test_correction_quantiles_at_twenty_million_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    log_ratio = torch.randn(2000, 10_000, generator=gen) * 0.5
    mask = torch.ones_like(log_ratio, dtype=torch.bool)
    mask[:, -100:] = False
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_token_veto_threshold=None)
    out = compute_rollout_correction(log_ratio - 1.0, torch.full_like(log_ratio, -1.0), mask, cfg)
    data = (log_ratio[mask]).numpy()
    for label, q in [("p1", 0.01), ("p50", 0.5), ("p99", 0.99)]:
        assert bracket_ok(data, out.metrics[f"rollout_corr/token_ratio_{label}"], q)
        assert bracket_ok(data, out.metrics[f"rollout_corr/rollout_is_raw_{label}"], q)
    assert out.metrics["rollout_corr/rollout_is_p99"] == 2.0 or out.metrics["rollout_corr/rollout_is_raw_p99"] < 2.0
