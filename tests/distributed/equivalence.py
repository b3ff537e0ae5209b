"""The checks that compare gloo ranks' results with one process, shared by the distributed test modules.

`test_gloo_equivalence` (4 ranks, `dist_workers`), `test_eight_ranks` (TP2 x CP2 x DP2) and `test_losses`
(`loss_workers`) assert the same things on different launches: the shards put back together equal the
single-process reference of the same data within `TOL`. The references are cached per process.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import loss_workers
import torch
from dist_workers import COLS, CONFIGS, LOSS_MODES, ROWS, loss_config, make_data

from nemo_rollout_correction import compute_rollout_correction
from nemo_rollout_correction.core.aggregation import count_for_denominator
from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.objective import rollout_corrected_policy_loss
from nemo_rollout_correction.core.policy_loss import PolicyLossConfig

TOL = 1e-5


def close(actual: float, expected: float) -> bool:
    # NaN on both sides is agreement: a metric undefined on the batch (prob_pearson) is NaN everywhere.
    if math.isnan(actual) and math.isnan(expected):
        return True
    return math.isclose(actual, expected, rel_tol=TOL, abs_tol=TOL)


# ---- rollout correction on dist_workers' [ROWS, COLS] batch -------------------------------------------------


@functools.cache
def reference(name: str) -> dict[str, Any]:
    """The single-process result of `dist_workers` config `name` on the whole batch."""
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


def assert_weights_masks_and_denominators(results: list[dict[str, Any]], name: str) -> None:
    """IS weights, keep and denominator masks put together, and every rank's global denominators."""
    ref = reference(name)
    out = ref["out"]
    assert torch.equal(assemble(results, "keep", torch.bool), out.keep_mask)
    assert torch.equal(assemble(results, "den", torch.bool), out.denominator_mask)
    torch.testing.assert_close(assemble(results, "is_weights", torch.float32), out.is_weights, rtol=TOL, atol=TOL)
    for result in results:
        assert result["num_global_tokens"] == out.num_denominator_tokens
        assert result["num_global_seqs"] == ref["num_seqs"]


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


def assert_loss_and_logprob_gradient(results: list[dict[str, Any]], name: str) -> None:
    """Per aggregation mode: the step's loss (microbatch losses over dp x cp, one TP replica) and its gradient
    w.r.t. the logprobs, put together from the shards."""
    ref = reference(name)
    for mode in LOSS_MODES:
        total = sum(mb["loss"][mode] for r in results if r["coords"][0] == 0 for mb in r["microbatches"])
        assert close(total, ref["loss"][mode]), (mode, total, ref["loss"][mode])
        grad = assemble(results, "grad", torch.float32, sub=mode)
        torch.testing.assert_close(grad, ref["grad"][mode], rtol=TOL, atol=TOL, msg=lambda m, mode=mode: f"{mode}: {m}")


# ---- loss modules on loss_workers' TP-sharded logits ---------------------------------------------------------


@functools.cache
def logits_reference(cfg: RolloutCorrectionConfig, mode: str) -> tuple[float, torch.Tensor]:
    """Single-process loss and gradient w.r.t. the full logits `[ROWS, COLS, VOCAB]` of `loss_workers`' data."""
    data = loss_workers.make_data()
    logits = data["logits"].clone().requires_grad_(True)
    logprobs = torch.log_softmax(logits, -1).gather(-1, data["targets"].unsqueeze(-1)).squeeze(-1)
    loss_cfg = loss_workers.loss_module(cfg, mode).loss_cfg
    assert isinstance(loss_cfg, PolicyLossConfig)
    loss = rollout_corrected_policy_loss(logprobs, data["rollout"], data["advantages"], data["mask"], cfg, loss_cfg,
                                         old_logprobs=data["old"]).loss
    (grad,) = torch.autograd.grad(loss, logits)
    return float(loss.detach()), grad


def assemble_logit_grads(loss_run: dict[str, Any], layout: str, key: tuple[str, str, str]
                         ) -> tuple[list[Any], torch.Tensor]:
    """Per-rank records of `key` and the full-logits gradient put together from the shards."""
    rows, cols, vocab = loss_workers.ROWS, loss_workers.COLS, loss_workers.VOCAB
    grad = torch.zeros(rows, cols, vocab)
    written = torch.zeros(rows, cols, vocab, dtype=torch.int64)
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


def assert_module_and_megatron_match(loss_run: dict[str, Any], layout: str, cfg_name: str,
                                     cfg: RolloutCorrectionConfig, mode: str) -> None:
    """`RolloutCorrectedPolicyLoss` and the Megatron loss function on the ranks equal one process."""
    ref_loss, ref_grad = logits_reference(cfg, mode)
    records, grad = assemble_logit_grads(loss_run, layout, (cfg_name, mode, "module"))
    # Sum over the dp x cp ranks of one TP coordinate (TP replicas hold the same loss).
    loss = sum(r["loss"] for coords, r in records if coords[0] == 0)
    assert abs(loss - ref_loss) < TOL, (loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad, atol=TOL, rtol=0)
    metrics = [r["metrics"] for _, r in records]
    assert all(m == metrics[0] for m in metrics), "step metrics identical on every rank"
    # Megatron, calculate_per_token_loss=True: backward of each loss_sum, then finalize_model_grads
    # all-reduces num_tokens over dp x cp and scales every gradient by 1 / total.
    records, grad_sum = assemble_logit_grads(loss_run, layout, (cfg_name, mode, "megatron"))
    num_tokens = sum(r["num_tokens"] for coords, r in records if coords[0] == 0)
    loss_sum = sum(r["loss_sum"] for coords, r in records if coords[0] == 0)
    scale = 1.0 / max(num_tokens, 1)
    assert abs(loss_sum * scale - ref_loss) < TOL, (loss_sum * scale, ref_loss)
    torch.testing.assert_close(grad_sum * scale, ref_grad, atol=TOL, rtol=0)
