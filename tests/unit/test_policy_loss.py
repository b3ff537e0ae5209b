"""Policy losses: hand-derived PPO/dual-clip/GSPO/REINFORCE values, gradients, masking, config checks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_rollout_correction.core.aggregation import LossAggMode, aggregate_loss, count_for_denominator
from nemo_rollout_correction.core.policy_loss import (
    PolicyLossConfig,
    PolicyLossType,
    compute_policy_loss,
    gspo_loss,
    ppo_clip_loss,
    reinforce_loss,
    stats_to_means,
)

F64 = torch.float64


def _row(values: list[float]) -> torch.Tensor:
    return torch.tensor([values], dtype=F64)


def _ppo_case(
    ratios: list[float], advantages: list[float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence whose token ratios pi_theta/pi_old are exactly ``ratios``."""
    old_logprobs = _row([-1.0] * len(ratios))
    logprobs = (old_logprobs + torch.log(_row(ratios))).requires_grad_(True)
    mask = torch.ones_like(old_logprobs, dtype=torch.bool)
    return logprobs, old_logprobs, _row(advantages), mask


def test_ppo_asymmetric_clip_values_grads_and_stats() -> None:
    # eps_low = 0.2, eps_high = 0.28 (DAPO). Per token: ratio r, advantage A, expected loss, grad.
    # a: A=+1, r=1.5  -> max(-1.5, -1.28) = -1.28, clipped, grad 0
    # b: A=+1, r=0.5  -> max(-0.5, -0.8)  = -0.5,  unclipped, grad -A*r = -0.5
    # c: A=-1, r=0.5  -> max(0.5, 0.8)    = 0.8,   clipped, grad 0
    # d: A=-1, r=1.5  -> max(1.5, 1.28)   = 1.5,   unclipped, grad 1.5
    # e: A=+1, r=1.25 -> inside [0.8, 1.28]: -1.25, unclipped (a symmetric 0.2 would clip at -1.2)
    logprobs, old_logprobs, advantages, mask = _ppo_case(
        [1.5, 0.5, 0.5, 1.5, 1.25], [1.0, 1.0, -1.0, -1.0, 1.0]
    )
    out = ppo_clip_loss(logprobs, old_logprobs, advantages, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    out.per_token_loss.sum().backward()

    torch.testing.assert_close(out.per_token_loss, _row([-1.28, -0.5, 0.8, 1.5, -1.25]))
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, _row([0.0, -0.5, 0.0, 1.5, -1.25]))
    assert out.stats["pg_clipfrac_sum"].item() == 2  # tokens a and c
    assert out.stats["pg_clipfrac_lower_sum"].item() == 0
    assert out.stats["num_tokens"].item() == 5
    expected_kl = -sum(math.log(r) for r in [1.5, 0.5, 0.5, 1.5, 1.25])
    assert out.stats["ppo_kl_sum"].item() == pytest.approx(expected_kl)

    symmetric = ppo_clip_loss(logprobs, old_logprobs, advantages, mask, clip_ratio_high=0.2)
    assert symmetric.per_token_loss[0, 4].item() == pytest.approx(-1.2)


def test_dual_clip_caps_negative_advantage_losses() -> None:
    # clip_ratio_c = 3:
    # a: A=-1, r=5 -> max(5, 1.2) = 5, capped at -A*c = 3, dual-clipped, grad 0
    # b: A=-2, r=2 -> max(4, 2.4) = 4 < 6, unchanged, grad -A*r = 4
    # c: A=+1, r=5 -> max(-5, -1.2) = -1.2 (dual clip only acts on A < 0), grad 0
    logprobs, old_logprobs, advantages, mask = _ppo_case([5.0, 2.0, 5.0], [-1.0, -2.0, 1.0])
    out = ppo_clip_loss(logprobs, old_logprobs, advantages, mask, clip_ratio_c=3.0)
    out.per_token_loss.sum().backward()

    torch.testing.assert_close(out.per_token_loss, _row([3.0, 4.0, -1.2]))
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, _row([0.0, 4.0, 0.0]))
    assert out.stats["pg_clipfrac_lower_sum"].item() == 1
    # Only c: for a the unclipped term wins the PPO max; the dual clip is counted separately.
    assert out.stats["pg_clipfrac_sum"].item() == 1

    without = ppo_clip_loss(logprobs, old_logprobs, advantages, mask)
    assert without.per_token_loss[0, 0].item() == pytest.approx(5.0)


