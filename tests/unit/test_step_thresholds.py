"""Step-level thresholds (core/step_thresholds.py): the exact search, and its independence of the layout.

The search sees the step only through per-candidate (count, sum) pairs that add over shards, so splitting the
tokens over microbatches or ranks (simulated here by summing each shard's statistics, which is what the
all-reduce does) must give the very same cutoff as one process holding every token; and that cutoff must be
the one a brute-force sort gives.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from nemo_rollout_correction import RolloutCorrectionConfig
from nemo_rollout_correction.core.correction import compute_rollout_correction
from nemo_rollout_correction.core.step_thresholds import SortedValues, m2po_cutoff, resolve_step_thresholds


class _Shards:
    """Several ranks' values; `at_most` sums their statistics like the dp x cp all-reduce."""

    def __init__(self, parts: list[Tensor]) -> None:
        self.parts = [SortedValues(p) for p in parts]

    def at_most(self, candidates: Tensor) -> Tensor:
        return torch.stack([p.at_most(candidates) for p in self.parts]).sum(dim=0)


def brute_force_cutoff(values: Tensor, bound: float) -> float:
    """Largest prefix (by value, ties together) of the ascending values whose mean is below `bound`."""
    v = torch.sort(values.double()).values
    if v.numel() == 0 or float(v.mean()) < bound:
        return math.inf
    best = None
    for value in torch.unique(v).tolist():
        kept = v[v <= value]
        if float(kept.sum()) < bound * kept.numel():
            best = value
    return float(v[0]) if best is None else best


values_st = st.lists(st.one_of(st.floats(0.0, 4.0, width=32), st.sampled_from([0.0, 0.01, 0.25])),
                     min_size=0, max_size=60)


@settings(max_examples=50, deadline=None)
@given(values=values_st, bound=st.floats(1e-4, 2.0), splits=st.lists(st.integers(0, 60), max_size=4))
def test_m2po_cutoff_is_exact_and_layout_free(values: list[float], bound: float, splits: list[int]) -> None:
    x = torch.tensor(values, dtype=torch.float64)
    expected = brute_force_cutoff(x, bound)
    one = m2po_cutoff(SortedValues(x), bound, lambda t: t)
    cuts = sorted({min(s, x.numel()) for s in splits})
    parts = [x[a:b] for a, b in zip([0, *cuts], [*cuts, x.numel()], strict=True)]
    many = m2po_cutoff(_Shards(parts), bound, lambda t: t)  # type: ignore[arg-type]
    kept = lambda c: x <= c  # noqa: E731 - the kept set is what must agree
    assert torch.equal(kept(one), kept(expected)), (one, expected)
    assert torch.equal(kept(many), kept(one)), (many, one)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), bound=st.sampled_from([0.01, 0.04, 0.2]), rows=st.integers(1, 6))
def test_m2po_microbatch_split_equals_the_whole_batch(seed: int, bound: float, rows: int) -> None:
    """The step cutoff resolved from microbatches (a microbatch per row group) gives every microbatch the keep
    mask the whole batch gets on one process."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(6, 8, generator=gen) * 2
    rollout = old + 0.3 * torch.randn(6, 8, generator=gen)
    mask = torch.rand(6, 8, generator=gen) > 0.2
    cfg = RolloutCorrectionConfig(m2po_threshold=bound, rollout_token_veto_threshold=None)
    whole = compute_rollout_correction(old, rollout, mask, cfg)
    spans = [(a, min(a + rows, 6)) for a in range(0, 6, rows)]
    step_cfg = resolve_step_thresholds(cfg, [(old[a:b], rollout[a:b], mask[a:b]) for a, b in spans])
    pieces = [compute_rollout_correction(old[a:b], rollout[a:b], mask[a:b], step_cfg).keep_mask for a, b in spans]
    assert torch.equal(torch.cat(pieces), whole.keep_mask)
