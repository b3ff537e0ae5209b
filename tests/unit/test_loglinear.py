"""core/loglinear.py: pi_old from rollout and current logprobs (AReaL's loglinear), its endpoints and error bound."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.loglinear import (
    loglinear_alpha,
    loglinear_error_bound,
    loglinear_error_partials,
    loglinear_old_logprobs,
)


def test_alpha_from_versions() -> None:
    assert float(loglinear_alpha(0, 2, 3)) == pytest.approx(2 / 3)
    assert float(loglinear_alpha(5, 5, 8)) == 0.0  # pi_old is the behaviour version: rollout logprobs
    assert float(loglinear_alpha(5, 8, 8)) == 1.0  # pi_old is the current version
    # synchronous loop, one update per step: all equal -> alpha 1 (pi_old = the loss pass's logprobs), not AReaL's 0
    assert float(loglinear_alpha(4, 4, 4)) == 1.0
    # per-token versions (async rollouts): each token its own alpha; out-of-order versions clamp
    v_b = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    assert loglinear_alpha(v_b, 2, 3).tolist()[0] == pytest.approx([2 / 3, 0.5, 0.0, 1.0])
    assert float(loglinear_alpha(0, 5, 3)) == 1.0


def test_endpoints_are_exact_and_gradient_free() -> None:
    gen = torch.Generator().manual_seed(0)
    rollout = -torch.rand(3, 7, generator=gen) * 5
    current = (rollout + 1e-3 * torch.randn(3, 7, generator=gen)).requires_grad_(True)
    one = loglinear_old_logprobs(rollout, current, 1.0)
    zero = loglinear_old_logprobs(rollout, current, 0.0)
    assert torch.equal(one, current.detach()) and not one.requires_grad
    assert torch.equal(zero, rollout)
    # a non-finite rollout value does not leak into an alpha = 1 token
    rollout[0, 0] = float("nan")
    assert torch.isfinite(loglinear_old_logprobs(rollout, current, 1.0)).all()


def test_exact_when_logprobs_are_linear_in_the_version() -> None:
    gen = torch.Generator().manual_seed(1)
    a, b = -torch.rand(4, 9, generator=gen) * 3, 0.05 * torch.randn(4, 9, generator=gen)
    a, b = a.double(), b.double()
    f = lambda v: a + b * v  # noqa: E731
    alpha = loglinear_alpha(1, 3, 6)
    approx = loglinear_old_logprobs(f(1), f(6), alpha)
    torch.testing.assert_close(approx, f(3), rtol=0, atol=1e-12)


def test_shape_mismatch_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"same \[batch, seq\] shape"):
        loglinear_old_logprobs(torch.zeros(2, 3), torch.zeros(2, 4), 0.5)


def _trainer_logprobs(v: float, tokens: torch.Tensor, z0: torch.Tensor, d1: torch.Tensor,
                      d2: torch.Tensor) -> torch.Tensor:
    """f(v): a toy policy whose logits move along a quadratic path in the version v (float64)."""
    logits = z0 + v * d1 + v * v * d2
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def test_error_bound_holds_on_a_seeded_policy_path() -> None:
    """|approx - f(v_old)| <= (M/2)(v_old - v_b)(v_theta - v_old) + (1 - alpha)|delta| on every token."""
    gen = torch.Generator().manual_seed(14)
    batch, seq, vocab = 8, 32, 50
    z0 = torch.randn(batch, seq, vocab, generator=gen, dtype=torch.float64) * 2
    d1 = torch.randn(batch, seq, vocab, generator=gen, dtype=torch.float64) * 0.1
    d2 = torch.randn(batch, seq, vocab, generator=gen, dtype=torch.float64) * 0.02
    tokens = torch.multinomial(torch.softmax(z0, -1).reshape(-1, vocab), 1, generator=gen).reshape(batch, seq)
    v_b, v_o, v_t = 0.0, 2.0, 3.0
    delta = 1e-3 * torch.randn(batch, seq, generator=gen, dtype=torch.float64)  # the engine's numerics
    rollout = _trainer_logprobs(v_b, tokens, z0, d1, d2) + delta
    current = _trainer_logprobs(v_t, tokens, z0, d1, d2)
    truth = _trainer_logprobs(v_o, tokens, z0, d1, d2)
    alpha = loglinear_alpha(v_b, v_o, v_t)
    approx = loglinear_old_logprobs(rollout, current, alpha)
    # M per token: the largest second difference of f over a fine grid of [v_b, v_theta]
    h = 0.01
    grid = torch.stack([_trainer_logprobs(v_b + i * h, tokens, z0, d1, d2) for i in range(int((v_t - v_b) / h) + 1)])
    curvature = ((grid[2:] - 2 * grid[1:-1] + grid[:-2]) / (h * h)).abs().amax(0)
    bound = 0.5 * curvature * (v_o - v_b) * (v_t - v_o) + (1 - alpha) * delta.abs()
    error = (approx - truth).abs()
    assert (error <= bound * 1.01 + 1e-9).all(), float((error - bound).max())
    # the bound is informative, and the interpolation beats both of its inputs used alone
    assert float(error.max()) > 0.05 * float(bound.max())
    assert float(error.mean()) < float((rollout - truth).abs().mean())
    assert float(error.mean()) < float((current - truth).abs().mean())
    # the helper agrees with the bound written out above (one M for all tokens)
    M = float(curvature.max())
    assert (error <= loglinear_error_bound(alpha, v_b, v_o, v_t, M, delta) * 1.01 + 1e-9).all()


def test_error_partials() -> None:
    approx = torch.tensor([[0.0, 1.0, 5.0], [2.0, float("nan"), 0.0]])
    truth = torch.tensor([[0.5, 1.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    parts = loglinear_error_partials(approx, truth, mask)
    assert float(parts["num_tokens"]) == 3.0  # the NaN token is excluded, the masked 5.0 too
    assert float(parts["abs_error_sum"]) == pytest.approx(2.5)
    assert float(parts["sq_error_sum"]) == pytest.approx(4.25)
    assert float(parts["abs_error_max"]) == 2.0
    empty = loglinear_error_partials(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.bool))
    assert float(empty["abs_error_max"]) == 0.0 and float(empty["num_tokens"]) == 0.0


@given(st.floats(0.0, 1.0), st.floats(-30.0, 0.0), st.floats(-30.0, 0.0))
def test_result_lies_between_its_inputs(alpha: float, rollout: float, current: float) -> None:
    out = float(loglinear_old_logprobs(torch.tensor([[rollout]], dtype=torch.float64),
                                       torch.tensor([[current]], dtype=torch.float64), alpha))
    lo, hi = min(rollout, current), max(rollout, current)
    assert lo - 1e-12 <= out <= hi + 1e-12
    assert math.isfinite(out)


def test_config_fields_validate() -> None:
    cfg = RolloutCorrectionConfig.from_preset("token_tis", old_logprob_source="loglinear", loglinear_check_every=10)
    assert (cfg.old_logprob_source, cfg.loglinear_check_every) == ("loglinear", 10)
    assert RolloutCorrectionConfig().old_logprob_source == "forward"
    with pytest.raises(ValueError, match=r"old_logprob_source must be one of \['forward', 'loglinear'\]"):
        RolloutCorrectionConfig(old_logprob_source="recompute")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loglinear_check_every must be an integer >= 0"):
        RolloutCorrectionConfig(old_logprob_source="loglinear", loglinear_check_every=-2)
    with pytest.raises(ValueError, match="only applies with old_logprob_source='loglinear'"):
        RolloutCorrectionConfig(loglinear_check_every=5)
    with pytest.raises(ValueError, match="bypass_mode=true has no such pass"):
        RolloutCorrectionConfig(old_logprob_source="loglinear", bypass_mode=True)
