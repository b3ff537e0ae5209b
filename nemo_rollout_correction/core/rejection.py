"""Rejection-sampling statistics and decisions for each criterion, plus the veto.

The reported statistic follows verl's definitions: k1 = -log rho (the k1 estimator of
KL(pi_rollout || pi_train)), k2 = (log rho)^2 / 2, k3 = rho - 1 - log rho. The decision for
k1 criteria bounds rho itself, `lower <= rho <= upper` (DESIGN.md decision 1), which verl
gets backwards for asymmetric bounds; k2/k3 criteria keep `statistic <= upper`.
"""

from __future__ import annotations

import math

from torch import Tensor

from nemo_rollout_correction.core.config import RejectionCriterion
from nemo_rollout_correction.core.masking import TokenChunk
from nemo_rollout_correction.core.stats import Partials


def token_statistic(tok: TokenChunk, criterion: RejectionCriterion) -> Tensor:
    """The per-token statistic of `criterion`'s kind, `[rows, seq]` (0 on invalid tokens)."""
    if criterion.statistic == "k1":
        return -tok.clamped
    return tok.k2 if criterion.statistic == "k2" else tok.k3


def token_rejected(tok: TokenChunk, criterion: RejectionCriterion) -> Tensor:
    """Valid tokens rejected by a token-level criterion, `[rows, seq]` bool."""
    if criterion.statistic == "k1":
        assert criterion.lower is not None  # parsed config invariant: k1 always has a lower bound
        out = (tok.clamped < math.log(criterion.lower)) | (tok.clamped > math.log(criterion.upper))
    else:
        out = token_statistic(tok, criterion) > criterion.upper
    return out & tok.valid


def sequence_statistic(seq: Partials, criterion: RejectionCriterion) -> Tensor:
    """The per-sequence statistic `[rows]` of any criterion (token ones: the per-sequence mean).

    Uses the complete per-sequence partials (already reduced over context-parallel ranks).
    Sequences without valid tokens get 0.
    """
    num_tokens = seq.sums["num_tokens"]
    if criterion.granularity == "seq_max":
        return seq.maxs[f"max_{criterion.statistic}"]
    total = -seq.sums["sum_log_ratio"] if criterion.statistic == "k1" else seq.sums[f"sum_{criterion.statistic}"]
    if criterion.granularity == "seq_sum":
        return total
    return total / num_tokens.clamp(min=1.0)


def sequence_rejected(seq: Partials, criterion: RejectionCriterion) -> Tensor:
    """Sequences `[rows]` rejected by a sequence-level criterion (never ones without tokens)."""
    stat = sequence_statistic(seq, criterion)
    if criterion.statistic == "k1":
        assert criterion.lower is not None
        # stat = -log rho_agg, so lower <= rho_agg <= upper  <=>  -log upper <= stat <= -log lower.
        out = (stat < -math.log(criterion.upper)) | (stat > -math.log(criterion.lower))
    else:
        out = stat > criterion.upper
    return out & (seq.sums["num_tokens"] > 0)


def statistic_bounds(criterion: RejectionCriterion) -> tuple[float, float]:
    """The statistic-space interval `[low, high]` a kept value lies in (k2/k3: `[0, upper]`)."""
    if criterion.statistic == "k1":
        assert criterion.lower is not None
        return -math.log(criterion.upper), -math.log(criterion.lower)
    return 0.0, criterion.upper


def vetoed(seq: Partials, veto_threshold: float) -> Tensor:
    """Sequences `[rows]` with any valid token ratio below `veto_threshold`."""
    return seq.mins["min_log_ratio"] < math.log(veto_threshold)
