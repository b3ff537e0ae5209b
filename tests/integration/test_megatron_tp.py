"""A real Megatron-Core GPTModel (local layer spec, CPU, gloo) at TP=2 through the loss matches TP=1.

One launch of 2 spawned gloo ranks (`megatron_tp_worker.worker`) builds a tiny GPT at TP=1, then
the same weights sharded at TP=2 (loaded through Megatron's partition layout and gathered back
to check they are bit-identical), runs TP-sharded logits `[batch, seq, vocab / 2]` through
`vocab_parallel_logprobs` and `rollout_corrected_policy_loss` (decoupled mode, several presets),
and backpropagates into the model. Loss, logprobs, IS weights, keep masks and every parameter
gradient (TP-sharded ones all-gathered) must equal TP=1 within fp32 tolerance.

Skipped when the `megatron` extra is not installed (CI installs it: ci/test.sh).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest
import torch
from default_lane import require

require("megatron.core", "megatron")


import dist_harness
import megatron_tp_worker as worker

pytestmark = [pytest.mark.integration, pytest.mark.distributed]

ATOL = 1e-5
RTOL = 1e-5


@pytest.fixture(scope="module")
def megatron_run() -> dict[str, Any]:
    started = time.perf_counter()
    ranks = dist_harness.launch(worker.worker, 2, timeout=180.0, collective_timeout=60.0)
    return {"ranks": ranks, "seconds": time.perf_counter() - started}


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def test_weights_loaded_into_tp2_are_identical(megatron_run: dict[str, Any]) -> None:
    for res in megatron_run["ranks"]:
        assert res["sharded_names"], "no TP-sharded parameter: the model is not tensor-parallel"
        assert any("output_layer" in n for n in res["sharded_names"])
        assert res["gathered_weights"].keys() == res["full_weights"].keys()
        for name, full in res["full_weights"].items():
            assert torch.equal(res["gathered_weights"][name], full), name
    # Both ranks built the same TP=1 model from the same seed.
    first, second = megatron_run["ranks"]
    for name, full in first["full_weights"].items():
        assert torch.equal(second["full_weights"][name], full), name


@pytest.mark.parametrize("case", list(worker.CASES))
def test_tp2_loss_logprobs_grads_match_tp1(megatron_run: dict[str, Any], case: str) -> None:
    ranks = megatron_run["ranks"]
    assert sorted(r["tp_rank"] for r in ranks) == [0, 1]
    reference = ranks[0]["tp1"][case]
    assert reference["logits_shape"] == (worker.BATCH, worker.SEQ, worker.VOCAB)
    keep = reference["keep_mask"].bool()
    assert 0 < int(keep.sum()) < int(worker.make_batch()["loss_mask"].sum()) or case == "decoupled_token_is"
    assert torch.isfinite(reference["loss"]) and float(reference["loss"].abs()) > 0
    for res in ranks:
        got = res["tp2"][case]
        assert got["logits_shape"] == (worker.BATCH, worker.SEQ, worker.VOCAB // 2)
        _close(got["logprobs"], reference["logprobs"], "logprobs")
        _close(got["loss"], reference["loss"], "loss")
        _close(got["is_weights"], reference["is_weights"], "is_weights")
        assert torch.equal(got["keep_mask"], reference["keep_mask"])
        assert got["num_grads"] == reference["num_grads"] > 0
        assert got["grads"].keys() == reference["grads"].keys()
        for name, grad in reference["grads"].items():
            assert grad.abs().max() > 0 or "bias" in name, f"{name}: zero reference gradient"
            _close(got["grads"][name], grad, f"grad {name}")


@pytest.mark.parametrize("case", list(worker.CASES))
def test_megatron_forward_step_loss_func_matches_objective_and_tp1(megatron_run: dict[str, Any], case: str) -> None:
    """The Megatron forward_step loss function on raw TP-sharded logits gives the core objective's
    loss and parameter gradients, at TP=1 and at TP=2 (so TP=2 through it matches TP=1)."""
    reference = megatron_run["ranks"][0]["tp1"][case]
    for res in megatron_run["ranks"]:
        for layout in ("tp1", "tp2"):
            got = res[layout][case]
            _close(got["megatron_loss"], reference["loss"], f"{layout} megatron loss")
            assert got["megatron_grads"].keys() == reference["grads"].keys()
            for name, grad in reference["grads"].items():
                _close(got["megatron_grads"][name], grad, f"{layout} megatron grad {name}")


def test_parallel_groups_from_megatron(megatron_run: dict[str, Any]) -> None:
    for res in megatron_run["ranks"]:
        layouts = res["layouts"]
        assert layouts["uninitialised_error"] and "not initialised" in layouts["uninitialised_error"]
        assert layouts["tp1"] == {"tp_size": 1, "tp_rank": 0, "cp_size": 1, "dp_size": 2, "dp_cp_size": 2,
                                  "last_stage": True}
        assert layouts["tp2"] == {"tp_size": 2, "tp_rank": res["rank"], "cp_size": 1, "dp_size": 1,
                                  "dp_cp_size": 1, "last_stage": True}


def test_megatron_import_is_guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    # With megatron-core installed (this lane), hide it: the package still imports and asking for
    # Megatron's groups raises ImportError (tests/distributed covers this only without the extra).
    from nemo_rollout_correction.distributed.groups import ParallelGroups
    from nemo_rollout_correction.models import megatron_cpu

    for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
        monkeypatch.setitem(sys.modules, name, None)  # a None entry makes `import` raise ImportError
    with pytest.raises(ImportError):
        ParallelGroups.from_megatron()
    with pytest.raises(ImportError):
        megatron_cpu.seed_model_parallel(0)