@pytest.mark.parametrize("clip_ratio_c", [1.0, 0.5, -3.0, float("nan")])
def test_dual_clip_constant_must_exceed_one(clip_ratio_c: float) -> None:
    logprobs, old_logprobs, advantages, mask = _ppo_case([1.0], [1.0])
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_clip_loss(logprobs, old_logprobs, advantages, mask, clip_ratio_c=clip_ratio_c)


def test_ppo_ratio_is_clamped_in_log_space() -> None:
    logprobs = torch.tensor([[0.0]], dtype=F64, requires_grad=True)
    old_logprobs = torch.tensor([[-1000.0]], dtype=F64)
    out = ppo_clip_loss(
        logprobs, old_logprobs, -torch.ones(1, 1, dtype=F64), torch.ones(1, 1, dtype=torch.bool)
    )
    assert out.per_token_loss.item() == pytest.approx(math.exp(20.0))


def test_is_weights_scale_the_loss_but_carry_no_gradient() -> None:
    logprobs, old_logprobs, advantages, mask = _ppo_case([1.1, 0.9], [1.0, -1.0])
    is_weights = _row([2.0, 0.5]).requires_grad_(True)
    out = ppo_clip_loss(logprobs, old_logprobs, advantages, mask, is_weights=is_weights)
    out.per_token_loss.sum().backward()

    # unweighted: [-1.1, 0.9]; the weights multiply the value and the ratio's gradient.
    torch.testing.assert_close(out.per_token_loss.detach(), _row([-2.2, 0.45]))
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, _row([-2.2, 0.45]))
    assert is_weights.grad is None


def test_ppo_gradcheck_in_float64() -> None:
    generator = torch.Generator().manual_seed(0)
    old_logprobs = -torch.rand(3, 4, generator=generator, dtype=F64)
    # Ratios within [0.9, 1.1]: inside the clip range, away from the kinks.
    logprobs = (
        old_logprobs + 0.1 * (2 * torch.rand(3, 4, generator=generator, dtype=F64) - 1)
    ).requires_grad_()
    advantages = torch.randn(3, 4, generator=generator, dtype=F64)
    is_weights = torch.rand(3, 4, generator=generator, dtype=F64) + 0.5
    mask = torch.rand(3, 4, generator=generator) > 0.3

    def loss_fn(lp: torch.Tensor) -> torch.Tensor:
        out = ppo_clip_loss(lp, old_logprobs, advantages, mask, is_weights=is_weights, clip_ratio_c=3.0)
        return aggregate_loss(out.per_token_loss, mask, "token-mean")

    assert torch.autograd.gradcheck(loss_fn, (logprobs,))


def _nan_poisoned_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = torch.tensor([[True, True, False], [False, False, False]])
    logprobs = torch.tensor([[-1.0, -2.0, float("nan")], [float("inf"), float("nan"), 0.0]], dtype=F64)
    old_logprobs = torch.tensor([[-1.1, -1.9, -float("inf")], [float("nan"), -5.0, 30.0]], dtype=F64)
    advantages = torch.tensor([[1.0, -1.0, float("inf")], [float("nan"), 1.0, -float("inf")]], dtype=F64)
    is_weights = torch.tensor([[1.0, 2.0, float("inf")], [float("nan"), 0.0, float("inf")]], dtype=F64)
    return logprobs.requires_grad_(True), old_logprobs, advantages, mask, is_weights


@pytest.mark.parametrize("loss_type", ["ppo_clip", "gspo", "reinforce"])
def test_non_finite_masked_inputs_reach_neither_loss_nor_grad(loss_type: PolicyLossType) -> None:
    logprobs, old_logprobs, advantages, mask, is_weights = _nan_poisoned_inputs()
    cfg = PolicyLossConfig(loss_type=loss_type, clip_ratio_c=3.0 if loss_type == "ppo_clip" else None)
    out = compute_policy_loss(logprobs, old_logprobs, advantages, mask, cfg, is_weights=is_weights)
    loss = aggregate_loss(out.per_token_loss, mask, "seq-mean-token-mean")
    loss.backward()

    assert (out.per_token_loss[~mask] == 0).all()
    assert torch.isfinite(out.per_token_loss).all()
    assert torch.isfinite(loss)
    assert logprobs.grad is not None
    assert torch.isfinite(logprobs.grad).all()
    assert (logprobs.grad[~mask] == 0).all()
    assert all(torch.isfinite(v) for v in out.stats.values())


