"""The NeMo-RL adapter on DTensor logits (NeMo-RL's DTensor worker at TP > 1), on real gloo meshes.

On a 1-rank mesh and on a 2-rank mesh (the vocabulary split unevenly, 4 + 3 columns), a
vocabulary-sharded or replicated DTensor gives the loss and gradient of plain logits on one
process; a shard of the batch dimension raises a ValueError naming the placement (before this
change: `aten.gather.default got mixed torch.Tensor and DTensor`).
"""

from __future__ import annotations

import dist_harness
import dtensor_workers
import pytest
import torch

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("world_size", [1, 2])
def test_dtensor_logits_equal_plain_logits(world_size: int) -> None:
    data, logits = dtensor_workers.make_batch()
    plain = logits.clone().requires_grad_(True)
    loss, _ = dtensor_workers.adapter()(data=data, global_valid_seqs=float(dtensor_workers.ROWS),
                                        global_valid_toks=float(dtensor_workers.ROWS * dtensor_workers.COLS),
                                        logits=plain)
    (grad,) = torch.autograd.grad(loss, plain)
    results = dist_harness.launch(dtensor_workers.worker, world_size, timeout=120.0)
    for rank_result in results:
        for name in ("shard_vocab", "replicate"):
            assert rank_result[name]["loss"] == pytest.approx(float(loss.detach()), rel=1e-6, abs=1e-7), name
            torch.testing.assert_close(rank_result[name]["grad"], grad, rtol=1e-5, atol=1e-7)
        assert "Shard(dim=0)" in rank_result["batch_shard_error"] and "Replicate()" in rank_result["batch_shard_error"]
