"""Real multi-process gloo runs equal the single-process reference, layout by layout, config by config.

One launch of 4 spawned ranks (conftest `gloo_run`) runs every scenario of `dist_workers`: DP2,
CP2 load-balanced, CP2 contiguous, CP2 x DP2, TP2 (replicated values), TP2 x CP2, and PP2 x DP2
with a DP rank that has no microbatch. Here each layout's shards are put back together and
compared with `compute_rollout_correction` / `rollout_corrected_policy_loss` on the whole batch:
IS weights, keep and denominator masks, every metric, the loss denominators, the loss and its
gradient for three aggregation modes, and the collectives each rank issued.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_workers import CONFIGS, LAYOUTS, RAISE_CASES, make_data, raise_data
from equivalence import (
    TOL,
    assert_loss_and_logprob_gradient,
    assert_step_metrics_match,
    assert_weights_masks_and_denominators,
    close,
    reference,
)

from nemo_rollout_correction import compute_rollout_correction
from nemo_rollout_correction.core.correction import finish_correction, sequence_partials

pytestmark = pytest.mark.distributed

# Token-level rejection under CP exercises core's phase 2 on a fresh chunk view; these configs
# caught a core bug (phase 2 ignored token RS) that test_core_phase_two_applies_token_rejection
# now pins in one process.
_TOKEN_RS_CONFIGS = {"rs_token_k3_only", "bypass_rs", "rs_token_k1_is_mask", "rs_metrics_only", "frontier_all",
                     "frontier_opsm_den"}


def cases() -> list[Any]:
    """Every (layout, config)."""
    return [pytest.param(layout, name, id=f"{layout}-{name}") for layout in LAYOUTS for name in CONFIGS]


def layout_results(gloo_run: dict[str, Any], layout: str, name: str) -> list[dict[str, Any]]:
    """The per-rank results of one (layout, config), from the ranks of the last pipeline stage."""
    return [r["results"][(layout, name)] for r in gloo_run["ranks"] if (layout, name) in r["results"]]


@pytest.mark.parametrize(("layout", "name"), cases())
def test_weights_masks_and_denominators(gloo_run: dict[str, Any], layout: str, name: str) -> None:
    results = layout_results(gloo_run, layout, name)
    assert_weights_masks_and_denominators(results, name)
    out = reference(name)["out"]
    # Per-sequence kept-token counts over every CP piece, where a rank has a kept token.
    expected = out.keep_mask.sum(dim=-1).double()
    for result in results:
        for mb in result["microbatches"]:
            start, stop = mb["seq_rows"]
            local_keeps = mb["local_keep_any"]
            torch.testing.assert_close(mb["seq_kept_tokens"][local_keeps], expected[start:stop][local_keeps])


@pytest.mark.parametrize(("layout", "name"), cases())
def test_every_metric_equals_the_single_process_value(gloo_run: dict[str, Any], layout: str, name: str) -> None:
    assert_step_metrics_match(layout_results(gloo_run, layout, name), name)


@pytest.mark.parametrize(("layout", "name"), cases())
def test_loss_and_gradient_with_the_global_denominator(gloo_run: dict[str, Any], layout: str, name: str) -> None:
    results = layout_results(gloo_run, layout, name)
    assert_loss_and_logprob_gradient(results, name)
    for mode in reference(name)["loss"]:
        for result in results:
            for mb in result["microbatches"]:
                if "core_loss" in mb:  # no CP: core's objective on the microbatch gives the same
                    assert close(mb["core_loss"][mode], mb["loss"][mode])
                    torch.testing.assert_close(mb["core_grad"][mode], mb["grad"][mode], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_collective_budget_and_groups(gloo_run: dict[str, Any], layout: str) -> None:
    lay = LAYOUTS[layout]
    dp_cp = lay.cp * lay.dp
    for rank_result in gloo_run["ranks"]:
        for (name, cfg_name), calls in rank_result["collectives"].items():
            if name != layout:
                continue
            result = rank_result["results"][(name, cfg_name)]
            num_microbatches = len(result["microbatches"])
            # Beyond the correction's budget, by design: M2PO's exact cutoff search (a few dp x cp all-reduces of
            # <= 510 numbers per step) and GMPO's per-sequence sum in the loss (one CP all-gather per loss call).
            search = [c for c in calls if c[0] == "step_thresholds"]
            assert all(label == "dp_cp" and op == "all_reduce" for _, op, label, _ in search), cfg_name
            cfg = CONFIGS[cfg_name]
            searches = (cfg.m2po_threshold is not None) + (cfg.rollout_is_target_ess is not None)
            assert len(search) <= (12 * searches if dp_cp > 1 else 0), cfg_name  # ~8 rounds + totals per search
            in_loss = [c for c in calls if c[0] == "loss"]
            assert all(label == "cp" and op.startswith("all_gather") for _, op, label, _ in in_loss), cfg_name
            calls = [c for c in calls if c[0] not in ("step_thresholds", "loss")]
            labels = {label for _, _, label, _ in calls}
            assert labels <= {"cp", "dp_cp"}, f"{cfg_name}: collectives over {labels} (never WORLD, TP or DP alone)"
            per_mb = [c for c in calls if c[0] == "microbatch"]
            step = [c for c in calls if c[0] == "step"]
            assert all(label == "cp" and op.startswith("all_gather") for _, op, label, _ in per_mb)
            assert len(per_mb) == (num_microbatches if lay.cp > 1 else 0), cfg_name
            expected_step = 0 if dp_cp == 1 else (2 if lay.extremes == "max" else 1)
            assert len(step) == expected_step, (cfg_name, step)
            assert all(label == "dp_cp" and op == "all_reduce" for _, op, label, _ in step)
            assert len(calls) == len(per_mb) + len(step)
            # The budget: at most 2 collectives per microbatch for correction plus metrics.
            assert len(calls) <= 2 * max(num_microbatches, 1), cfg_name


def test_pipeline_stage_without_loss_skips(gloo_run: dict[str, Any]) -> None:
    skipped = [r["results"].get(("pp2_dp2", "stage")) for r in gloo_run["ranks"]]
    assert skipped[:2] == ["skipped: no loss on this pipeline stage"] * 2
    assert skipped[2:] == [None, None]
    # ... and the last stage's DP rank 0 had no microbatch yet reduced with its peer.
    empty = gloo_run["ranks"][2]["results"][("pp2_dp2", "none")]
    assert empty["microbatches"] == [] and empty["coords"][2] == 0


@pytest.mark.parametrize("case", list(RAISE_CASES))
def test_nonfinite_checks_raise_on_every_rank_together(gloo_run: dict[str, Any], case: str) -> None:
    outcomes = [r["results"][("raise", case)] for r in gloo_run["ranks"]]
    data = raise_data()
    try:
        compute_rollout_correction(data["old"], data["rollout"], data["mask"], RAISE_CASES[case])
        reference_raises = False
    except ValueError:
        reference_raises = True
    if reference_raises:
        # Only DP rank 1 saw the NaN, yet all four ranks raise, from the reduced counts: no rank is
        # left waiting in a collective.
        assert all(o.startswith("raised:") and "over all dp x cp ranks" in o for o in outcomes), outcomes
    else:
        assert outcomes == ["no error"] * 4


def test_the_scenarios_exercise_rejection_and_the_veto(gloo_run: dict[str, Any]) -> None:
    kept = {name: reference(name)["out"].keep_mask for name in CONFIGS}
    loss_tokens = make_data()["mask"].sum()
    assert any(0 < int(k.sum()) < int(loss_tokens) - 2 for k in kept.values())
    assert any(reference(name)["out"].metrics.get("rollout_corr/veto_fraction", 0) > 0 for name in CONFIGS)


@pytest.mark.parametrize("name", sorted(_TOKEN_RS_CONFIGS))
def test_core_phase_two_applies_token_rejection(name: str) -> None:
    """One process, no distribution: core's two phases equal its one call with token-level RS."""
    cfg = CONFIGS[name]
    data = make_data()
    old = data["logprobs"] if cfg.bypass_mode else data["old"]
    adv = data["advantages"]
    one_call = compute_rollout_correction(old, data["rollout"], data["mask"], cfg, advantages=adv)
    seq = sequence_partials(old, data["rollout"], data["mask"], cfg, advantages=adv)
    two_phase = finish_correction(old, data["rollout"], data["mask"], cfg, seq, advantages=adv)
    assert torch.equal(two_phase.keep_mask, one_call.keep_mask)
    assert two_phase.metrics == pytest.approx(one_call.metrics, rel=1e-9, abs=1e-12, nan_ok=True)


def test_frontier_configs_are_informative() -> None:
    """The frontier-mask scenarios reject something with every mask, so their CP equivalence means something."""
    m = reference("frontier_all")["out"].metrics
    for key in ("opsm_seq_masked_fraction", "kpop_masked_fraction", "dppo_tv_masked_fraction_high",
                "dppo_tv_masked_fraction_low", "rollout_is_masked_fraction"):
        assert m[f"rollout_corr/{key}"] > 0, key
    assert 0.9 < m["rollout_corr/prob_pearson"] < 1.0
    assert reference("frontier_opsm_den")["out"].metrics["rollout_corr/opsm_seq_masked_fraction"] > 0
