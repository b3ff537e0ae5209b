"""Thresholds chosen each step from the step's own log-ratios (M2PO's cutoff, the adaptive IS bound).

A step-level threshold depends on every token of the update, spread over microbatches and dp x cp
ranks, so no rank can pick it from its own tokens. Gathering the tokens would cost memory in the
batch size; instead the threshold is found by a search whose every probe needs only two numbers per
candidate, which add over microbatches and ranks: the count and the sum of the values at or below
it. Each round evaluates up to `SEARCH_WIDTH` candidates in one `reduce` (an all-reduce SUM across
ranks, the identity on one process) and narrows the interval to one of the `SEARCH_WIDTH + 1` gaps.
The candidates are float64 bit patterns (non-negative doubles order like their int64 bits), so after
about eight rounds the interval holds one representable value and the result is the exact cutoff
(no tolerance): the kept set `{v <= cutoff}` is the one a sort of all tokens on one process gives.

The adaptive IS bound (`rollout_is_target_ess`) uses the same search over the bound U: its probes are the
count, sum and sum of squares of the ratios at or below each candidate, from which the effective sample size
of the truncated weights min(rho, U) follows exactly. Its predicate moves continuously with U, so two layouts
agree on U to the rounding of their float64 sums (relative 1e-12), all ranks of one layout bitwise.

This module holds the pure search (no torch.distributed); `distributed.correction.resolve_step_config`
passes the all-reduce.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.masking import LOG_RATIO_BOUND, TokenChunk

__all__ = [
    "SEARCH_WIDTH",
    "Reduce",
    "SortedValues",
    "adaptive_is_threshold",
    "largest_passing",
    "local_sq_log_ratios",
    "local_token_ratios",
    "m2po_cutoff",
    "resolve_step_thresholds",
]

SEARCH_WIDTH = 255
"""Candidates per search round (one reduce of 2 or 3 x 255 float64 each): 62 bits take 8 rounds."""

Reduce = Callable[[Tensor], Tensor]
"""SUM of a float64 tensor over every rank holding part of the step (identity on one process)."""
# Every rank must run the same sequence of reduces: each decision below depends on reduced values only.

_MAX_SQ = LOG_RATIO_BOUND * LOG_RATIO_BOUND  # log-ratios are clamped to +-20 before squaring


def _bits(x: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", x))[0])


def _value(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


class SortedValues:
    """This rank's non-negative values (all its microbatches), sorted once, with float64 prefix sums."""

    def __init__(self, values: Tensor) -> None:
        self.sorted = torch.sort(values.detach().to(torch.float64).flatten().cpu()).values
        zero = torch.zeros(1, dtype=torch.float64)
        self.prefix = torch.cat([zero, torch.cumsum(self.sorted, 0)])
        self.prefix_sq = torch.cat([zero, torch.cumsum(self.sorted.square(), 0)])

    def at_most(self, candidates: Tensor) -> Tensor:
        """`[2, k]` float64: the count and the sum of the values `<= candidates[j]`."""
        index = torch.searchsorted(self.sorted, candidates, right=True)
        return torch.stack([index.to(torch.float64), self.prefix[index]])

    def at_most_with_squares(self, candidates: Tensor) -> Tensor:
        """`[3, k]` float64: the count, the sum and the sum of squares of the values `<= candidates[j]`."""
        index = torch.searchsorted(self.sorted, candidates, right=True)
        return torch.stack([index.to(torch.float64), self.prefix[index], self.prefix_sq[index]])