@pytest.mark.parametrize("loss_type", ["ppo_clip", "gspo", "reinforce"])
def test_all_masked_batch_gives_zero_loss_and_zero_grad(loss_type: PolicyLossType) -> None:
    logprobs, old_logprobs, advantages, _, is_weights = _nan_poisoned_inputs()
    mask = torch.zeros_like(logprobs, dtype=torch.bool)
    out = compute_policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        PolicyLossConfig(loss_type=loss_type),
        is_weights=is_weights,
    )
    loss = aggregate_loss(out.per_token_loss, mask, "token-mean")
    loss.backward()
    assert loss.item() == 0.0
    assert logprobs.grad is not None
    assert (logprobs.grad == 0).all()
    means = stats_to_means(out.stats)
    assert means["num_tokens"].item() == 0
    assert all(v.item() == 0.0 for v in means.values())


def test_gspo_uses_the_sequence_ratio_with_per_token_gradient() -> None:
    # Sequence 0: log-ratios 0.1, 0.3 -> s = exp(0.2) = 1.2214, inside [0.8, 1.28]; A = +1.
    # Sequence 1: log-ratios 0.5, 0.5, 0.5 (one masked token) -> s = exp(0.5) = 1.6487 > 1.28,
    #             A = +2 -> clipped: loss -2 * 1.28 per token, grad 0.
    old_logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]], dtype=F64)
    deltas = torch.tensor([[0.1, 0.3, 0.0], [0.5, 0.5, 0.5]], dtype=F64)
    logprobs = (old_logprobs + deltas).requires_grad_(True)
    mask = torch.tensor([[True, True, False], [True, True, False]])
    advantages = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]], dtype=F64)
    out = gspo_loss(logprobs, old_logprobs, advantages, mask, clip_ratio_high=0.28)

    s0 = math.exp(0.2)
    torch.testing.assert_close(
        out.per_token_loss.detach(), torch.tensor([[-s0, -s0, 0.0], [-2.56, -2.56, 0.0]], dtype=F64)
    )
    assert out.stats["pg_clipfrac_sum"].item() == 2

    # With seq-mean-token-mean over 2 sequences, GSPO's gradient is -A * s / |y| / num_seqs per token.
    aggregate_loss(out.per_token_loss, mask, "seq-mean-token-mean").backward()
    assert logprobs.grad is not None
    expected = torch.tensor([[-s0 / 2 / 2, -s0 / 2 / 2, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(logprobs.grad, expected)


def test_gspo_gradient_matches_the_sequence_level_objective() -> None:
    generator = torch.Generator().manual_seed(1)
    old_logprobs = -torch.rand(4, 5, generator=generator, dtype=F64)
    logprobs = old_logprobs + 0.05 * torch.randn(4, 5, generator=generator, dtype=F64)
    mask = torch.arange(5) < torch.tensor([[5], [3], [1], [4]])
    seq_advantages = torch.randn(4, generator=generator, dtype=F64)
    advantages = seq_advantages.unsqueeze(-1).expand(4, 5)

    per_token = logprobs.clone().requires_grad_(True)
    out = gspo_loss(per_token, old_logprobs, advantages, mask, clip_ratio_low=0.9, clip_ratio_high=10.0)
    aggregate_loss(out.per_token_loss, mask, "seq-mean-token-mean").backward()

    # Reference: mean_i -A_i * exp(mean_t(logprobs - old_logprobs)) with nothing clipped.
    direct = logprobs.clone().requires_grad_(True)
    seq_log_ratio = ((direct - old_logprobs) * mask).sum(-1) / mask.sum(-1)
    (-seq_advantages * seq_log_ratio.exp()).mean().backward()
    torch.testing.assert_close(per_token.grad, direct.grad)


def test_gspo_accepts_a_precomputed_sequence_log_ratio() -> None:
    # A context-parallel caller passes the cp-reduced mean; the local tokens alone would say 0.
    logprobs = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = gspo_loss(
        logprobs,
        logprobs.detach(),
        torch.ones(1, 2, dtype=F64),
        mask,
        seq_mean_log_ratio=torch.tensor([0.1], dtype=F64),
    )
    torch.testing.assert_close(out.per_token_loss.detach(), torch.full((1, 2), -math.exp(0.1), dtype=F64))
    with pytest.raises(ValueError, match="seq_mean_log_ratio"):
        gspo_loss(
            logprobs, logprobs.detach(), torch.ones(1, 2, dtype=F64), mask, seq_mean_log_ratio=torch.zeros(2)
        )


def test_reinforce_is_weighted_log_likelihood() -> None:
    logprobs = _row([-1.0, -2.0, -3.0]).requires_grad_(True)
    advantages = _row([1.0, -2.0, 0.5])
    is_weights = _row([0.5, 1.0, 4.0]).requires_grad_(True)
    mask = torch.tensor([[True, True, False]])
    out = reinforce_loss(
        logprobs, advantages, mask, is_weights=is_weights, old_logprobs=_row([-1.5, -2.0, 0.0])
    )
    out.per_token_loss.sum().backward()

    # -w * A * logprobs = [-0.5*1*-1, -1*-2*-2, masked] = [0.5, -4, 0]; grad = -w * A.
    torch.testing.assert_close(out.per_token_loss.detach(), _row([0.5, -4.0, 0.0]))
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, _row([-0.5, 2.0, 0.0]))
    assert is_weights.grad is None
    assert out.stats["ppo_kl_sum"].item() == pytest.approx(-0.5)
    assert out.stats["pg_clipfrac_sum"].item() == 0
    assert "ppo_kl_sum" not in reinforce_loss(logprobs, advantages, mask).stats


def test_compute_policy_loss_dispatches_on_loss_type() -> None:
    logprobs, old_logprobs, advantages, mask = _ppo_case([1.5, 0.5, 3.0], [1.0, -1.0, -1.0])
    cfg = PolicyLossConfig(clip_ratio_high=0.28, clip_ratio_c=2.0)
    direct = ppo_clip_loss(logprobs, old_logprobs, advantages, mask, clip_ratio_high=0.28, clip_ratio_c=2.0)
    torch.testing.assert_close(
        compute_policy_loss(logprobs, old_logprobs, advantages, mask, cfg).per_token_loss,
        direct.per_token_loss,
    )

    gspo = compute_policy_loss(logprobs, old_logprobs, advantages, mask, PolicyLossConfig(loss_type="gspo"))
    torch.testing.assert_close(
        gspo.per_token_loss, gspo_loss(logprobs, old_logprobs, advantages, mask).per_token_loss
    )

    reinforce = compute_policy_loss(
        logprobs, old_logprobs, advantages, mask, PolicyLossConfig(loss_type="reinforce")
    )
    torch.testing.assert_close(reinforce.per_token_loss, -advantages * logprobs)


@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"loss_type": "dpo"}, "loss_type"),
        ({"clip_ratio_low": 1.0}, "clip_ratio_low"),
        ({"clip_ratio_low": -0.1}, "clip_ratio_low"),
        ({"clip_ratio_high": -0.1}, "clip_ratio_high"),
        ({"clip_ratio_c": 1.0}, "clip_ratio_c"),
        ({"loss_type": "gspo", "clip_ratio_c": 3.0}, "clip_ratio_c"),
        ({"loss_agg_mode": "mean"}, "loss_agg_mode"),
    ],
)
def test_config_rejects_bad_fields_by_name(kwargs: dict[str, object], field_name: str) -> None:
    with pytest.raises(ValueError, match=field_name):
        PolicyLossConfig(**kwargs)  # type: ignore[arg-type]


