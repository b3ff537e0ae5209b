"""Step-level thresholds (core/step_thresholds.py): the exact search, and its independence of the layout.

The search sees the step only through per-candidate (count, sum) pairs that add over shards, so splitting the
tokens over microbatches or ranks (simulated here by summing each shard's statistics, which is what the
all-reduce does) must give the very same cutoff as one process holding every token; and that cutoff must be
the one a brute-force sort gives.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from nemo_rollout_correction import RolloutCorrectionConfig
from nemo_rollout_correction.core.correction import compute_rollout_correction
from nemo_rollout_correction.core.step_thresholds import (
    SortedValues,
    adaptive_is_threshold,
    m2po_cutoff,
    resolve_step_thresholds,
)


class _Shards:
    """Several ranks' values; `at_most` sums their statistics like the dp x cp all-reduce."""

    def __init__(self, parts: list[Tensor]) -> None:
        self.parts = [SortedValues(p) for p in parts]

    def at_most(self, candidates: Tensor) -> Tensor:
        return torch.stack([p.at_most(candidates) for p in self.parts]).sum(dim=0)

    def at_most_with_squares(self, candidates: Tensor) -> Tensor:
        return torch.stack([p.at_most_with_squares(candidates) for p in self.parts]).sum(dim=0)


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


@settings(max_examples=30, deadline=None)
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


# ---- the adaptive IS threshold (rollout_is_target_ess) -------------------------------------------------


def ess_fraction(rho: Tensor, bound: float) -> float:
    w = rho.clamp(max=bound)
    return float(w.sum() ** 2 / (w.numel() * w.square().sum()))


ratios_st = st.lists(st.floats(1e-3, 50.0), min_size=1, max_size=60)


@settings(max_examples=30, deadline=None)
@given(values=ratios_st, targets=st.lists(st.floats(0.05, 1.0), min_size=2, max_size=4),
       cap=st.floats(1.0, 100.0), splits=st.lists(st.integers(0, 60), max_size=3))
def test_adaptive_threshold_is_the_largest_bound_meeting_the_target(values: list[float], targets: list[float],
                                                                    cap: float, splits: list[int]) -> None:
    """The bound meets the target and one ulp more would not (unless it is the cap, or 1 with the target out of
    reach); it never grows with the target; shards (ranks, microbatches) give the same bound to float64 rounding."""
    rho = torch.tensor(values, dtype=torch.float64)
    cuts = sorted({min(s, rho.numel()) for s in splits})
    parts = [rho[a:b] for a, b in zip([0, *cuts], [*cuts, rho.numel()], strict=True)]
    bounds = []
    for target in sorted(targets):
        bound = adaptive_is_threshold(SortedValues(rho), target, cap, lambda t: t)
        sharded = adaptive_is_threshold(_Shards(parts), target, cap, lambda t: t)  # type: ignore[arg-type]
        assert 1.0 <= bound <= cap
        assert math.isclose(sharded, bound, rel_tol=1e-12), (sharded, bound)
        if bound > 1.0:
            assert ess_fraction(rho, bound) >= target * (1 - 1e-12)
        if bound < cap:
            above = math.nextafter(bound, math.inf) * (1 + 1e-9)
            assert ess_fraction(rho, above) < target * (1 + 1e-9) or bound == 1.0
        bounds.append(bound)
    assert bounds == sorted(bounds, reverse=True)  # monotone: a higher target never allows a larger bound


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), target=st.sampled_from([0.5, 0.8, 0.95]), rows=st.integers(1, 6))
def test_adaptive_threshold_microbatch_split_equals_the_whole_batch(seed: int, target: float, rows: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(6, 8, generator=gen) * 2
    rollout = old + 0.4 * torch.randn(6, 8, generator=gen)
    mask = torch.rand(6, 8, generator=gen) > 0.2
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=20.0, rollout_is_target_ess=target)
    whole = compute_rollout_correction(old, rollout, mask, cfg)
    spans = [(a, min(a + rows, 6)) for a in range(0, 6, rows)]
    step_cfg = resolve_step_thresholds(cfg, [(old[a:b], rollout[a:b], mask[a:b]) for a, b in spans])
    assert math.isclose(step_cfg.rollout_is_threshold, whole.metrics["rollout_corr/rollout_is_threshold_auto"],
                        rel_tol=1e-12)
    pieces = [compute_rollout_correction(old[a:b], rollout[a:b], mask[a:b], step_cfg).is_weights for a, b in spans]
    torch.testing.assert_close(torch.cat(pieces), whole.is_weights, rtol=1e-6, atol=0)
    assert step_cfg.is_threshold_cap == 20.0  # the configured bound stays the cap of later steps


