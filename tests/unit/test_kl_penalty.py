"""KL penalty estimators: hand values, gradients (k1+/k3+ carry the k2 gradient), aliases, masking."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_rollout_correction.core.kl_penalty import KL_ESTIMATORS, KLEstimator, kl_penalty

F64 = torch.float64
# d = logprobs - ref_logprobs = [0.5, -1.0]
LOGPROBS = [-1.0, -2.0]
REF_LOGPROBS = [-1.5, -1.0]
D = [0.5, -1.0]


def _k3(d: float) -> float:
    r = math.exp(-d)  # pi_ref / pi_theta
    return r - math.log(r) - 1.0


EXPECTED_VALUES = {
    "k1": D,
    "abs": [0.5, 1.0],
    "k2": [0.125, 0.5],
    "k3": [_k3(0.5), _k3(-1.0)],  # [exp(-0.5) - 0.5, e - 2]
    "k1+": D,
    "k3+": [_k3(0.5), _k3(-1.0)],
}
# d/d logprobs: k1 -> 1, abs -> sign(d), k2 -> d, k3 -> 1 - exp(-d); the "+" variants -> d (k2's).
EXPECTED_GRADS = {
    "k1": [1.0, 1.0],
    "abs": [1.0, -1.0],
    "k2": D,
    "k3": [1 - math.exp(-0.5), 1 - math.exp(1.0)],
    "k1+": D,
    "k3+": D,
}


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_values_and_gradients_by_hand(estimator: KLEstimator) -> None:
    logprobs = torch.tensor(LOGPROBS, dtype=F64, requires_grad=True)
    kl = kl_penalty(logprobs, torch.tensor(REF_LOGPROBS, dtype=F64), estimator)
    kl.sum().backward()
    torch.testing.assert_close(kl.detach(), torch.tensor(EXPECTED_VALUES[estimator], dtype=F64))
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.tensor(EXPECTED_GRADS[estimator], dtype=F64))


def test_hand_k3_numbers() -> None:
    assert _k3(0.5) == pytest.approx(math.exp(-0.5) - 0.5)
    assert _k3(-1.0) == pytest.approx(math.e - 2.0)


@pytest.mark.parametrize(("alias", "canonical"), [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")])
def test_verl_aliases(alias: KLEstimator, canonical: KLEstimator) -> None:
    logprobs = torch.tensor([LOGPROBS], dtype=F64)
    ref = torch.tensor([REF_LOGPROBS], dtype=F64)
    torch.testing.assert_close(kl_penalty(logprobs, ref, alias), kl_penalty(logprobs, ref, canonical))


@pytest.mark.parametrize(("straight_through", "value_of"), [("k1+", "k1"), ("k3+", "k3")])
def test_straight_through_has_value_of_k1_k3_and_gradient_of_k2(
    straight_through: KLEstimator, value_of: KLEstimator
) -> None:
    generator = torch.Generator().manual_seed(0)
    ref = -torch.rand(3, 7, generator=generator, dtype=F64) * 3
    base = -torch.rand(3, 7, generator=generator, dtype=F64) * 3

    def value_and_grad(estimator: KLEstimator) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs = base.clone().requires_grad_(True)
        kl = kl_penalty(logprobs, ref, estimator)
        (grad,) = torch.autograd.grad(kl.sum(), logprobs)
        return kl.detach(), grad

    st_value, st_grad = value_and_grad(straight_through)
    assert torch.equal(st_value, value_and_grad(value_of)[0])
    torch.testing.assert_close(st_grad, value_and_grad("k2")[1])


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
def test_gradcheck_in_float64(estimator: KLEstimator) -> None:
    generator = torch.Generator().manual_seed(1)
    ref = -torch.rand(2, 5, generator=generator, dtype=F64)
    # Keep |d| >= 0.1 so abs is differentiable at every point checked.
    offset = (0.1 + torch.rand(2, 5, generator=generator, dtype=F64)) * torch.tensor([1.0, -1.0] * 5).reshape(
        2, 5
    )
    logprobs = (ref + offset).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda lp: kl_penalty(lp, ref, estimator), (logprobs,))


def test_k3_log_ratio_is_clamped_so_huge_gaps_stay_finite() -> None:
    logprobs = torch.tensor([-1000.0, 0.0], requires_grad=True)
    ref = torch.tensor([0.0, -1000.0])
    kl = kl_penalty(logprobs, ref, "k3")
    kl.sum().backward()
    # log r = ref - logprobs = [1000, -1000] -> clamped to [20, -20]
    torch.testing.assert_close(kl.detach(), torch.tensor([math.exp(20) - 21, math.exp(-20) + 19]))
    assert logprobs.grad is not None
    assert torch.isfinite(logprobs.grad).all()


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_mask_removes_non_finite_values_and_gradients(estimator: KLEstimator) -> None:
    logprobs = torch.tensor([[-1.0, float("nan"), float("inf")]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -float("inf")]])
    mask = torch.tensor([[True, False, False]])
    kl = kl_penalty(logprobs, ref, estimator, mask=mask)
    kl.sum().backward()
    assert torch.isfinite(kl).all()
    assert (kl[~mask] == 0).all()
    assert logprobs.grad is not None
    assert torch.isfinite(logprobs.grad).all()
    assert (logprobs.grad[~mask] == 0).all()


def test_bad_estimator_and_shapes_raise() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"k1, abs, k2, k3, k1\+, k3\+.*low_var_kl"):
        kl_penalty(x, x, "k4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ref_logprobs shape"):
        kl_penalty(x, x[:, :2], "k1")
    with pytest.raises(ValueError, match="mask shape"):
        kl_penalty(x, x, "k1", mask=torch.ones(3, dtype=torch.bool))


@settings(max_examples=60, deadline=None)
@given(
    logprobs=st.lists(st.floats(min_value=-100.0, max_value=0.0), min_size=6, max_size=6),
    ref=st.lists(st.floats(min_value=-100.0, max_value=0.0), min_size=6, max_size=6),
)
def test_k2_k3_are_non_negative_and_finite(logprobs: list[float], ref: list[float]) -> None:
    lp = torch.tensor(logprobs, dtype=F64)
    ref_lp = torch.tensor(ref, dtype=F64)
    for estimator in ("k2", "k3", "k3+"):
        kl = kl_penalty(lp, ref_lp, estimator)
        assert torch.isfinite(kl).all()
        assert (kl >= 0).all()
