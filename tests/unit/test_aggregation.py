"""aggregate_loss and count_for_denominator: modes by hand, masking, zero denominators, split invariance."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_rollout_correction.core.aggregation import (
    LOSS_AGG_MODES,
    LossAggMode,
    aggregate_loss,
    count_for_denominator,
    safe_divide,
)

# Row 0 keeps 2 tokens (1, 2), row 1 keeps 1 token (4), row 2 keeps none.
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=torch.float64)
MASK = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("token-sum", 1 + 2 + 4),
        ("seq-mean-token-sum", ((1 + 2) + 4) / 2),  # the empty row is not a sequence
        ("seq-mean-token-mean", ((1 + 2) / 2 + 4 / 1) / 2),
        ("seq-mean-token-sum-norm", ((1 + 2) + 4) / 2 / 3),  # norm_length = seq dim = 3
    ],
)
def test_modes_on_hand_example(mode: LossAggMode, expected: float) -> None:
    loss = aggregate_loss(LOSS, MASK, mode)
    assert loss.shape == ()
    assert loss.item() == pytest.approx(expected)


def test_global_denominators_are_used_as_given() -> None:
    assert aggregate_loss(LOSS, MASK, "token-mean", num_global_tokens=10).item() == pytest.approx(7 / 10)
    as_tensor = aggregate_loss(LOSS, MASK, "token-mean", num_global_tokens=torch.tensor([14]))
    assert as_tensor.item() == pytest.approx(7 / 14)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum", num_global_seqs=7).item() == pytest.approx(1.0)
    mean_of_means = aggregate_loss(LOSS, MASK, "seq-mean-token-mean", num_global_seqs=11)
    assert mean_of_means.item() == pytest.approx((1.5 + 4.0) / 11)
    normed = aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", num_global_seqs=7, norm_length=2)
    assert normed.item() == pytest.approx(7 / 7 / 2)
    # token-sum has no denominator, so a given count changes nothing.
    assert aggregate_loss(LOSS, MASK, "token-sum", num_global_tokens=99).item() == pytest.approx(7.0)


def test_float_mask_is_accepted() -> None:
    loss = aggregate_loss(LOSS, MASK.to(torch.float32), "token-mean")
    assert loss.item() == pytest.approx(7 / 3)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_non_finite_masked_values_reach_neither_loss_nor_grad(mode: LossAggMode) -> None:
    values = LOSS.clone()
    values[0, 2] = float("nan")
    values[1, 1] = float("inf")
    values[2, :] = -float("inf")
    values.requires_grad_(True)
    loss = aggregate_loss(values, MASK, mode)
    loss.backward()
    assert values.grad is not None
    assert torch.isfinite(loss)
    assert torch.isfinite(values.grad).all()
    assert (values.grad[~MASK] == 0).all()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("shape", [(3, 4), (0, 4), (2, 0)])
def test_all_masked_or_empty_batch_gives_zero_loss_and_zero_grad(
    mode: LossAggMode, shape: tuple[int, int]
) -> None:
    values = torch.full(shape, float("nan"), dtype=torch.float64, requires_grad=True)
    loss = aggregate_loss(values, torch.zeros(shape, dtype=torch.bool), mode)
    loss.backward()
    assert loss.item() == 0.0
    assert values.grad is not None
    assert (values.grad == 0).all()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_zero_global_denominator_gives_zero_loss_and_zero_grad(mode: LossAggMode) -> None:
    values = LOSS.clone().requires_grad_(True)
    loss = aggregate_loss(values, MASK, mode, num_global_tokens=0, num_global_seqs=0)
    loss.backward()
    assert loss.item() == 0.0
    assert values.grad is not None
    assert (values.grad == 0).all()


def test_safe_divide_is_nan_free_in_both_directions() -> None:
    numerator = torch.tensor([0.0, 3.0], requires_grad=True)
    denominator = torch.tensor([0.0, 2.0])
    result = safe_divide(numerator, denominator)
    result.sum().backward()
    assert result.tolist() == [0.0, 1.5]
    assert numerator.grad is not None
    assert numerator.grad.tolist() == [0.0, 0.5]


def test_count_for_denominator_counts_tokens_or_non_empty_sequences() -> None:
    assert count_for_denominator(MASK, "token-mean").item() == 3
    assert count_for_denominator(MASK, "token-sum").item() == 3
    for mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert count_for_denominator(MASK, mode).item() == 2
    assert count_for_denominator(MASK.long(), "token-mean").item() == 3


def test_bad_mode_lists_valid_names() -> None:
    with pytest.raises(ValueError, match=r"token-mean.*seq-mean-token-sum-norm"):
        aggregate_loss(LOSS, MASK, "mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="valid modes"):
        count_for_denominator(MASK, "seq-mean")  # type: ignore[arg-type]


def test_bad_shapes_and_values_raise() -> None:
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        aggregate_loss(LOSS[0], MASK[0], "token-mean")
    with pytest.raises(ValueError, match="does not match"):
        aggregate_loss(LOSS, MASK[:, :2], "token-mean")
    with pytest.raises(ValueError, match="num_global_tokens must be >= 0"):
        aggregate_loss(LOSS, MASK, "token-mean", num_global_tokens=-1)
    with pytest.raises(ValueError, match="single count"):
        aggregate_loss(LOSS, MASK, "token-mean", num_global_tokens=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="norm_length must be > 0"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=0)
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        count_for_denominator(MASK[0], "token-mean")


def _random_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    params = torch.randn(8, 6, generator=generator, dtype=torch.float64)
    lengths = torch.tensor([6, 1, 0, 4, 3, 0, 5, 2])  # includes empty sequences
    mask = torch.arange(6) < lengths.unsqueeze(-1)
    return params, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("splits", [[8], [3, 5], [1, 2, 2, 3], [2, 1, 4, 1]])
def test_microbatch_sum_with_global_denominator_equals_full_batch(
    mode: LossAggMode, splits: list[int]
) -> None:
    """The reduction contract: any split, with the global count passed in, gives the same loss and grad."""
    params, mask = _random_batch(seed=0)

    def per_token_loss(p: torch.Tensor) -> torch.Tensor:
        return p.sin() * p  # any nonlinear per-token function

    full_params = params.clone().requires_grad_(True)
    full_loss = aggregate_loss(per_token_loss(full_params), mask, mode, norm_length=6)
    full_loss.backward()

    num_global = torch.stack([count_for_denominator(m, mode) for m in mask.split(splits)]).sum()
    split_params = params.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for p, m in zip(split_params.split(splits), mask.split(splits), strict=True):
        microbatch_loss = aggregate_loss(
            per_token_loss(p),
            m,
            mode,
            num_global_tokens=num_global,
            num_global_seqs=num_global,
            norm_length=6,
        )
        microbatch_loss.backward()
        total = total + microbatch_loss.detach()

    torch.testing.assert_close(total, full_loss.detach())
    torch.testing.assert_close(split_params.grad, full_params.grad)


@settings(max_examples=50, deadline=None)
@given(
    values=st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), min_size=12, max_size=12),
    keep=st.lists(st.booleans(), min_size=12, max_size=12),
    mode=st.sampled_from(LOSS_AGG_MODES),
)
def test_finite_inputs_give_finite_loss(values: list[float], keep: list[bool], mode: LossAggMode) -> None:
    loss_values = torch.tensor(values, dtype=torch.float64).reshape(3, 4)
    mask = torch.tensor(keep).reshape(3, 4)
    loss = aggregate_loss(loss_values, mask, mode)
    assert torch.isfinite(loss)
    if mode == "token-mean" and mask.any():
        kept = loss_values[mask]
        assert kept.min().item() - 1e-6 <= loss.item() <= kept.max().item() + 1e-6
    if not mask.any():
        assert loss.item() == 0.0
    assert not math.isnan(loss.item())
