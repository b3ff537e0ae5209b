"""Real multi-process gloo runs equal the single-process reference, layout by layout, config by config.

One launch of 4 spawned ranks (conftest `gloo_run`) runs every scenario of `dist_workers`: DP2,
CP2 load-balanced, CP2 contiguous, CP2 x DP2, TP2 (replicated values), TP2 x CP2, and PP2 x DP2
with a DP rank that has no microbatch. Here each layout's shards are put back together and
compared with `compute_rollout_correction` / `rollout_corrected_policy_loss` on the whole batch:
IS weights, keep and denominator masks, every metric, the loss denominators, the loss and its
gradient for three aggregation modes, and the collectives each rank issued.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from dist_workers import COLS, CONFIGS, LAYOUTS, LOSS_MODES, RAISE_CASES, ROWS, loss_config, make_data, raise_data

from nemo_rollout_correction import compute_rollout_correction
from nemo_rollout_correction.core.aggregation import count_for_denominator
from nemo_rollout_correction.core.correction import finish_correction, sequence_partials
from nemo_rollout_correction.core.objective import rollout_corrected_policy_loss

pytestmark = pytest.mark.distributed

TOL = 1e-5

# Token-level rejection under CP exercises core's phase 2 on a fresh chunk view; these configs
# caught a core bug (phase 2 ignored token RS) that test_core_phase_two_applies_token_rejection
# now pins in one process.
_TOKEN_RS_CONFIGS = {"rs_token_k3_only", "bypass_rs", "rs_token_k1_is_mask", "rs_metrics_only", "frontier_all",
                     "frontier_opsm_den"}


def cases() -> list[Any]:
    """Every (layout, config)."""
    return [pytest.param(layout, name, id=f"{layout}-{name}") for layout in LAYOUTS for name in CONFIGS]


@functools.cache
def reference(name: str) -> dict[str, Any]:
    """The single-process result of config `name` on the whole batch."""
    cfg = CONFIGS[name]
    data = make_data()
    old = data["logprobs"] if cfg.bypass_mode else data["old"]
    out = compute_rollout_correction(old, data["rollout"], data["mask"], cfg, advantages=data["advantages"])
    losses, grads = {}, {}
    for mode in LOSS_MODES:
        logprobs = data["logprobs"].clone().requires_grad_(True)
        loss = rollout_corrected_policy_loss(logprobs, data["rollout"], data["advantages"], data["mask"], cfg,
                                             loss_config(cfg, mode), old_logprobs=data["old"]).loss
        (grad,) = torch.autograd.grad(loss, logprobs)
        losses[mode], grads[mode] = float(loss.detach()), grad
    return {"out": out, "loss": losses, "grad": grads,
            "num_seqs": float(count_for_denominator(out.denominator_mask, "seq-mean-token-mean"))}


def layout_results(gloo_run: dict[str, Any], layout: str, name: str) -> list[dict[str, Any]]:
    """The per-rank results of one (layout, config), from the ranks of the last pipeline stage."""
    return [r["results"][(layout, name)] for r in gloo_run["ranks"] if (layout, name) in r["results"]]


def assemble(results: list[dict[str, Any]], key: str, dtype: torch.dtype, sub: str | None = None) -> torch.Tensor:
    """Put the shards of `key` back into a [ROWS, COLS] tensor; every loss position is written
    exactly once per TP replica, and the replicas agree bitwise."""
    by_replica: dict[int, torch.Tensor] = {}
    writes = torch.zeros(ROWS, COLS, dtype=torch.int64)
    for result in results:
        target = by_replica.setdefault(result["coords"][0], torch.zeros(ROWS, COLS, dtype=dtype))
        for mb in result["microbatches"]:
            value = mb[key] if sub is None else mb[key][sub]
            target[mb["rows"], mb["cols"]] = value.to(dtype)
            writes[mb["rows"], mb["cols"]] += 1
    replicas = list(by_replica.values())
    mask = make_data()["mask"]
    # Packed layouts only hold each sequence up to its padded length; every loss token is there.
    assert (writes[mask] == len(replicas)).all() and (writes <= len(replicas)).all(), f"{key}: {writes}"
    for other in replicas[1:]:
        assert torch.equal(other, replicas[0]), f"TP replicas disagree on {key}"
    return replicas[0]


def close(actual: float, expected: float) -> bool:
    # NaN on both sides is agreement: a metric undefined on the batch (prob_pearson) is NaN everywhere.
    if math.isnan(actual) and math.isnan(expected):
        return True
    return math.isclose(actual, expected, rel_tol=TOL, abs_tol=TOL)


@pytest.mark.parametrize(("layout", "name"), cases())
def test_weights_masks_and_denominators(gloo_run: dict[str, Any], layout: str, name: str) -> None:
    results = layout_results(gloo_run, layout, name)
    ref = reference(name)
    out = ref["out"]
    assert torch.equal(assemble(results, "keep", torch.bool), out.keep_mask)
    assert torch.equal(assemble(results, "den", torch.bool), out.denominator_mask)
    torch.testing.assert_close(assemble(results, "is_weights", torch.float32), out.is_weights, rtol=TOL, atol=TOL)
    for result in results:
        assert result["num_global_tokens"] == out.num_denominator_tokens
        assert result["num_global_seqs"] == ref["num_seqs"]
    # Per-sequence kept-token counts over every CP piece, where a rank has a kept token.
    expected = out.keep_mask.sum(dim=-1).double()
    for result in results:
        for mb in result["microbatches"]:
            start, stop = mb["seq_rows"]
            local_keeps = mb["local_keep_any"]
            torch.testing.assert_close(mb["seq_kept_tokens"][local_keeps], expected[start:stop][local_keeps])


def assert_step_metrics_match(results: list[dict[str, Any]], name: str) -> None:
    """Every rank reports the same step metrics, equal to the single-process values of config `name`."""
    expected = reference(name)["out"].metrics
    first = results[0]["metrics"]
    for result in results[1:]:
        assert result["metrics"].keys() == first.keys(), "ranks disagree on the step's metric keys"
        assert all(close(result["metrics"][k], first[k]) for k in first), "ranks disagree on the step's metrics"
    assert first.keys() == expected.keys()
    wrong = {k: (first[k], v) for k, v in expected.items() if not close(first[k], v)}
    assert not wrong, f"metrics differ from the single-process values (got, expected): {wrong}"


@pytest.mark.parametrize(("layout", "name"), cases())
def test_every_metric_equals_the_single_process_value(gloo_run: dict[str, Any], layout: str, name: str) -> None:
    assert_step_metrics_match(layout_results(gloo_run, layout, name), name)


@pytest.mark.parametrize(("layout", "name"), cases())
def test_loss_and_gradient_with_the_global_denominator(gloo_run: dict[str, Any], layout: str, name: str) -> None:
    results = layout_results(gloo_run, layout, name)
    ref = reference(name)
    for mode in LOSS_MODES:
        # The step's loss is the sum of the microbatch losses over dp x cp (one TP replica).
        total = sum(mb["loss"][mode] for r in results if r["coords"][0] == 0 for mb in r["microbatches"])
        assert close(total, ref["loss"][mode]), (mode, total, ref["loss"][mode])
        grad = assemble(results, "grad", torch.float32, sub=mode)
        torch.testing.assert_close(grad, ref["grad"][mode], rtol=TOL, atol=TOL, msg=lambda m, mode=mode: f"{mode}: {m}")
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


def test_the_scenarios_exercise_rejection_and_the_lane_is_fast(gloo_run: dict[str, Any]) -> None:
    kept = {name: reference(name)["out"].keep_mask for name in CONFIGS}
    loss_tokens = make_data()["mask"].sum()
    assert any(0 < int(k.sum()) < int(loss_tokens) - 2 for k in kept.values())
    assert any(reference(name)["out"].metrics.get("rollout_corr/veto_fraction", 0) > 0 for name in CONFIGS)
    # A budget per config (120 s for the 44 configs before the 2026 objectives, with headroom for the shared
    # 2-core machine), so that adding a preset does not read as a slowdown.
    budget = 4.0 * len(CONFIGS)
    assert gloo_run["seconds"] < budget, f"the 4-rank launch took {gloo_run['seconds']:.0f} s (budget {budget:.0f} s)"


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
