"""rollout_corrected_policy_loss: decoupled / bypass / pure-IS / metrics-only values and gradients by
hand, detached IS weights, the global denominator across microbatches, and zero loss with zero
gradient for empty or all-rejected batches."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from nemo_rollout_correction import RolloutCorrectionConfig
from nemo_rollout_correction.core.objective import rollout_corrected_policy_loss
from nemo_rollout_correction.core.policy_loss import PolicyLossConfig

F64 = torch.float64
NAN = float("nan")


def cfg(**fields: Any) -> RolloutCorrectionConfig:
    return RolloutCorrectionConfig.from_dict({"rollout_token_veto_threshold": None, **fields})


# Two sequences; row 1 has one padding token. Ratios chosen to hit both PPO clip sides.
ROLLOUT = [[-1.0, -2.0, -0.5, -1.5], [-0.7, -1.2, -2.2, -3.0]]
OLD = [[-0.9, -2.4, -0.5, -0.6], [-0.7, -1.0, -2.5, -3.0]]
LOGPROBS = [[-0.6, -2.5, -0.8, -0.7], [-0.9, -1.0, -2.0, -9.0]]
ADV = [[1.0, -1.0, 0.5, -2.0], [2.0, 1.5, -0.5, 1.0]]
MASK = [[True, True, True, True], [True, True, True, False]]


def tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    lp = torch.tensor(LOGPROBS, dtype=F64, requires_grad=True)
    return lp, torch.tensor(OLD, dtype=F64), torch.tensor(ROLLOUT, dtype=F64), torch.tensor(ADV, dtype=F64), \
        torch.tensor(MASK)


def ppo_token(lp: float, ref: float, adv: float, eps: float = 0.2) -> tuple[float, float]:
    """PPO clipped loss of one token and its derivative w.r.t. lp."""
    r = math.exp(lp - ref)
    unclipped, clipped = -adv * r, -adv * min(max(r, 1 - eps), 1 + eps)
    if unclipped >= clipped:
        return unclipped, -adv * r
    return clipped, 0.0


def tokens() -> list[tuple[int, int]]:
    return [(i, j) for i in range(2) for j in range(4) if MASK[i][j]]


def expected_loss_and_grad(weight: Any, per_token: Any, denominator: float) -> tuple[float, torch.Tensor]:
    loss, grad = 0.0, torch.zeros(2, 4, dtype=F64)
    for i, j in tokens():
        value, d = per_token(i, j)
        loss += weight(i, j) * value
        grad[i, j] = weight(i, j) * d / denominator
    return loss / denominator, grad


def test_hand_case_hits_both_clip_sides() -> None:
    clipped = [ppo_token(LOGPROBS[i][j], OLD[i][j], ADV[i][j])[1] == 0.0 for i, j in tokens()]
    assert any(clipped) and not all(clipped)


def test_decoupled_needs_old_logprobs() -> None:
    lp, _, rollout, adv, mask = tensors()
    with pytest.raises(ValueError, match="old_logprobs"):
        rollout_corrected_policy_loss(lp, rollout, adv, mask, cfg(rollout_is="token"))


def test_decoupled_token_tis_value_and_gradient() -> None:
    lp, old, rollout, adv, mask = tensors()
    old.requires_grad_(True)  # pi_old must get no gradient: the IS weights are detached
    out = rollout_corrected_policy_loss(lp, rollout, adv, mask, cfg(rollout_is="token", rollout_is_threshold=1.3),
                                        old_logprobs=old)
    out.loss.backward()

    def weight(i: int, j: int) -> float:
        return min(math.exp(OLD[i][j] - ROLLOUT[i][j]), 1.3)

    loss, grad = expected_loss_and_grad(weight, lambda i, j: ppo_token(LOGPROBS[i][j], OLD[i][j], ADV[i][j]), 7)
    # the IS weights are computed in float32 (inputs are cast); terms of size ~1 partly cancel
    assert out.loss.item() == pytest.approx(loss, rel=1e-6, abs=1e-6)
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, grad, rtol=1e-6, atol=1e-7)
    assert old.grad is None
    assert not out.correction.is_weights.requires_grad


def test_decoupled_sequence_is_value_and_gradient() -> None:
    lp, old, rollout, adv, mask = tensors()
    out = rollout_corrected_policy_loss(lp, rollout, adv, mask, cfg(rollout_is="sequence", rollout_is_threshold=2.0),
                                        old_logprobs=old)
    out.loss.backward()
    seq_w = [min(math.exp(sum(OLD[i][j] - ROLLOUT[i][j] for j in range(4) if MASK[i][j])), 2.0) for i in range(2)]
    loss, grad = expected_loss_and_grad(lambda i, j: seq_w[i],
                                        lambda i, j: ppo_token(LOGPROBS[i][j], OLD[i][j], ADV[i][j]), 7)
    # is_weights are float32: allow their rounding (terms of size ~1 partly cancel in the sum)
    assert out.loss.item() == pytest.approx(loss, rel=1e-6, abs=1e-6)
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, grad, rtol=1e-6, atol=1e-7)


def test_bypass_ppo_clip_uses_rollout_as_pi_old() -> None:
    lp, old, rollout, adv, mask = tensors()
    c = RolloutCorrectionConfig.from_preset("bypass_ppo_clip", rollout_token_veto_threshold=None)
    out = rollout_corrected_policy_loss(lp, rollout, adv, mask, c, old_logprobs=old)  # old is ignored
    out.loss.backward()
    loss, grad = expected_loss_and_grad(lambda i, j: 1.0,
                                        lambda i, j: ppo_token(LOGPROBS[i][j], ROLLOUT[i][j], ADV[i][j]), 7)
    assert out.loss.item() == pytest.approx(loss, rel=1e-9)
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, grad, rtol=1e-9, atol=1e-12)
    # diagnostics compare the current policy with the rollout
    kl = sum(ROLLOUT[i][j] - LOGPROBS[i][j] for i, j in tokens()) / 7
    assert out.correction.metrics["rollout_corr/kl"] == pytest.approx(kl, rel=1e-5)


def test_bypass_rejection_judged_on_current_policy() -> None:
    lp, _, rollout, adv, mask = tensors()
    c = cfg(bypass_mode=True, rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25")
    out = rollout_corrected_policy_loss(lp, rollout, adv, mask, c)
    expected = torch.tensor([[0.8 <= math.exp(LOGPROBS[i][j] - ROLLOUT[i][j]) <= 1.25 and MASK[i][j]
                              for j in range(4)] for i in range(2)])
    assert torch.equal(out.correction.keep_mask, expected)
    kept = [(i, j) for i, j in tokens() if expected[i, j]]
    loss = sum(ppo_token(LOGPROBS[i][j], ROLLOUT[i][j], ADV[i][j])[0] for i, j in kept) / len(kept)
    assert out.loss.item() == pytest.approx(loss, rel=1e-9)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_pure_is_gradient(level: str) -> None:
    lp, _, rollout, adv, mask = tensors()
    c = RolloutCorrectionConfig.from_preset("pure_is", rollout_is=level, rollout_is_threshold=1.5,
                                            rollout_token_veto_threshold=None)
    assert c.pure_is
    out = rollout_corrected_policy_loss(lp, rollout, adv, mask, c)
    out.loss.backward()
    if level == "token":
        def weight(i: int, j: int) -> float:
            return min(math.exp(LOGPROBS[i][j] - ROLLOUT[i][j]), 1.5)
    else:
        seq = [min(math.exp(sum(LOGPROBS[i][j] - ROLLOUT[i][j] for j in range(4) if MASK[i][j])), 1.5)
               for i in range(2)]

        def weight(i: int, j: int) -> float:
            return seq[i]
    # -sg(w) * A * log pi: value -w A lp, gradient -w A (no clipping, no ratio gradient)
    loss, grad = expected_loss_and_grad(weight, lambda i, j: (-ADV[i][j] * LOGPROBS[i][j], -ADV[i][j]), 7)
    assert out.loss.item() == pytest.approx(loss, rel=1e-6, abs=1e-6)
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, grad, rtol=1e-6, atol=1e-7)


def test_metrics_only_loss_is_plain_ppo() -> None:
    lp, old, rollout, adv, mask = tensors()
    c = cfg(rollout_is="token", rollout_is_mode="mask", rollout_is_threshold=1.1, rollout_rs="seq_sum_k1",
            rollout_rs_threshold="0.9_1.1", metrics_only=True, rollout_token_veto_threshold=0.9)
    out = rollout_corrected_policy_loss(lp, rollout, adv, mask, c, old_logprobs=old)
    out.loss.backward()
    loss, grad = expected_loss_and_grad(lambda i, j: 1.0,
                                        lambda i, j: ppo_token(LOGPROBS[i][j], OLD[i][j], ADV[i][j]), 7)
    assert out.loss.item() == pytest.approx(loss, rel=1e-9)
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, grad, rtol=1e-9, atol=1e-12)
    # ... while the diagnostics still report what would have been rejected
    assert out.correction.metrics["rollout_corr/rollout_is_masked_fraction"] > 0


def test_rejected_tokens_in_denominator() -> None:
    lp, old, rollout, adv, mask = tensors()
    base = {"rollout_is": "token", "rollout_is_mode": "mask", "rollout_is_threshold": 1.3}
    out_default = rollout_corrected_policy_loss(lp, rollout, adv, mask, cfg(**base), old_logprobs=old)
    out_kept = rollout_corrected_policy_loss(lp, rollout, adv, mask, cfg(**base, rejected_tokens_in_denominator=True),
                                             old_logprobs=old)
    kept = int(out_default.correction.keep_mask.sum())
    assert 0 < kept < 7
    assert out_kept.loss.item() == pytest.approx(out_default.loss.item() * kept / 7, rel=1e-9)


def test_advantages_per_sequence_broadcast() -> None:
    lp, old, rollout, _, mask = tensors()
    adv_seq = torch.tensor([0.5, -1.0], dtype=F64)
    c = cfg(rollout_is="token")
    a = rollout_corrected_policy_loss(lp, rollout, adv_seq, mask, c, old_logprobs=old)
    b = rollout_corrected_policy_loss(lp, rollout, adv_seq[:, None].expand(2, 4), mask, c, old_logprobs=old)
    assert a.loss.item() == b.loss.item()


# ---- global denominator across microbatches ------------------------------------------------------


def _random_case(seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(8, 12, generator=gen, dtype=F64) * 2
    old = rollout + 0.2 * torch.randn(8, 12, generator=gen, dtype=F64)
    lp = old + 0.1 * torch.randn(8, 12, generator=gen, dtype=F64)
    adv = torch.randn(8, 12, generator=gen, dtype=F64)
    mask = torch.rand(8, 12, generator=gen) > 0.25
    mask[5] = False
    return lp, old, rollout, adv, mask


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("c", [
    cfg(rollout_is="token", rollout_is_threshold=1.3),
    cfg(rollout_is="sequence", rollout_is_mode="mask", rollout_is_threshold=2.0, rollout_rs="token_k1",
        rollout_rs_threshold="0.7_1.4"),
    cfg(rollout_is="geometric", rollout_is_batch_normalize=True, rejected_tokens_in_denominator=True,
        rollout_rs="seq_mean_k1", rollout_rs_threshold="0.95_1.05"),
    cfg(bypass_mode=True, loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.2),
])
def test_microbatches_with_global_denominator_sum_to_full_batch(agg: str, c: RolloutCorrectionConfig) -> None:
    lp, old, rollout, adv, mask = _random_case(0)
    loss_cfg = PolicyLossConfig(loss_agg_mode=agg)  # type: ignore[arg-type]
    full_lp = lp.clone().requires_grad_(True)
    full = rollout_corrected_policy_loss(full_lp, rollout, adv, mask, c, loss_cfg, old_logprobs=old)
    full.loss.backward()
    num_tokens = full.correction.denominator_mask.sum()
    num_seqs = full.correction.denominator_mask.any(-1).sum()
    mean = None
    if c.rollout_is_batch_normalize:
        mean = full.correction.metrics["rollout_corr/rollout_is_batch_norm_factor"]

    micro_lp = lp.clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    counted_tokens = 0
    for rows in (slice(0, 3), slice(3, 6), slice(6, 8)):
        out = rollout_corrected_policy_loss(micro_lp[rows], rollout[rows], adv[rows], mask[rows], c, loss_cfg,
                                            old_logprobs=old[rows], num_global_tokens=num_tokens,
                                            num_global_seqs=num_seqs, is_weight_mean=mean)
        counted_tokens += out.correction.num_denominator_tokens
        total = total + out.loss
    total.backward()
    assert counted_tokens == int(num_tokens)
    assert total.item() == pytest.approx(full.loss.item(), rel=1e-6, abs=1e-12)
    assert micro_lp.grad is not None and full_lp.grad is not None
    torch.testing.assert_close(micro_lp.grad, full_lp.grad, rtol=1e-6, atol=1e-12)


# ---- empty and all-rejected batches: zero loss, zero gradient (decision 5) ------------------------


def _assert_zero_loss_and_grad(out: Any, lp: torch.Tensor) -> None:
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert lp.grad is not None
    assert torch.equal(lp.grad, torch.zeros_like(lp))
    # prob_pearson is undefined without kept tokens: NaN (docs/metrics.md), every other metric a number
    assert all(math.isfinite(v) for k, v in out.correction.metrics.items() if k != "rollout_corr/prob_pearson")


EMPTY_CASES = [
    cfg(rollout_is="token"),
    cfg(rollout_is="sequence", rollout_is_mode="mask"),
    RolloutCorrectionConfig.from_preset("pure_is"),
    RolloutCorrectionConfig.from_preset("bypass_ppo_clip_geo_rs"),
]


@pytest.mark.parametrize("c", EMPTY_CASES)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_all_false_mask_gives_zero_loss_and_gradient(c: RolloutCorrectionConfig, agg: str) -> None:
    lp, old, rollout, adv, mask = tensors()
    out = rollout_corrected_policy_loss(lp, rollout, adv, torch.zeros_like(mask), c,
                                        PolicyLossConfig(loss_agg_mode=agg),  # type: ignore[arg-type]
                                        old_logprobs=old)
    _assert_zero_loss_and_grad(out, lp)


@pytest.mark.parametrize("c", EMPTY_CASES)
def test_all_rejected_gives_zero_loss_and_gradient(c: RolloutCorrectionConfig) -> None:
    lp, old, rollout, adv, mask = tensors()
    rollout = rollout.clone()
    rollout[:, 0] = NAN  # every sequence has a non-finite rollout logprob: all rejected
    out = rollout_corrected_policy_loss(lp, rollout, adv, mask, c, old_logprobs=old)
    assert not out.correction.keep_mask.any()
    _assert_zero_loss_and_grad(out, lp)


def test_all_rejected_by_rs_gives_zero_loss_and_gradient() -> None:
    lp, old, rollout, adv, mask = tensors()
    c = cfg(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="1.5_2.0")
    out = rollout_corrected_policy_loss(lp, rollout, adv, mask, c, old_logprobs=old)
    assert not out.correction.keep_mask.any()
    _assert_zero_loss_and_grad(out, lp)


def test_nonfinite_inputs_never_reach_loss_or_gradient() -> None:
    lp, old, rollout, adv, mask = tensors()
    rollout = rollout.clone()
    old = old.clone()
    rollout[0, 1] = NAN  # loss token: row 0 rejected
    old[1, 3] = float("inf")  # padding
    with torch.no_grad():
        lp[1, 3] = NAN  # padding in the current policy too
    for policy in ("reject_sequence", "mask_token"):
        lp.grad = None
        c = cfg(rollout_is="sequence", nonfinite_policy=policy)
        out = rollout_corrected_policy_loss(lp, rollout, adv, mask, c, old_logprobs=old)
        out.loss.backward()
        assert math.isfinite(out.loss.item())
        assert lp.grad is not None and torch.isfinite(lp.grad).all()
        assert lp.grad[1, 3] == 0 and lp.grad[0, 1] == 0
        assert (lp.grad[0] == 0).all() == (policy == "reject_sequence")


def test_zero_row_batch_gives_zero_loss_and_gradient() -> None:
    lp = torch.zeros(0, 4, dtype=F64, requires_grad=True)
    z = torch.zeros(0, 4, dtype=F64)
    out = rollout_corrected_policy_loss(lp, z, z, z.bool(), cfg(rollout_is="token"), old_logprobs=z)
    _assert_zero_loss_and_grad(out, lp)