@pytest.mark.parametrize(("fields", "name"), [
    ({"rollout_is_target_ess": 0.0}, "rollout_is_target_ess"),
    ({"rollout_is_target_ess": 1.5}, "rollout_is_target_ess"),
    ({"rollout_is_target_ess": float("nan")}, "rollout_is_target_ess"),
    ({"rollout_is_target_ess": 0.9, "rollout_is": "sequence"}, "rollout_is_target_ess"),
    ({"rollout_is_target_ess": 0.9, "rollout_is_mode": "mask"}, "rollout_is_target_ess"),
    ({"rollout_is_target_ess": 0.9, "rollout_is_two_sided": True}, "rollout_is_target_ess"),
    ({"rollout_is_target_ess": 0.9, "old_logprob_source": "loglinear"}, "rollout_is_target_ess"),
])
def test_adaptive_threshold_bad_input_names_the_field(fields: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        RolloutCorrectionConfig.from_dict({"rollout_is": "token", **fields})


def test_adaptive_threshold_is_logged_and_out_of_reach_targets_stop_at_one() -> None:
    """A target one-sided truncation cannot reach (the ratios below 1 already spread the weights) stops at U = 1,
    and the logged ESS shows the shortfall."""
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(16, 32, generator=gen) * 3
    rollout = old + 0.5 * torch.randn(16, 32, generator=gen)
    mask = torch.ones(16, 32, dtype=torch.bool)
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=100.0, rollout_is_target_ess=0.99)
    m = compute_rollout_correction(old, rollout, mask, cfg).metrics
    assert m["rollout_corr/rollout_is_threshold_auto"] == 1.0
    assert m["rollout_corr/rollout_is_eff_sample_size"] < 0.99
    easy = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig.from_dict(
        {**cfg.to_dict(), "rollout_is_target_ess": 0.05})).metrics
    assert easy["rollout_corr/rollout_is_threshold_auto"] == 100.0  # the cap: the target needs no truncation


@pytest.mark.parametrize("fields", [{"m2po_threshold": 0.04},
                                    {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_target_ess": 0.9}])
def test_bypass_step_thresholds_plan_a_prepass(fields: dict[str, object]) -> None:
    """In bypass mode the step's values exist only after a no-grad pass of the current policy: never the
    rollout-only shortcut or the post-scaled loss pass, which would choose the threshold per microbatch."""
    from nemo_rollout_correction.losses.step_plan import denominator_strategy

    cfg = RolloutCorrectionConfig.from_dict({"bypass_mode": True, "rollout_token_veto_threshold": None, **fields})
    assert denominator_strategy(cfg, kl_penalty_on=False) == "prepass"
    decoupled = RolloutCorrectionConfig.from_dict({**cfg.to_dict(), "bypass_mode": False,
                                                   "loss_type": "ppo_clip"})
    assert denominator_strategy(decoupled, kl_penalty_on=False) == "decoupled"


@pytest.mark.parametrize("field", [{"m2po_threshold": 0.04}, {"rollout_is_target_ess": 0.5}])
def test_step_reductions_refuse_a_config_whose_step_thresholds_are_unresolved(field: dict[str, float]) -> None:
    """Without the step's chosen thresholds, rollout_is_p* and the M2PO metrics would silently read the cap."""
    from nemo_rollout_correction.distributed import ParallelGroups
    from nemo_rollout_correction.distributed.correction import Partials, reduce_step_metrics, reduce_step_partials

    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, **field)
    for reduce in (reduce_step_metrics, reduce_step_partials):
        with pytest.raises(ValueError, match="resolve_step_config"):
            reduce(Partials(), cfg, ParallelGroups.single())
