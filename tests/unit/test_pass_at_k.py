"""The unbiased pass@k estimator against the closed form 1 - C(n-c, k) / C(n, k) on hand-made rewards."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rollout_correction.core.pass_at_k import pass_at_k, pass_at_k_mean


def _closed_form(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_matches_closed_form_on_hand_made_rewards() -> None:
    # 4 problems x 5 samples; a sample is correct when its reward is 1
    rewards = torch.tensor([[1, 0, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 1, 0, 0]], dtype=torch.float32)
    correct = (rewards >= 1.0).sum(-1)
    n = torch.full((4,), 5)
    for k in range(1, 6):
        expected = torch.tensor([_closed_form(5, int(c), k) for c in correct], dtype=torch.float64)
        torch.testing.assert_close(pass_at_k(n, correct, k), expected, rtol=0, atol=1e-12)
    # hand values: pass@1 = c / n, pass@2 for c=1 of 5 = 1 - C(4,2)/C(5,2) = 1 - 6/10
    torch.testing.assert_close(pass_at_k(n, correct, 1), correct.double() / 5)
    assert pass_at_k(n, correct, 2)[0].item() == pytest.approx(0.4)
    assert pass_at_k_mean(n, correct, 1) == pytest.approx((1 + 0 + 5 + 2) / 20)


def test_large_n_is_stable() -> None:
    # C(1000, 500) overflows float64; the product form does not
    n, c, k = 1000, 3, 100
    ours = float(pass_at_k(torch.tensor([n]), torch.tensor([c]), k)[0])
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # Python ints: exact
    assert ours == pytest.approx(exact, rel=1e-12)
    assert 0.0 < ours < 1.0


def test_mixed_sample_counts_and_edges() -> None:
    n = torch.tensor([3, 8, 8, 2])
    c = torch.tensor([1, 0, 7, 2])
    expected = torch.tensor([_closed_form(3, 1, 2), 0.0, 1.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(pass_at_k(n, c, 2), expected, rtol=0, atol=1e-12)
    assert pass_at_k(torch.zeros(0), torch.zeros(0), 1).numel() == 0
    assert math.isnan(pass_at_k_mean(torch.zeros(0), torch.zeros(0), 1))


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="k >= 1"):
        pass_at_k(torch.tensor([4]), torch.tensor([1]), 0)
    with pytest.raises(ValueError, match="at least k=5"):
        pass_at_k(torch.tensor([4]), torch.tensor([1]), 5)
    with pytest.raises(ValueError, match="num_correct"):
        pass_at_k(torch.tensor([4]), torch.tensor([5]), 1)
