"""TP2 x CP2 x DP2 on 8 real gloo ranks equals the single-process reference (issue 3's 8-process layout).

One launch of 8 spawned ranks (`eight_rank_workers.worker`, groups from `build_parallel_groups` in
Megatron rank order) runs:

- rollout correction under the load-balanced, contiguous and packed (THD) CP layouts with uneven
  microbatches per DP rank, over configs covering every IS level and mode, every RS granularity,
  the veto, non-finite handling and batch-normalised IS: IS weights, keep and denominator masks,
  the step's denominators, every metric, the loss and its gradient w.r.t. the logprobs for three
  aggregation modes, and the collectives each rank issued (budget and groups);
- the loss modules on TP-sharded logits (vocab-parallel logprobs): `RolloutCorrectedPolicyLoss`
  with the step pre-pass, and the Megatron loss function with the per-token-loss schedule
  emulated: loss and gradient w.r.t. the full logits.

Everything within 1e-5 of one process on the whole batch.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import dist_harness
import eight_rank_workers
import pytest
import torch
from eight_rank_workers import LAYOUTS, LOSS_CONFIGS, LOSS_MODES, configs_of
from test_gloo_equivalence import TOL, assemble, assert_step_metrics_match, close, reference
from test_losses import assemble as assemble_logit_grads

from nemo_rollout_correction.core.objective import rollout_corrected_policy_loss
from nemo_rollout_correction.core.policy_loss import PolicyLossConfig

pytestmark = pytest.mark.distributed

LOSS_LAYOUT = "tp2_cp2_dp2"


@pytest.fixture(scope="module")
def eight_run() -> dict[str, Any]:
    """Every scenario, from one launch of 8 gloo ranks."""
    started = time.perf_counter()
    ranks = dist_harness.launch(eight_rank_workers.worker, eight_rank_workers.WORLD, timeout=240.0)
    return {"ranks": ranks, "seconds": time.perf_counter() - started}


def correction_cases() -> list[Any]:
    return [pytest.param(layout, name, id=f"{layout}-{name}") for layout in LAYOUTS for name in configs_of(layout)]


def results_of(eight_run: dict[str, Any], layout: str, name: str) -> list[dict[str, Any]]:
    return [r["results"][(layout, name)] for r in eight_run["ranks"]]


def test_ranks_are_laid_out_in_megatron_order(eight_run: dict[str, Any]) -> None:
    # Megatron: rank = tp_rank + tp * (cp_rank + cp * dp_rank).
    for rank, result in enumerate(eight_run["ranks"]):
        t, c, d = result["coords"]
        assert rank == t + 2 * (c + 2 * d), (rank, result["coords"])


@pytest.mark.parametrize(("layout", "name"), correction_cases())
def test_weights_masks_and_denominators(eight_run: dict[str, Any], layout: str, name: str) -> None:
    results = results_of(eight_run, layout, name)
    ref = reference(name)
    out = ref["out"]
    assert torch.equal(assemble(results, "keep", torch.bool), out.keep_mask)
    assert torch.equal(assemble(results, "den", torch.bool), out.denominator_mask)
    torch.testing.assert_close(assemble(results, "is_weights", torch.float32), out.is_weights, rtol=TOL, atol=TOL)
    for result in results:
        assert result["num_global_tokens"] == out.num_denominator_tokens
        assert result["num_global_seqs"] == ref["num_seqs"]


@pytest.mark.parametrize(("layout", "name"), correction_cases())
def test_every_metric_equals_the_single_process_value(eight_run: dict[str, Any], layout: str, name: str) -> None:
    assert_step_metrics_match(results_of(eight_run, layout, name), name)


@pytest.mark.parametrize(("layout", "name"), correction_cases())
def test_loss_and_logprob_gradient(eight_run: dict[str, Any], layout: str, name: str) -> None:
    results = results_of(eight_run, layout, name)
    ref = reference(name)
    for mode, ref_loss in ref["loss"].items():
        # The step's loss: the microbatch losses summed over dp x cp, on one TP replica.
        total = sum(mb["loss"][mode] for r in results if r["coords"][0] == 0 for mb in r["microbatches"])
        assert close(total, ref_loss), (mode, total, ref_loss)
        grad = assemble(results, "grad", torch.float32, sub=mode)
        torch.testing.assert_close(grad, ref["grad"][mode], rtol=TOL, atol=TOL,
                                   msg=lambda m, mode=mode: f"{mode}: {m}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_collective_budget_and_groups(eight_run: dict[str, Any], layout: str) -> None:
    lay = LAYOUTS[layout]
    for rank_result in eight_run["ranks"]:
        for name in configs_of(layout):
            calls = rank_result["collectives"][(layout, name)]
            num_microbatches = len(rank_result["results"][(layout, name)]["microbatches"])
            labels = {label for _, _, label, _ in calls}
            assert labels <= {"cp", "dp_cp"}, f"{name}: collectives over {labels} (never WORLD, TP or DP alone)"
            per_mb = [c for c in calls if c[0] == "microbatch"]
            step = [c for c in calls if c[0] == "step"]
            assert all(label == "cp" and op.startswith("all_gather") for _, op, label, _ in per_mb), name
            assert len(per_mb) == num_microbatches, name
            assert len(step) == (2 if lay.extremes == "max" else 1), (name, step)
            assert all(label == "dp_cp" and op == "all_reduce" for _, op, label, _ in step), name
            assert len(calls) == len(per_mb) + len(step)
            # The budget: at most 2 all-reduces per microbatch for correction plus metrics.
            assert sum(op == "all_reduce" for _, op, _, _ in calls) <= 2 * num_microbatches, name
            # Counting every collective, the default extremes (slots inside the one SUM) also keep
            # within 2 per microbatch; the opt-in `extremes="max"` spends one more all-reduce per
            # step, so a DP rank with a single CP microbatch issues 3 (all-gather + SUM + MAX).
            extra = 1 if lay.extremes == "max" else 0
            assert len(calls) <= 2 * num_microbatches + extra, name


@functools.cache
def logits_reference(cfg_name: str, mode: str) -> tuple[float, torch.Tensor]:
    """Single-process loss and gradient w.r.t. the full logits `[ROWS, COLS, VOCAB]`."""
    import loss_workers

    data = loss_workers.make_data()
    cfg = LOSS_CONFIGS[cfg_name]
    logits = data["logits"].clone().requires_grad_(True)
    logprobs = torch.log_softmax(logits, -1).gather(-1, data["targets"].unsqueeze(-1)).squeeze(-1)
    loss_cfg = loss_workers.loss_module(cfg, mode).loss_cfg
    assert isinstance(loss_cfg, PolicyLossConfig)
    loss = rollout_corrected_policy_loss(logprobs, data["rollout"], data["advantages"], data["mask"], cfg, loss_cfg,
                                         old_logprobs=data["old"]).loss
    (grad,) = torch.autograd.grad(loss, logits)
    return float(loss.detach()), grad


@pytest.mark.parametrize(("cfg_name", "mode"), [pytest.param(c, m, id=f"{c}-{m}")
                                                for c in LOSS_CONFIGS for m in LOSS_MODES])
def test_loss_modules_and_logits_gradient(eight_run: dict[str, Any], cfg_name: str, mode: str) -> None:
    loss_run = {"ranks": [{LOSS_LAYOUT: r["losses"]} for r in eight_run["ranks"]]}
    ref_loss, ref_grad = logits_reference(cfg_name, mode)
    records, grad = assemble_logit_grads(loss_run, LOSS_LAYOUT, (cfg_name, mode, "module"))
    loss = sum(r["loss"] for coords, r in records if coords[0] == 0)
    assert abs(loss - ref_loss) < TOL, (loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad, atol=TOL, rtol=0)
    metrics = [r["metrics"] for _, r in records]
    assert all(m == metrics[0] for m in metrics), "step metrics identical on every rank"
    # Megatron, calculate_per_token_loss=True: gradient of each loss_sum, then 1 / the num_tokens
    # summed over microbatches and dp x cp (what finalize_model_grads does).
    records, grad_sum = assemble_logit_grads(loss_run, LOSS_LAYOUT, (cfg_name, mode, "megatron"))
    num_tokens = sum(r["num_tokens"] for coords, r in records if coords[0] == 0)
    loss_sum = sum(r["loss_sum"] for coords, r in records if coords[0] == 0)
    scale = 1.0 / max(num_tokens, 1)
    assert abs(loss_sum * scale - ref_loss) < TOL, (loss_sum * scale, ref_loss)
    torch.testing.assert_close(grad_sum * scale, ref_grad, atol=TOL, rtol=0)
