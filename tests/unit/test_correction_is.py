"""IS weights by hand: token / sequence / geometric levels, truncate / two-sided / mask, clamping,
batch normalisation, the denominator mask, and empty or all-rejected batches."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from nemo_rollout_correction import RolloutCorrectionConfig, compute_rollout_correction

NAN, INF = float("nan"), float("inf")


def cfg(**fields: Any) -> RolloutCorrectionConfig:
    """A config with nothing on but `fields` (the veto default is switched off unless given)."""
    return RolloutCorrectionConfig.from_dict({"rollout_token_veto_threshold": None, **fields})


# Log-ratios (old - rollout) of the valid tokens; None marks padding (loss_mask False). Padding holds
# a large log-ratio of its own, which must never show up anywhere.
LOG_RATIOS: list[list[float | None]] = [
    [0.5, -0.2, 1.0, None],
    [-1.5, 0.1, None, None],
    [0.0, 0.3, -0.4, 0.2],
]


def batch(log_ratios: list[list[float | None]] = LOG_RATIOS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = torch.tensor([[v is not None for v in row] for row in log_ratios])
    lr = torch.tensor([[7.0 if v is None else v for v in row] for row in log_ratios], dtype=torch.float64)
    rollout = torch.full(mask.shape, -1.25, dtype=torch.float64) - torch.arange(mask.shape[1]) * 0.5
    old = rollout + lr
    return old.float(), rollout.float(), mask


def valid_lrs(row: int) -> list[float]:
    return [v for v in LOG_RATIOS[row] if v is not None]


def expected_tensor(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def tok_weights(fn: Any) -> list[list[float]]:
    return [[0.0 if v is None else fn(math.exp(v)) for v in row] for row in LOG_RATIOS]


# ---- token level -------------------------------------------------------------------------------


def test_token_truncate() -> None:
    out = compute_rollout_correction(*batch(), cfg(rollout_is="token", rollout_is_threshold=2.0))
    expected = tok_weights(lambda rho: min(rho, 2.0))
    torch.testing.assert_close(out.is_weights, expected_tensor(expected), rtol=1e-6, atol=0)
    assert torch.equal(out.keep_mask, batch()[2])
    assert out.is_weights.dtype == torch.float32 and not out.is_weights.requires_grad


def test_token_two_sided_truncate() -> None:
    c = cfg(rollout_is="token", rollout_is_threshold=2.0, rollout_is_two_sided=True)
    out = compute_rollout_correction(*batch(), c)
    expected = tok_weights(lambda rho: min(max(rho, 0.5), 2.0))
    torch.testing.assert_close(out.is_weights, expected_tensor(expected), rtol=1e-6, atol=0)
    assert expected[1][0] == 0.5  # exp(-1.5) < 0.5 is clamped up to the default lower bound 1/upper

    explicit = cfg(rollout_is="token", rollout_is_threshold=2.0, rollout_is_two_sided=True,
                   rollout_is_threshold_lower=0.9)
    out = compute_rollout_correction(*batch(), explicit)
    expected = tok_weights(lambda rho: min(max(rho, 0.9), 2.0))
    torch.testing.assert_close(out.is_weights, expected_tensor(expected), rtol=1e-6, atol=0)


def test_token_mask_removes_out_of_bound_tokens() -> None:
    out = compute_rollout_correction(*batch(), cfg(rollout_is="token", rollout_is_mode="mask",
                                                   rollout_is_threshold=2.0))
    # exp(1.0) = 2.72 > 2 and exp(-1.5) = 0.22 < 0.5 leave keep_mask; the rest keep their raw ratio.
    expected_keep = torch.tensor([[True, True, False, False], [False, True, False, False], [True] * 4])
    assert torch.equal(out.keep_mask, expected_keep)
    expected = tok_weights(lambda rho: rho if 0.5 <= rho <= 2.0 else 0.0)
    torch.testing.assert_close(out.is_weights, expected_tensor(expected), rtol=1e-6, atol=0)


def test_token_mask_asymmetric_bounds_bound_the_ratio() -> None:
    # [0.9, 1.5]: rho = 1.4 stays, rho = 0.85 and rho = 1.6 go.
    lrs: list[list[float | None]] = [[math.log(1.4), math.log(0.85), math.log(1.6), math.log(0.95)]]
    c = cfg(rollout_is="token", rollout_is_mode="mask", rollout_is_threshold=1.5, rollout_is_threshold_lower=0.9)
    out = compute_rollout_correction(*batch(lrs), c)
    assert out.keep_mask.tolist() == [[True, False, False, True]]
    torch.testing.assert_close(out.is_weights, expected_tensor([[1.4, 0.0, 0.0, 0.95]]), rtol=1e-6, atol=0)


def test_mask_bound_is_inclusive() -> None:
    lrs: list[list[float | None]] = [[math.log(2.0), -math.log(2.0), 0.0]]
    out = compute_rollout_correction(*batch(lrs), cfg(rollout_is="token", rollout_is_mode="mask",
                                                      rollout_is_threshold=2.0))
    assert out.keep_mask.all()


# ---- sequence and geometric levels --------------------------------------------------------------


def seq_expected(level: str, bound: Any) -> tuple[list[float], list[bool]]:
    """Per-sequence (weight, kept) from the formula."""
    weights, kept = [], []
    for row in range(len(LOG_RATIOS)):
        lrs = valid_lrs(row)
        log_rho = sum(lrs) if level == "sequence" else sum(lrs) / len(lrs)
        w, keep = bound(math.exp(log_rho))
        weights.append(w)
        kept.append(keep)
    return weights, kept


def broadcast(per_seq: list[float], kept: list[bool]) -> torch.Tensor:
    return torch.tensor([[per_seq[r] if (v is not None and kept[r]) else 0.0 for v in row]
                         for r, row in enumerate(LOG_RATIOS)], dtype=torch.float32)


@pytest.mark.parametrize("level", ["sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "two_sided", "mask"])
def test_sequence_levels(level: str, mode: str) -> None:
    upper, lower = 2.0, 0.5
    c = cfg(rollout_is=level, rollout_is_mode="mask" if mode == "mask" else "truncate", rollout_is_threshold=upper,
            rollout_is_two_sided=mode == "two_sided")

    def bound(rho: float) -> tuple[float, bool]:
        if mode == "truncate":
            return min(rho, upper), True
        if mode == "two_sided":
            return min(max(rho, lower), upper), True
        inside = lower <= rho <= upper
        return (rho if inside else 0.0), inside

    weights, kept = seq_expected(level, bound)
    out = compute_rollout_correction(*batch(), c)
    torch.testing.assert_close(out.is_weights, broadcast(weights, kept), rtol=1e-6, atol=0)
    mask = batch()[2]
    assert torch.equal(out.keep_mask, mask & torch.tensor(kept).unsqueeze(-1))
    if mode == "mask":
        # sequence: rho = e^1.3 and e^-1.4 are out; geometric: only e^(-1.4/2) = 0.497 is out.
        assert kept == ([False, False, True] if level == "sequence" else [True, False, True])


def test_sequence_weight_is_one_value_per_sequence() -> None:
    out = compute_rollout_correction(*batch(), cfg(rollout_is="sequence", rollout_is_threshold=100.0))
    for r in range(3):
        row = out.is_weights[r][batch()[2][r]]
        assert torch.all(row == row[0])
        assert row[0].item() == pytest.approx(math.exp(sum(valid_lrs(r))), rel=1e-6)


# ---- clamping ----------------------------------------------------------------------------------


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_huge_mismatch_caps_at_e20(level: str) -> None:
    old = torch.tensor([[0.0, 0.0, -1.0], [-1e4, -3e4, -1.0]])
    rollout = torch.tensor([[-1e4, -3e4, -1.0], [0.0, 0.0, -1.0]])
    mask = torch.ones_like(old, dtype=torch.bool)
    for mode in ("truncate", "mask"):
        c = cfg(rollout_is=level, rollout_is_mode=mode, rollout_is_threshold=1e12, rollout_is_threshold_lower=1e-12)
        out = compute_rollout_correction(old, rollout, mask, c)
        assert torch.isfinite(out.is_weights).all()
        # exp(-mean logprob) of a -1e4 logprob overflows: see test_metrics.py::test_ppl_metrics_never_overflow
        assert all(_defined(k, v) for k, v in out.metrics.items() if not k.endswith(("training_ppl", "rollout_ppl")))
        w = out.is_weights
        if level == "token":
            assert w[0, 0].item() == pytest.approx(math.exp(20), rel=1e-6)
            assert w[0, 1].item() == pytest.approx(math.exp(20), rel=1e-6)
            assert 0 <= w[1, 0].item() <= 1e-8  # exp(-20) ~ 2e-9 (see the precision test below)
            assert w[1, 2].item() == 1.0
        elif level == "sequence":
            assert w[0, 0].item() == pytest.approx(math.exp(20), rel=1e-6)
            assert w[1, 0].item() == pytest.approx(math.exp(-20), rel=1e-6)
        else:  # geometric: the mean log-ratio 4e4/3 is clamped too
            assert w[0, 2].item() == pytest.approx(math.exp(20), rel=1e-6)
            assert w[1, 2].item() == pytest.approx(math.exp(-20), rel=1e-6)


def test_small_token_ratios_keep_relative_precision() -> None:
    lrs = [-5.0, -10.0, -15.0, -20.0, -1e4]
    old = torch.tensor([lrs]) - 1.0
    rollout = torch.full_like(old, -1.0)
    out = compute_rollout_correction(old, rollout, torch.ones_like(old, dtype=torch.bool),
                                     cfg(rollout_is="token", rollout_is_threshold=2.0))
    expected = torch.tensor([[math.exp(max(v, -20.0)) for v in lrs]])
    torch.testing.assert_close(out.is_weights, expected, rtol=1e-5, atol=0)


# ---- no IS -------------------------------------------------------------------------------------


def test_no_is_weights_equal_keep_mask() -> None:
    for c in (cfg(), cfg(rollout_rs="token_k1", rollout_rs_threshold=2.0),
              cfg(rollout_rs="seq_sum_k1", rollout_rs_threshold=2.0)):
        out = compute_rollout_correction(*batch(), c)
        assert torch.equal(out.is_weights, out.keep_mask.float())
        assert "rollout_corr/rollout_is_mean" not in out.metrics


MUTATION_CONFIGS = [RolloutCorrectionConfig.from_preset(n) for n in RolloutCorrectionConfig.preset_names()] + [
    cfg(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.9_1.1"),
    cfg(rollout_is="token", rollout_is_mode="mask", rollout_is_threshold=1.05),
]


@pytest.mark.parametrize("c", MUTATION_CONFIGS)
def test_inputs_are_not_modified_and_outputs_detached(c: RolloutCorrectionConfig) -> None:
    old, rollout, mask = batch()
    old.requires_grad_(True)
    before = (old.detach().clone(), rollout.clone(), mask.clone())
    advantages = torch.where(torch.arange(old.shape[0]) % 2 == 0, 1.0, -1.0)  # for OPSM / DPPO-TV
    adv_before = advantages.clone()
    out = compute_rollout_correction(old, rollout, mask, c, advantages=advantages)
    assert torch.equal(advantages, adv_before)
    assert not out.is_weights.requires_grad
    assert torch.equal(old.detach(), before[0]) and torch.equal(rollout, before[1]) and torch.equal(mask, before[2])
    # The outputs own their memory: writing to them cannot reach the caller's tensors.
    out.keep_mask.fill_(False)
    out.denominator_mask.fill_(False)
    out.is_weights.fill_(0.0)
    assert torch.equal(mask, before[2]) and torch.equal(rollout, before[1])


# ---- batch normalisation -----------------------------------------------------------------------


def test_batch_normalize_token_level() -> None:
    c = cfg(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    raw = tok_weights(lambda rho: min(rho, 2.0))
    kept = [w for r, row in enumerate(raw) for w, v in zip(row, LOG_RATIOS[r], strict=True) if v is not None]
    mean = sum(kept) / len(kept)
    out = compute_rollout_correction(*batch(), c)
    torch.testing.assert_close(out.is_weights, expected_tensor(raw) / mean, rtol=1e-6, atol=0)
    assert out.metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(mean, rel=1e-6)
    kept_mean = out.is_weights[out.keep_mask].double().mean().item()
    assert kept_mean == pytest.approx(1.0, rel=1e-6)

    given = compute_rollout_correction(*batch(), c, is_weight_mean=2.5)
    torch.testing.assert_close(given.is_weights, expected_tensor(raw) / 2.5, rtol=1e-6, atol=0)
    assert given.metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(2.5)
    as_tensor = compute_rollout_correction(*batch(), c, is_weight_mean=torch.tensor(2.5))
    assert torch.equal(as_tensor.is_weights, given.is_weights)


def test_batch_normalize_token_mask_uses_kept_tokens_only() -> None:
    c = cfg(rollout_is="token", rollout_is_mode="mask", rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    raw = tok_weights(lambda rho: rho if 0.5 <= rho <= 2.0 else 0.0)
    kept = [w for row in raw for w in row if w > 0]
    mean = sum(kept) / len(kept)
    out = compute_rollout_correction(*batch(), c)
    torch.testing.assert_close(out.is_weights, expected_tensor(raw) / mean, rtol=1e-6, atol=0)
    assert out.metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(mean, rel=1e-6)


@pytest.mark.parametrize("level", ["sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_batch_normalize_sequence_levels_use_kept_sequences(level: str, mode: str) -> None:
    c = cfg(rollout_is=level, rollout_is_mode=mode, rollout_is_threshold=2.0, rollout_is_batch_normalize=True)

    def bound(rho: float) -> tuple[float, bool]:
        if mode == "truncate":
            return min(rho, 2.0), True
        inside = 0.5 <= rho <= 2.0
        return (rho if inside else 0.0), inside

    weights, kept = seq_expected(level, bound)
    mean = sum(w for w, k in zip(weights, kept, strict=True) if k) / sum(kept)
    out = compute_rollout_correction(*batch(), c)
    torch.testing.assert_close(out.is_weights, broadcast(weights, kept) / mean, rtol=1e-6, atol=0)
    assert out.metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(mean, rel=1e-6)
    given = compute_rollout_correction(*batch(), c, is_weight_mean=0.8)
    torch.testing.assert_close(given.is_weights, broadcast(weights, kept) / 0.8, rtol=1e-6, atol=0)


def test_batch_normalize_all_rejected_keeps_zero_weights() -> None:
    c = cfg(rollout_is="token", rollout_is_mode="mask", rollout_is_threshold=1.01, rollout_is_batch_normalize=True)
    lrs: list[list[float | None]] = [[0.5, -0.5, None]]
    out = compute_rollout_correction(*batch(lrs), c)
    assert not out.keep_mask.any()
    assert torch.equal(out.is_weights, torch.zeros(1, 3))
    assert all(_defined(k, v) for k, v in out.metrics.items())


# ---- denominator mask ----------------------------------------------------------------------------


def test_denominator_is_keep_mask_by_default() -> None:
    out = compute_rollout_correction(*batch(), cfg(rollout_is="token", rollout_is_mode="mask",
                                                   rollout_is_threshold=2.0))
    assert torch.equal(out.denominator_mask, out.keep_mask)
    assert out.num_denominator_tokens == out.num_kept_tokens == 7
    assert out.metrics["rollout_corr/num_denominator_tokens"] == 7


@pytest.mark.parametrize("policy", ["reject_sequence", "mask_token"])
def test_rejected_tokens_in_denominator(policy: str) -> None:
    old, rollout, mask = batch()
    rollout[2, 1] = NAN  # a non-finite loss token in row 2
    c = cfg(rollout_is="sequence", rollout_is_mode="mask", rollout_is_threshold=2.0,
            rejected_tokens_in_denominator=True, nonfinite_policy=policy)
    out = compute_rollout_correction(old, rollout, mask, c)
    # rows 0 and 1 are IS-rejected (e^1.3 and e^-1.4) but stay in the denominator.
    finite_loss = mask.clone()
    finite_loss[2, 1] = False
    expected = finite_loss.clone()
    if policy == "reject_sequence":
        expected[2] = False
        assert not out.keep_mask.any()
    else:
        assert torch.equal(out.keep_mask[2], finite_loss[2])
    assert torch.equal(out.denominator_mask, expected)
    assert out.num_denominator_tokens == int(expected.sum())
    assert out.metrics["rollout_corr/num_denominator_tokens"] == int(expected.sum())
    assert not out.keep_mask[:2].any()


# ---- empty and all-rejected batches ----------------------------------------------------------------


def _assert_empty_result(out: Any, shape: tuple[int, int]) -> None:
    assert out.is_weights.shape == shape and out.keep_mask.shape == shape
    assert not out.keep_mask.any() and not (out.is_weights != 0).any()
    assert all(_defined(k, v) for k, v in out.metrics.items())
    for name in ("num_kept_tokens", "num_kept_seqs", "num_denominator_tokens"):
        assert out.metrics[f"rollout_corr/{name}"] == 0


EMPTY_CONFIGS = [
    cfg(),
    cfg(rollout_is="token", rollout_is_batch_normalize=True),
    cfg(rollout_is="sequence", rollout_is_mode="mask"),
    cfg(rollout_is="geometric", rollout_rs="seq_mean_k1,token_k3", rollout_rs_threshold="0.999_1.001,0.01"),
]


@pytest.mark.parametrize("c", EMPTY_CONFIGS)
def test_all_false_loss_mask(c: RolloutCorrectionConfig) -> None:
    old, rollout, mask = batch()
    out = compute_rollout_correction(old, rollout, torch.zeros_like(mask), c)
    _assert_empty_result(out, (3, 4))
    for name in ("num_valid_tokens", "num_valid_seqs", "kl", "k3_kl", "chi2_token", "chi2_seq", "training_ppl"):
        assert out.metrics[f"rollout_corr/{name}"] == 0


@pytest.mark.parametrize("c", EMPTY_CONFIGS)
def test_all_rejected(c: RolloutCorrectionConfig) -> None:
    old, rollout, mask = batch()
    rollout[:, 0] = NAN  # every row has a non-finite loss token: reject_sequence drops all
    out = compute_rollout_correction(old, rollout, mask, c)
    _assert_empty_result(out, (3, 4))
    assert out.metrics["rollout_corr/nonfinite_seq_count"] == 3


@pytest.mark.parametrize("c", EMPTY_CONFIGS)
def test_zero_length_sequences(c: RolloutCorrectionConfig) -> None:
    z = torch.zeros(3, 0)
    _assert_empty_result(compute_rollout_correction(z, z, z.bool(), c), (3, 0))


@pytest.mark.parametrize("c", [cfg(rollout_token_veto_threshold=1e-4),
                               cfg(rollout_rs="seq_max_k2", rollout_rs_threshold=1.0)])
def test_zero_length_sequences_with_veto_or_seq_max(c: RolloutCorrectionConfig) -> None:
    z = torch.zeros(3, 0)
    _assert_empty_result(compute_rollout_correction(z, z, z.bool(), c), (3, 0))


@pytest.mark.parametrize("c", EMPTY_CONFIGS)
def test_zero_rows(c: RolloutCorrectionConfig) -> None:
    z = torch.zeros(0, 5)
    _assert_empty_result(compute_rollout_correction(z, z, z.bool(), c), (0, 5))


def _defined(key: str, value: float) -> bool:
    """A finite metric, or NaN for prob_pearson where Pearson's r is undefined (docs/metrics.md)."""
    return math.isfinite(value) or (key.endswith("prob_pearson") and math.isnan(value))
