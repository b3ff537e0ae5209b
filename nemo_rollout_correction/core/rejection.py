"""Rejection-sampling statistics and decisions for each criterion, plus the veto.

Statistics: k1 = log rho (the log of the ratio the bounds apply to), k2 = (log rho)^2 / 2,
k3 = rho - 1 - log rho. A k1 criterion keeps `log lower <= stat <= log upper`, i.e. it bounds
rho itself (token ratio, sequence product or geometric mean; docs/design.md decision 1). verl
computes k1 as -log rho against log-bounds, which swaps asymmetric bounds; its docs describe
the statistic as E[log r], which is what we report. k2/k3 criteria keep `stat <= upper`.
"""

from __future__ import annotations

import math

from torch import Tensor

from nemo_rollout_correction.core.config import RejectionCriterion
from nemo_rollout_correction.core.keys import SUM_EXP_ABS_LOG_RATIO
from nemo_rollout_correction.core.masking import TokenChunk
from nemo_rollout_correction.core.stats import Partials


def token_statistic(tok: TokenChunk, criterion: RejectionCriterion) -> Tensor:
    """The per-token statistic of `criterion`'s kind, `[rows, seq]` (0 on invalid tokens)."""
    if criterion.statistic == "k1":
        return tok.clamped
    return tok.k2 if criterion.statistic == "k2" else tok.k3


def token_rejected(tok: TokenChunk, criterion: RejectionCriterion) -> Tensor:
    """Valid tokens rejected by a token-level criterion, `[rows, seq]` bool."""
    low, high = statistic_bounds(criterion)
    stat = token_statistic(tok, criterion)
    out = stat > high
    if criterion.statistic == "k1":
        out |= stat < low
    return out & tok.valid


def sequence_statistic(seq: Partials, criterion: RejectionCriterion) -> Tensor:
    """The per-sequence statistic `[rows]` of any criterion (token ones: the per-sequence mean).

    Uses the complete per-sequence partials (already reduced over context-parallel ranks).
    Sequences without valid tokens get 0.
    """
    num_tokens = seq.sums["num_tokens"]
    if criterion.granularity == "seq_max":
        return seq.maxs[f"max_{criterion.statistic}"]
    total = seq.sums["sum_log_ratio"] if criterion.statistic == "k1" else seq.sums[f"sum_{criterion.statistic}"]
    if criterion.granularity == "seq_sum":
        return total
    return total / num_tokens.clamp(min=1.0)


def sequence_rejected(seq: Partials, criterion: RejectionCriterion) -> Tensor:
    """Sequences `[rows]` rejected by a sequence-level criterion (never ones without tokens)."""
    stat = sequence_statistic(seq, criterion)
    low, high = statistic_bounds(criterion)
    out = stat > high
    if criterion.statistic == "k1":
        out |= stat < low
    return out & (seq.sums["num_tokens"] > 0)


def statistic_bounds(criterion: RejectionCriterion) -> tuple[float, float]:
    """The statistic-space interval `[low, high]` a kept value lies in.

    k1: `[log lower, log upper]` (the ratio bounds in log space); k2/k3: `[0, upper]`.
    """
    if criterion.statistic == "k1":
        assert criterion.lower is not None  # parsed config invariant: k1 always has a lower bound
        return math.log(criterion.lower), math.log(criterion.upper)
    return 0.0, criterion.upper


def vetoed(seq: Partials, veto_threshold: float) -> Tensor:
    """Sequences `[rows]` with any valid token ratio below `veto_threshold`."""
    return seq.mins["min_log_ratio"] < math.log(veto_threshold)


def seq_logprob_error(seq: Partials) -> Tensor:
    """NeMo-RL's sequence multiplicative probability error `[rows]`: mean_t exp(|log-ratio_t|) over the valid
    tokens (1 for a sequence without any). Uses the complete (CP-reduced) per-sequence partials."""
    return seq.sums[SUM_EXP_ABS_LOG_RATIO] / seq.sums["num_tokens"].clamp(min=1.0)


def seq_logprob_error_rejected(seq: Partials, threshold: float) -> Tensor:
    """Sequences `[rows]` whose `seq_logprob_error` exceeds `threshold` (never ones without tokens)."""
    return (seq_logprob_error(seq) > threshold) & (seq.sums["num_tokens"] > 0)
