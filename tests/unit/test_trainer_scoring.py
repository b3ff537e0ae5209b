"""harness/scoring.py: the per-sequence log-ratio statistics `nrc train`'s review and `nrc audit` share."""

from __future__ import annotations

import math

import pytest
import torch
from default_lane import require

require("megatron.core", "megatron")

from nemo_rollout_correction.harness.scoring import sequence_log_ratios


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    reference = torch.randn(4, 6, generator=gen) - 2.0
    rollout = reference + 0.1 * torch.randn(4, 6, generator=gen)
    mask = torch.rand(4, 6, generator=gen) > 0.3
    mask[3] = False  # a row without response tokens
    reference[1, 2], mask[1, 2] = math.nan, True  # a non-finite token inside the response
    reference[2, 0], mask[2, 0] = -math.inf, False  # ... and one outside it (must not count)
    return reference, rollout, mask


def test_zero_mode_drops_nonfinite_tokens_and_summarises_each_sequence() -> None:
    reference, rollout, mask = _batch()
    out = sequence_log_ratios(reference, rollout, mask, nonfinite="zero")
    for row in range(4):
        tokens = [float(reference[row, t] - rollout[row, t]) for t in range(6) if mask[row, t]]
        tokens = [t if math.isfinite(t) else 0.0 for t in tokens]
        assert float(out.seq_log_ratio[row]) == pytest.approx(sum(tokens), abs=1e-6)
        assert float(out.seq_max_abs_log_ratio[row]) == pytest.approx(max(map(abs, tokens), default=0.0), abs=1e-6)
    assert torch.isfinite(out.log_ratio).all() and (out.log_ratio[~mask] == 0).all()


def test_worst_mode_ranks_a_nonfinite_sequence_first_and_keeps_it_in_the_sum() -> None:
    reference, rollout, mask = _batch()
    out = sequence_log_ratios(reference, rollout, mask, nonfinite="worst")
    assert math.isinf(float(out.seq_max_abs_log_ratio[1])) and math.isnan(float(out.seq_log_ratio[1]))
    assert int(torch.argsort(out.seq_max_abs_log_ratio, descending=True)[0]) == 1
    assert math.isfinite(float(out.seq_log_ratio[2]))  # the -inf outside the response is ignored
    assert float(out.seq_max_abs_log_ratio[3]) == 0.0 and float(out.seq_log_ratio[3]) == 0.0


def test_empty_batch_gives_one_summary_per_row() -> None:
    empty = torch.zeros(3, 0)
    out = sequence_log_ratios(empty, empty, empty.bool(), nonfinite="worst")
    assert out.seq_max_abs_log_ratio.shape == (3,) and out.seq_log_ratio.shape == (3,)
