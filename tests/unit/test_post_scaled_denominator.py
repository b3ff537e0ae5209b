"""Bypass mode without a denominator in advance: backpropagating each microbatch's `loss_sum` and dividing
the gradients by the step's global count afterwards (what the trainer does when rejection depends on the
current policy) gives exactly the gradient of the pre-pass path (exact denominator before the first backward).
"""

from __future__ import annotations

import pytest
import torch

from nemo_rollout_correction import RolloutCorrectionConfig
from nemo_rollout_correction.core.policy_loss import PolicyLossConfig
from nemo_rollout_correction.distributed.groups import ParallelGroups
from nemo_rollout_correction.losses.rollout_corrected_pg import RolloutCorrectedPolicyLoss, StepDenominators


def _batch(seed: int, rows: int = 3, seq: int = 7) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, seq, generator=gen)
    # Close to the policy below (a few percent of ratio), so every preset keeps most tokens.
    rollout = -torch.nn.functional.softplus(0.7 * logits) - 0.5 + torch.randn(rows, seq, generator=gen) * 0.05
    adv = torch.randn(rows, generator=gen)
    mask = torch.rand(rows, seq, generator=gen) > 0.2
    return logits, rollout, adv, mask


@pytest.mark.parametrize("preset", ["bypass_ppo_clip_geo_rs", "ppo_is_bypass", "bypass_pg_token_icepop", "pure_is"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_post_scaled_gradient_equals_prepass_gradient(preset: str, agg: str) -> None:
    cfg = RolloutCorrectionConfig.from_preset(preset)
    loss_fn = RolloutCorrectedPolicyLoss(cfg, PolicyLossConfig(loss_agg_mode=agg))
    groups = ParallelGroups.single()
    batches = [_batch(s) for s in range(3)]
    # A "policy": per-token logprobs = -softplus(theta * x), one shared parameter.
    theta_a = torch.tensor(0.7, requires_grad=True)
    theta_b = torch.tensor(0.7, requires_grad=True)

    def logprobs(theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return -torch.nn.functional.softplus(theta * x) - 0.5

    # Pre-pass path: corrections from the current policy (no grad), exact denominators, then losses.
    corrections = [loss_fn.correct(logprobs(theta_a, x).detach(), r, m, groups) for x, r, _, m in batches]
    step = loss_fn.prepare_step(corrections, groups)
    denoms = StepDenominators.from_step(step)
    for (x, r, adv, m), corr in zip(batches, corrections, strict=True):
        loss_fn(logprobs(theta_a, x), r, adv, m, groups, denoms, correction=corr).loss.backward()

    # Post-scaled path: numerators backpropagated, gradient divided by the summed count afterwards.
    count = 0.0
    for x, r, adv, m in batches:
        out = loss_fn(logprobs(theta_b, x), r, adv, m, groups, None)
        out.loss_sum.backward()
        count += float(out.num_denominator)
    assert theta_b.grad is not None and theta_a.grad is not None
    theta_b.grad /= max(count, 1.0)
    expected_count = denoms.num_global_tokens if agg == "token-mean" else denoms.num_global_seqs
    assert count == pytest.approx(expected_count)
    torch.testing.assert_close(theta_b.grad, theta_a.grad, rtol=1e-6, atol=1e-7)
    assert theta_a.grad.abs() > 0
