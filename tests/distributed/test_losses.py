"""The loss modules on real gloo ranks equal the single-process objective on the whole batch.

One launch of 4 spawned ranks (`loss_workers.worker`) runs DP2, CP2 (load-balanced and contiguous),
TP2 (vocab-parallel logits), TP2 x CP2 and CP2 x DP2 with uneven microbatches. For each layout,
config and aggregation mode: the summed microbatch losses of `RolloutCorrectedPolicyLoss` and
their gradient with respect to the logits; Megatron's per-token-loss schedule applied to the
`(loss_sum, num_tokens)` tuples (sum of loss_sum over microbatches and ranks / summed num_tokens);
and, without CP, the NeMo-RL adapter. All within 1e-5 of `core.objective` on one process.
"""

from __future__ import annotations

import time
from typing import Any

import dist_harness
import loss_workers
import pytest
import torch
from equivalence import TOL, assemble_logit_grads, assert_module_and_megatron_match, logits_reference
from loss_workers import CONFIGS, LAYOUTS, MODES, NEMO_MODES, STEP_THRESHOLD_CONFIGS

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def loss_run() -> dict[str, Any]:
    """All layouts' results, from one launch of 4 gloo ranks."""
    started = time.perf_counter()
    ranks = dist_harness.launch(loss_workers.worker, 4, timeout=420.0)
    return {"ranks": ranks, "seconds": time.perf_counter() - started}


def cases(modes: tuple[str, ...], layouts: list[str], skip: tuple[str, ...] = ()) -> list[Any]:
    return [pytest.param(layout, cfg, mode, id=f"{layout}-{cfg}-{mode}")
            for layout in layouts for cfg in CONFIGS if cfg not in skip for mode in modes]


@pytest.mark.parametrize(("layout", "cfg_name", "mode"), cases(MODES, list(LAYOUTS)))
def test_module_and_megatron_match_single_process(loss_run: dict[str, Any], layout: str, cfg_name: str,
                                                  mode: str) -> None:
    assert_module_and_megatron_match(loss_run, layout, cfg_name, CONFIGS[cfg_name], mode)


@pytest.mark.parametrize(("layout", "cfg_name", "mode"),
                         cases(NEMO_MODES, [n for n, lay in LAYOUTS.items() if lay.cp == 1], STEP_THRESHOLD_CONFIGS))
def test_nemo_rl_adapter_matches_single_process(loss_run: dict[str, Any], layout: str, cfg_name: str,
                                                mode: str) -> None:
    ref_loss, ref_grad = logits_reference(CONFIGS[cfg_name], mode)
    records, grad = assemble_logit_grads(loss_run, layout, (cfg_name, mode, "nemo_rl"))
    loss = sum(r["loss"] for coords, r in records if coords[0] == 0)
    assert abs(loss - ref_loss) < TOL, (loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad, atol=TOL, rtol=0)
