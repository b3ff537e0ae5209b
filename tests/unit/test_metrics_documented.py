"""Every metric key the code can emit is documented in docs/metrics.md (docs match the code)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from nemo_rollout_correction import RolloutCorrectionConfig, compute_rollout_correction
from nemo_rollout_correction.core.config import RS_OPTIONS

DOC = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()

# Configs that together reach every branch of finalize_metrics.
CONFIGS = [
    RolloutCorrectionConfig(rollout_is="token", rollout_is_mode="mask", rollout_is_batch_normalize=True,
                            rollout_rs=",".join(RS_OPTIONS), rollout_rs_threshold="2.0"),
    RolloutCorrectionConfig(rollout_is="sequence", rollout_is_batch_normalize=True),
    RolloutCorrectionConfig(rollout_is="geometric", rollout_is_mode="mask", rollout_is_threshold=1.01),
    RolloutCorrectionConfig(rollout_token_veto_threshold=None),
    RolloutCorrectionConfig(opsm_threshold=0.0, kpop_threshold=0.1, dppo_tv_threshold=0.1,
                            seq_logprob_error_threshold=1.05),
]


def _emitted_keys() -> set[str]:
    torch.manual_seed(0)
    rollout = -torch.rand(4, 8) * 3
    old = rollout + 0.1 * torch.randn(4, 8)
    mask = torch.ones(4, 8, dtype=torch.bool)
    keys: set[str] = set()
    for cfg in CONFIGS:
        advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
        keys |= set(compute_rollout_correction(old, rollout, mask, cfg, advantages=advantages).metrics)
    return keys


def _documented(name: str) -> bool:
    criterion = re.match(r"rollout_rs_((?:token|seq_sum|seq_mean|seq_max)_k[123])(_.+)$", name)
    if criterion:  # per-criterion keys are documented by suffix in the rollout_rs_<c>_<suffix> table
        return f"| `{criterion.group(2)}` |" in DOC
    quantile = re.match(r"(.+_)p\d+$", name)
    if quantile:  # quantiles are documented as a family (p1 ... p99)
        return f"`{name}`" in DOC or f"`{quantile.group(1)}p1`" in DOC
    return f"`{name}`" in DOC


def test_every_emitted_metric_is_documented() -> None:
    keys = _emitted_keys()
    assert len(keys) > 100  # the configs above really reach the per-criterion and IS branches
    undocumented = sorted(k for k in keys if not _documented(k.removeprefix("rollout_corr/")))
    assert undocumented == [], f"add these to docs/metrics.md: {undocumented}"


def test_the_check_would_catch_a_missing_key() -> None:
    assert not _documented("made_up_metric_name")
    assert not _documented("rollout_rs_token_k1_made_up_suffix")