def test_shape_errors_name_the_tensor() -> None:
    logprobs, old_logprobs, advantages, mask = _ppo_case([1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"advantages.*broadcast_to_tokens"):
        ppo_clip_loss(logprobs, old_logprobs, advantages[0], mask)
    with pytest.raises(ValueError, match="mask shape"):
        ppo_clip_loss(logprobs, old_logprobs, advantages, mask[:, :1])
    with pytest.raises(ValueError, match="is_weights"):
        ppo_clip_loss(logprobs, old_logprobs, advantages, mask, is_weights=torch.ones(2))
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        reinforce_loss(logprobs[0], advantages[0], mask[0])


def test_stats_to_means_divides_sums_by_num_tokens() -> None:
    stats = {
        "pg_clipfrac_sum": torch.tensor(3.0, dtype=F64),
        "ppo_kl_sum": torch.tensor(-0.5, dtype=F64),
        "num_tokens": torch.tensor(4.0, dtype=F64),
    }
    means = stats_to_means(stats)
    assert means["pg_clipfrac"].item() == 0.75
    assert means["ppo_kl"].item() == -0.125
    assert means["num_tokens"].item() == 4
    with pytest.raises(ValueError, match="num_tokens"):
        stats_to_means({"ppo_kl_sum": torch.tensor(1.0)})


@pytest.mark.parametrize("loss_type", ["ppo_clip", "gspo", "reinforce"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_microbatch_split_matches_full_batch(loss_type: PolicyLossType, mode: LossAggMode) -> None:
    """Policy loss + aggregation per microbatch, global denominator passed in: same loss and grad."""
    generator = torch.Generator().manual_seed(2)
    old_logprobs = -torch.rand(6, 5, generator=generator, dtype=F64)
    logprobs = old_logprobs + 0.3 * torch.randn(6, 5, generator=generator, dtype=F64)
    advantages = torch.randn(6, 1, generator=generator, dtype=F64).expand(6, 5)
    is_weights = torch.rand(6, 5, generator=generator, dtype=F64) * 2
    mask = torch.arange(5) < torch.tensor([[5], [0], [2], [4], [1], [3]])
    cfg = PolicyLossConfig(loss_type=loss_type, loss_agg_mode=mode)

    def microbatch_loss(lp: torch.Tensor, rows: slice, denominator: torch.Tensor | None) -> torch.Tensor:
        out = compute_policy_loss(
            lp, old_logprobs[rows], advantages[rows], mask[rows], cfg, is_weights=is_weights[rows]
        )
        return aggregate_loss(
            out.per_token_loss,
            mask[rows],
            cfg.loss_agg_mode,
            num_global_tokens=denominator,
            num_global_seqs=denominator,
        )

    full = logprobs.clone().requires_grad_(True)
    full_loss = microbatch_loss(full, slice(None), None)
    full_loss.backward()

    split = logprobs.clone().requires_grad_(True)
    row_slices = [slice(0, 1), slice(1, 4), slice(4, 6)]
    denominator = sum(count_for_denominator(mask[rows], cfg.loss_agg_mode) for rows in row_slices)
    assert isinstance(denominator, torch.Tensor)
    total = sum(microbatch_loss(split[rows], rows, denominator) for rows in row_slices)
    assert isinstance(total, torch.Tensor)
    total.backward()

    torch.testing.assert_close(total.detach(), full_loss.detach())
    torch.testing.assert_close(split.grad, full.grad)


finite_logprob = st.floats(min_value=-50.0, max_value=0.0, allow_nan=False)
finite_value = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(
    logprobs=st.lists(finite_logprob, min_size=8, max_size=8),
    old_logprobs=st.lists(finite_logprob, min_size=8, max_size=8),
    advantages=st.lists(finite_value, min_size=8, max_size=8),
    is_weights=st.lists(st.floats(min_value=0.0, max_value=10.0), min_size=8, max_size=8),
    keep=st.lists(st.booleans(), min_size=8, max_size=8),
    loss_type=st.sampled_from(["ppo_clip", "gspo", "reinforce"]),
)
def test_finite_inputs_give_finite_loss_and_grad(
    logprobs: list[float],
    old_logprobs: list[float],
    advantages: list[float],
    is_weights: list[float],
    keep: list[bool],
    loss_type: PolicyLossType,
) -> None:
    lp = torch.tensor(logprobs, dtype=torch.float32).reshape(2, 4).requires_grad_(True)
    mask = torch.tensor(keep).reshape(2, 4)
    cfg = PolicyLossConfig(loss_type=loss_type, clip_ratio_c=3.0 if loss_type == "ppo_clip" else None)
    out = compute_policy_loss(
        lp,
        torch.tensor(old_logprobs).reshape(2, 4),
        torch.tensor(advantages).reshape(2, 4),
        mask,
        cfg,
        is_weights=torch.tensor(is_weights).reshape(2, 4),
    )
    loss = aggregate_loss(out.per_token_loss, mask, "token-mean")
    loss.backward()
    assert torch.isfinite(loss)
    assert lp.grad is not None
    assert torch.isfinite(lp.grad).all()
    assert (lp.grad[~mask] == 0).all()
