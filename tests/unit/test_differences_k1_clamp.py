"""docs/differences.md, "k1 sequence statistics are not clamped per token": the numbers it quotes.

A 131-token sequence whose log-ratios are 0 except one token at +25. Our seq_mean_k1 statistic is
the mean of the unclamped log-ratios, 25 / 131 = 0.1908; verl 0.9.1 clamps every token to +-20
first and reports k1 = -log rho (its `rollout_rs_seq_mean_k1_min` is -20 / 131 = -0.1527, i.e. 0.1527
once the sign is mapped to ours). verl's formula is re-derived below from its rollout_corr_helper
(`token_k1 = -clamp(log_ratio, -20, 20)`, `seq_stat = masked_mean(token_k1)`), not imported.
"""

from __future__ import annotations

import pytest
import torch

from nemo_rollout_correction import RolloutCorrectionConfig, compute_rollout_correction

LENGTH, OUTLIER, SAFETY_BOUND = 131, 25.0, 20.0


def test_quoted_k1_clamp_difference() -> None:
    log_ratio = torch.zeros(1, LENGTH)
    log_ratio[0, 40] = OUTLIER
    rollout = torch.full((1, LENGTH), -1.0)
    old = rollout + log_ratio
    mask = torch.ones(1, LENGTH, dtype=torch.bool)
    cfg = RolloutCorrectionConfig(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.5_2.0",
                                  rollout_token_veto_threshold=None)
    ours = compute_rollout_correction(old, rollout, mask, cfg).metrics["rollout_corr/rollout_rs_seq_mean_k1_max"]

    verl_token_k1 = -torch.clamp(old - rollout, -SAFETY_BOUND, SAFETY_BOUND)
    verl_seq_mean_k1 = (verl_token_k1 * mask).sum(-1) / mask.sum(-1)
    verl_mapped = -float(verl_seq_mean_k1.min())  # verl's k1 is -log rho: its min is our max

    assert ours == pytest.approx(OUTLIER / LENGTH, rel=1e-6) and round(ours, 3) == 0.191
    assert verl_mapped == pytest.approx(SAFETY_BOUND / LENGTH, rel=1e-6) and round(verl_mapped, 3) == 0.153
