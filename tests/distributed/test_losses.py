"""The loss modules on real gloo ranks equal the single-process objective on the whole batch.

One launch of 4 spawned ranks (`loss_workers.worker`) runs DP2, CP2 (load-balanced and contiguous),
TP2 (vocab-parallel logits), TP2 x CP2 and CP2 x DP2 with uneven microbatches. For each layout,
config and aggregation mode: the summed microbatch losses of `RolloutCorrectedPolicyLoss` and
their gradient with respect to the logits; Megatron's per-token-loss schedule applied to the
`(loss_sum, num_tokens)` tuples (sum of loss_sum over microbatches and ranks / summed num_tokens);
and, without CP, the NeMo-RL adapter. All within 1e-5 of `core.objective` on one process.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import dist_harness
import loss_workers
import pytest
import torch
from loss_workers import COLS, CONFIGS, LAYOUTS, MODES, NEMO_MODES, ROWS, VOCAB, loss_module, make_data

from nemo_rollout_correction.core.objective import rollout_corrected_policy_loss
from nemo_rollout_correction.core.policy_loss import PolicyLossConfig

pytestmark = pytest.mark.distributed

TOL = 1e-5


@pytest.fixture(scope="module")
def loss_run() -> dict[str, Any]:
    """All layouts' results, from one launch of 4 gloo ranks."""
    started = time.perf_counter()
    ranks = dist_harness.launch(loss_workers.worker, 4, timeout=420.0)
    return {"ranks": ranks, "seconds": time.perf_counter() - started}


@functools.cache
def reference(cfg_name: str, mode: str) -> tuple[float, torch.Tensor]:
    """Single-process loss and gradient w.r.t. the full logits `[ROWS, COLS, VOCAB]`."""
    data = make_data()
    cfg = CONFIGS[cfg_name]
    logits = data["logits"].clone().requires_grad_(True)
    logprobs = torch.log_softmax(logits, -1).gather(-1, data["targets"].unsqueeze(-1)).squeeze(-1)
    loss_cfg = loss_module(cfg, mode).loss_cfg
    assert isinstance(loss_cfg, PolicyLossConfig)
    loss = rollout_corrected_policy_loss(logprobs, data["rollout"], data["advantages"], data["mask"], cfg, loss_cfg,
                                         old_logprobs=data["old"]).loss
    (grad,) = torch.autograd.grad(loss, logits)
    return float(loss.detach()), grad


def assemble(loss_run: dict[str, Any], layout: str, key: tuple[str, str, str]) -> tuple[list[Any], torch.Tensor]:
    """Per-rank records of `key` and the full-logits gradient put together from the shards."""
    grad = torch.zeros(ROWS, COLS, VOCAB)
    written = torch.zeros(ROWS, COLS, VOCAB, dtype=torch.int64)
    records = []
    for rank in loss_run["ranks"]:
        if layout not in rank:
            continue
        rec = rank[layout]
        records.append((rec["coords"], rec["results"][key]))
        v0, v1 = rec["vocab"]
        for start, stop, g in rec["results"][key]["grads"]:
            grad[start:stop][:, rec["cols"], v0:v1] += g
            written[start:stop][:, rec["cols"], v0:v1] += 1
    assert bool((written == 1).all()), f"{layout} {key}: every logit gradient written exactly once"
    return records, grad


def cases(modes: tuple[str, ...], layouts: list[str]) -> list[Any]:
    return [pytest.param(layout, cfg, mode, id=f"{layout}-{cfg}-{mode}")
            for layout in layouts for cfg in CONFIGS for mode in modes]


@pytest.mark.parametrize(("layout", "cfg_name", "mode"), cases(MODES, list(LAYOUTS)))
def test_module_and_megatron_match_single_process(loss_run: dict[str, Any], layout: str, cfg_name: str,
                                                  mode: str) -> None:
    ref_loss, ref_grad = reference(cfg_name, mode)
    records, grad = assemble(loss_run, layout, (cfg_name, mode, "module"))
    # Sum over the dp x cp ranks of one TP coordinate (TP replicas hold the same loss).
    loss = sum(r["loss"] for coords, r in records if coords[0] == 0)
    assert abs(loss - ref_loss) < TOL, (loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad, atol=TOL, rtol=0)
    tp0 = [r["metrics"] for coords, r in records if coords[0] == 0]
    assert all(m == tp0[0] for m in tp0), "step metrics identical on every rank"

    # Megatron, calculate_per_token_loss=True: backward of each loss_sum, then finalize_model_grads
    # all-reduces num_tokens over dp x cp and scales every gradient by 1 / total.
    records, grad_sum = assemble(loss_run, layout, (cfg_name, mode, "megatron"))
    num_tokens = sum(r["num_tokens"] for coords, r in records if coords[0] == 0)
    loss_sum = sum(r["loss_sum"] for coords, r in records if coords[0] == 0)
    scale = 1.0 / max(num_tokens, 1)
    assert abs(loss_sum * scale - ref_loss) < TOL, (loss_sum * scale, ref_loss)
    torch.testing.assert_close(grad_sum * scale, ref_grad, atol=TOL, rtol=0)


@pytest.mark.parametrize(("layout", "cfg_name", "mode"),
                         cases(NEMO_MODES, [n for n, lay in LAYOUTS.items() if lay.cp == 1]))
def test_nemo_rl_adapter_matches_single_process(loss_run: dict[str, Any], layout: str, cfg_name: str,
                                                mode: str) -> None:
    ref_loss, ref_grad = reference(cfg_name, mode)
    records, grad = assemble(loss_run, layout, (cfg_name, mode, "nemo_rl"))
    loss = sum(r["loss"] for coords, r in records if coords[0] == 0)
    assert abs(loss - ref_loss) < TOL, (loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad, atol=TOL, rtol=0)


def test_launch_is_fast(loss_run: dict[str, Any]) -> None:
    # The work grows with the parametrisation (every config x mode x layout): a budget per config (12 s
    # each measured on the shared 2-core machine), so that adding an objective does not read as a slowdown.
    assert loss_run["seconds"] < 15.0 * len(CONFIGS), loss_run["seconds"]
