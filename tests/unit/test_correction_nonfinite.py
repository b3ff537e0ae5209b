"""Non-finite logprobs: the three policies, their counts, the fail-fast fraction, and padding that is
ignored entirely. No NaN/inf ever reaches is_weights or metrics."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from nemo_rollout_correction import RolloutCorrectionConfig, compute_rollout_correction

F = "rollout_corr/"
NAN, INF = float("nan"), float("inf")


def cfg(**fields: Any) -> RolloutCorrectionConfig:
    return RolloutCorrectionConfig.from_dict({"rollout_token_veto_threshold": None, **fields})


def clean_batch(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    rollout = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 2 - 0.1
    old = rollout + 0.2 * torch.randn(4, 6, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]]).bool()
    return old.to(dtype), rollout.to(dtype), mask


# (which tensor, row, col, value): every flavour of non-finite on loss tokens
BAD_VALUES = [("rollout", NAN), ("old", NAN), ("rollout", INF), ("rollout", -INF), ("old", -INF), ("old", INF)]
# NaN ratio, ratio -> +inf, ratio -> 0: the three paths, crossed with every config
BAD_SUBSET = [("rollout", NAN), ("rollout", -INF), ("old", -INF)]


def with_bad(which: str, value: float, row: int = 1, col: int = 2,
             dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    old, rollout, mask = clean_batch(dtype)
    (old if which == "old" else rollout)[row, col] = value
    return old, rollout, mask


def assert_finite(out: Any) -> None:
    assert torch.isfinite(out.is_weights).all()
    bad = {k: v for k, v in out.metrics.items() if not _defined(k, v)}
    assert not bad


CONFIGS = [
    cfg(),
    cfg(rollout_is="token", rollout_is_threshold=2.0),
    cfg(rollout_is="token", rollout_is_mode="mask", rollout_is_threshold=2.0),
    cfg(rollout_is="sequence", rollout_is_threshold=5.0),
    cfg(rollout_is="geometric", rollout_is_mode="mask", rollout_is_threshold=1.5),
    cfg(rollout_rs="token_k1,seq_mean_k3,seq_max_k2", rollout_rs_threshold="2.0,0.05,0.5",
        rollout_token_veto_threshold=1e-4),
    cfg(rollout_is="token", rollout_is_batch_normalize=True, rollout_rs="seq_sum_k1", rollout_rs_threshold=5.0),
]


@pytest.mark.parametrize(("which", "value"), BAD_VALUES)
def test_raise_policy(which: str, value: float) -> None:
    with pytest.raises(ValueError, match=r"non-finite.*row 1.*nonfinite_policy='raise'"):
        compute_rollout_correction(*with_bad(which, value), cfg(rollout_is="token", nonfinite_policy="raise"))


@pytest.mark.parametrize("c", CONFIGS)
@pytest.mark.parametrize(("which", "value"), BAD_SUBSET)
def test_reject_sequence_policy(which: str, value: float, c: RolloutCorrectionConfig) -> None:
    assert c.nonfinite_policy == "reject_sequence"  # the default
    old, rollout, mask = with_bad(which, value)
    out = compute_rollout_correction(old, rollout, mask, c)
    assert_finite(out)
    assert not out.keep_mask[1].any()
    assert (out.is_weights[1] == 0).all()
    clean = compute_rollout_correction(*clean_batch(), c)
    # The other rows are decided on their own (sequence decisions) ...
    if c.rollout_is != "token" or not c.rollout_is_batch_normalize:
        assert torch.equal(out.keep_mask[[0, 2, 3]], clean.keep_mask[[0, 2, 3]])
    assert out.metrics[F + "nonfinite_token_count"] == 1
    assert out.metrics[F + "nonfinite_seq_count"] == 1
    assert out.metrics[F + "nonfinite_token_fraction"] == pytest.approx(1 / int(mask.sum()))


@pytest.mark.parametrize("c", CONFIGS)
@pytest.mark.parametrize(("which", "value"), BAD_SUBSET)
def test_mask_token_policy_equals_masking_that_token(which: str, value: float, c: RolloutCorrectionConfig) -> None:
    c_mask = RolloutCorrectionConfig.from_dict({**c.to_dict(), "nonfinite_policy": "mask_token"})
    old, rollout, mask = with_bad(which, value)
    out = compute_rollout_correction(old, rollout, mask, c_mask)
    assert_finite(out)
    assert not out.keep_mask[1, 2]
    # Same as a clean batch where that token is simply not a loss token, apart from the non-finite counts.
    reduced = mask.clone()
    reduced[1, 2] = False
    ref = compute_rollout_correction(*clean_batch()[:2], reduced, c_mask)
    assert torch.equal(out.keep_mask, ref.keep_mask)
    torch.testing.assert_close(out.is_weights, ref.is_weights, rtol=1e-6, atol=1e-7)
    for key, expected in ref.metrics.items():
        if "nonfinite" in key:
            continue
        assert out.metrics[key] == pytest.approx(expected, rel=1e-5, abs=1e-6, nan_ok=True), key
    assert out.metrics[F + "nonfinite_token_count"] == 1
    assert out.metrics[F + "nonfinite_seq_count"] == 1
    assert out.metrics[F + "nonfinite_token_fraction"] == pytest.approx(1 / int(mask.sum()))


@pytest.mark.parametrize(("which", "value"), BAD_VALUES)
@pytest.mark.parametrize("policy", ["reject_sequence", "mask_token"])
def test_every_kind_of_non_finite_is_caught(which: str, value: float, policy: str) -> None:
    out = compute_rollout_correction(*with_bad(which, value), cfg(rollout_is="token", nonfinite_policy=policy))
    assert_finite(out)
    assert not out.keep_mask[1, 2]
    assert out.keep_mask[1].sum() == (0 if policy == "reject_sequence" else 5)
    assert out.metrics[F + "nonfinite_token_count"] == 1


def test_mask_token_sequence_weight_uses_finite_tokens() -> None:
    old, rollout, mask = with_bad("rollout", NAN)
    out = compute_rollout_correction(old, rollout, mask, cfg(rollout_is="sequence", rollout_is_threshold=1e6,
                                                             nonfinite_policy="mask_token"))
    finite = [(old[1, t] - rollout[1, t]).item() for t in range(6) if t != 2]
    expected = math.exp(sum(finite))
    kept = out.keep_mask[1]
    assert kept.tolist() == [True, True, False, True, True, True]
    torch.testing.assert_close(out.is_weights[1][kept], torch.full((5,), expected), rtol=1e-5, atol=0)


def test_counts_with_several_bad_tokens() -> None:
    old, rollout, mask = clean_batch()
    rollout[0, 0] = NAN
    rollout[0, 3] = -INF
    old[3, 4] = NAN
    old[2, 5] = NAN  # padding: ignored
    for policy in ("reject_sequence", "mask_token"):
        out = compute_rollout_correction(old, rollout, mask, cfg(rollout_is="token", nonfinite_policy=policy))
        assert_finite(out)
        assert out.metrics[F + "nonfinite_token_count"] == 3
        assert out.metrics[F + "nonfinite_seq_count"] == 2
        assert out.metrics[F + "num_valid_tokens"] == int(mask.sum()) - 3
        if policy == "reject_sequence":
            assert out.keep_mask.sum(-1).tolist() == [0, 6, 3, 0]
        else:
            assert out.keep_mask.sum(-1).tolist() == [2, 6, 3, 4]


def test_max_fraction_fails_fast() -> None:
    old, rollout, mask = with_bad("rollout", NAN)
    total = int(mask.sum())  # 18 loss tokens, 1 non-finite
    with pytest.raises(ValueError, match="nonfinite_max_fraction"):
        compute_rollout_correction(old, rollout, mask, cfg(nonfinite_max_fraction=0.5 / total))
    with pytest.raises(ValueError, match="nonfinite_max_fraction"):
        compute_rollout_correction(old, rollout, mask, cfg(nonfinite_max_fraction=0.0, nonfinite_policy="mask_token"))
    out = compute_rollout_correction(old, rollout, mask, cfg(nonfinite_max_fraction=1.0 / total))
    assert out.metrics[F + "nonfinite_token_count"] == 1
    # clean batches never trip it, even at 0
    compute_rollout_correction(*clean_batch(), cfg(nonfinite_max_fraction=0.0))


def _dirty_padding(old: torch.Tensor, rollout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dirty_old, dirty_rollout = old.clone(), rollout.clone()
    dirty_old[0, 4], dirty_rollout[0, 5] = NAN, INF
    dirty_old[2, 3], dirty_rollout[2, 3] = -INF, -INF
    dirty_rollout[2, 4] = -INF
    dirty_old[3, 5] = INF
    return dirty_old, dirty_rollout


def _assert_same(out: Any, ref: Any) -> None:
    assert torch.equal(out.keep_mask, ref.keep_mask)
    assert torch.equal(out.denominator_mask, ref.denominator_mask)
    torch.testing.assert_close(out.is_weights, ref.is_weights, rtol=1e-6, atol=0)
    assert out.metrics.keys() == ref.metrics.keys()
    for key, value in ref.metrics.items():
        assert out.metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-9, nan_ok=True), key
    assert out.metrics[F + "nonfinite_token_count"] == 0


@pytest.mark.parametrize("name", RolloutCorrectionConfig.preset_names())
def test_nonfinite_padding_is_ignored_entirely(name: str) -> None:
    c = RolloutCorrectionConfig.from_preset(name)
    old, rollout, mask = clean_batch()
    dirty_old, dirty_rollout = _dirty_padding(old, rollout)
    for policy in ("raise", "reject_sequence"):
        c_policy = RolloutCorrectionConfig.from_dict({**c.to_dict(), "nonfinite_policy": policy,
                                                      "nonfinite_max_fraction": 0.0})
        # Alternating advantage signs (read only by OPSM / DPPO-TV presets).
        adv = torch.where(torch.arange(old.shape[0]) % 2 == 0, 1.0, -1.0)
        ref = compute_rollout_correction(old, rollout, mask, c_policy, advantages=adv)
        _assert_same(compute_rollout_correction(dirty_old, dirty_rollout, mask, c_policy, advantages=adv), ref)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("c", CONFIGS[1:5])
def test_nonfinite_padding_ignored_in_any_float_dtype(dtype: torch.dtype, c: RolloutCorrectionConfig) -> None:
    old, rollout, mask = clean_batch(dtype)
    c_policy = RolloutCorrectionConfig.from_dict({**c.to_dict(), "nonfinite_policy": "mask_token"})
    ref = compute_rollout_correction(old, rollout, mask, c_policy)
    _assert_same(compute_rollout_correction(*_dirty_padding(old, rollout), mask, c_policy), ref)


def test_all_tokens_non_finite() -> None:
    old, rollout, mask = clean_batch()
    rollout[mask] = NAN
    for policy in ("reject_sequence", "mask_token"):
        for c in CONFIGS:
            c_policy = RolloutCorrectionConfig.from_dict({**c.to_dict(), "nonfinite_policy": policy})
            out = compute_rollout_correction(old, rollout, mask, c_policy)
            assert_finite(out)
            assert not out.keep_mask.any() and not out.is_weights.any()
            assert out.metrics[F + "nonfinite_token_count"] == int(mask.sum())
            assert out.metrics[F + "nonfinite_seq_count"] == 4
            assert out.metrics[F + "nonfinite_token_fraction"] == 1.0


def _defined(key: str, value: float) -> bool:
    """A finite metric, or NaN for prob_pearson where Pearson's r is undefined (docs/metrics.md)."""
    return math.isfinite(value) or (key.endswith("prob_pearson") and math.isnan(value))