def largest_passing(evaluate: Callable[[Tensor], Tensor], passes: Callable[[Tensor], Tensor], high: float,
                    width: int = SEARCH_WIDTH, low: float = 0.0) -> float | None:
    """The largest float64 `c` in `[low, high]` (`low >= 0`) with `passes(evaluate(c))`, for a predicate that
    holds up to some point and fails beyond it; None when it fails at `low`.

    evaluate: candidates `[k]` float64 -> statistics `[s, k]` (already reduced over ranks).
    passes: statistics `[s, k]` -> bool `[k]`.
    """
    floor = _bits(low)
    lo, hi = floor - 1, _bits(high) + 1  # invariant: passes at lo (or lo below low), fails at hi (or beyond high)
    while hi - lo > 1:
        gap = hi - lo
        if gap - 1 <= width:
            cand = list(range(lo + 1, hi))
        else:
            cand = sorted({lo + (gap * j) // (width + 1) for j in range(1, width + 1)} - {lo, hi})
        values = torch.tensor(cand, dtype=torch.int64).view(torch.float64)
        ok = passes(evaluate(values)).tolist()
        last = max((i for i, flag in enumerate(ok) if flag), default=-1)
        if last >= 0:
            lo = cand[last]
        hi = cand[last + 1] if last + 1 < len(cand) else hi
    return None if lo < floor else _value(lo)


def m2po_cutoff(values: SortedValues, bound: float, reduce: Reduce) -> float:
    """M2PO's cutoff on the squared log-ratio over the whole step: keep `{v <= cutoff}`.

    The largest kept set of smallest values whose mean is below `bound` (AReaL's `_get_m2po_loss_mask`: mask
    the largest values until the mean of the rest is below the bound); `inf` when the mean of all is already
    below it (nothing masked). When even the smallest value is not below the bound, AReaL keeps exactly one
    token; we keep the tokens equal to the smallest value (the same token unless several tie).
    """

    def evaluate(candidates: Tensor) -> Tensor:
        return reduce(values.at_most(candidates))

    total = evaluate(torch.tensor([math.inf], dtype=torch.float64))[:, 0]
    count, total_sum = float(total[0]), float(total[1])
    if count == 0 or total_sum < bound * count:
        return math.inf
    # Monotone: the mean of the values <= c never decreases with c; an empty set passes.
    cutoff = largest_passing(evaluate, lambda st: (st[0] == 0) | (st[1] < bound * st[0]), _MAX_SQ)
    kept = 0.0 if cutoff is None else float(evaluate(torch.tensor([cutoff], dtype=torch.float64))[0, 0])
    if kept > 0:
        assert cutoff is not None  # kept > 0 implies a cutoff was found
        return cutoff
    below_min = largest_passing(evaluate, lambda st: st[0] == 0, _MAX_SQ)  # the largest c under every value
    return 0.0 if below_min is None else _value(_bits(below_min) + 1)


def adaptive_is_threshold(ratios: SortedValues, target: float, cap: float, reduce: Reduce) -> float:
    """The largest upper bound U in `[1, cap]` whose truncated weights `min(rho, U)` over the step's valid tokens
    have an effective sample size fraction `(sum w)^2 / (N sum w^2) >= target`; 1 when even U = 1 misses it.

    The fraction never increases with U (truncating more makes the weights more alike), so the search applies.
    """
    total = reduce(ratios.at_most_with_squares(torch.tensor([math.inf], dtype=torch.float64)))[:, 0]
    count = float(total[0])
    if count == 0:
        return cap

    def evaluate(candidates: Tensor) -> Tensor:
        below = reduce(ratios.at_most_with_squares(candidates))  # [3, k]: n, sum, sum of squares of rho <= U
        above = count - below[0]
        s1 = below[1] + above * candidates
        s2 = below[2] + above * candidates.square()
        return torch.stack([s1, s2])

    def passes(st: Tensor) -> Tensor:
        return st[0].square() >= target * count * st[1]

    found = largest_passing(evaluate, passes, cap, low=1.0)
    return 1.0 if found is None else found


def local_token_ratios(chunks: Sequence[tuple[Tensor, Tensor, Tensor]]) -> Tensor:
    """The token IS ratios rho = exp(clamped log-ratio) of the valid tokens of this rank's microbatches, float64
    `[n]`, computed as the correction computes them (float32 exp)."""
    parts = []
    for old, rollout, mask in chunks:
        tok = TokenChunk(old.detach(), rollout.detach(), mask)
        parts.append(torch.exp(tok.clamped)[tok.valid].to(torch.float64).cpu())
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def local_sq_log_ratios(chunks: Sequence[tuple[Tensor, Tensor, Tensor]]) -> Tensor:
    """The squared (clamped) log-ratios of the valid tokens of this rank's microbatches, float64 `[n]`.

    chunks: `(old_logprobs, rollout_logprobs, loss_mask)` per microbatch, `[rows, seq]` each (in bypass mode
    the current policy's logprobs as old_logprobs). Valid = on the loss mask with a finite log-ratio, the
    tokens the correction's M2PO mask acts on.
    """
    parts = []
    for old, rollout, mask in chunks:
        tok = TokenChunk(old.detach(), rollout.detach(), mask)
        parts.append(tok.clamped[tok.valid].to(torch.float64).square().cpu())
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def resolve_step_thresholds(cfg: RolloutCorrectionConfig, chunks: Sequence[tuple[Tensor, Tensor, Tensor]],
                            reduce: Reduce | None = None) -> RolloutCorrectionConfig:
    """`cfg` with its step-level thresholds chosen from the step's tokens (`cfg` itself when it has none).

    chunks: this rank's microbatches as in `local_sq_log_ratios`. reduce: the SUM over the ranks that hold
    the rest of the step (dp x cp; never tp, whose values are replicated); None on one process. Every such
    rank must call it (the same number of reduces on each).
    """
    if not cfg.needs_step_thresholds:
        return cfg
    reduce = reduce if reduce is not None else (lambda t: t)
    cutoff = bound = None
    if cfg.m2po_threshold is not None:
        cutoff = m2po_cutoff(SortedValues(local_sq_log_ratios(chunks)), cfg.m2po_threshold, reduce)
    if cfg.rollout_is_target_ess is not None:
        bound = adaptive_is_threshold(SortedValues(local_token_ratios(chunks)), cfg.rollout_is_target_ess,
                                      cfg.is_threshold_cap, reduce)
    return cfg.with_step_thresholds(m2po_cutoff=cutoff, is_threshold=bound)
