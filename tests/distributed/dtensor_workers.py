"""Workers for the DTensor-logits test of the NeMo-RL adapter (NeMo-RL's DTensor worker at TP > 1).

Every rank builds the same NeMo-RL microbatch, puts the logits on a gloo device mesh over all
ranks as a DTensor (vocabulary sharded, or replicated), runs the adapter, and returns the loss and
the full gradient; a batch-dimension shard must raise a ValueError naming the placement.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.policy_loss import PolicyLossConfig
from nemo_rollout_correction.losses import NeMoRLRolloutCorrectedLoss

ROWS, COLS, VOCAB = 3, 5, 7  # 7 columns over 2 ranks: an uneven shard (4 + 3), as torch.chunk splits


def make_batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(ROWS, COLS + 1, VOCAB, generator=gen)
    ids = torch.randint(0, VOCAB, (ROWS, COLS + 1), generator=gen)
    curr = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    prev = curr + 0.05 * torch.randn(ROWS, COLS, generator=gen)
    pad = torch.zeros(ROWS, 1)
    data = {
        "input_ids": ids,
        "generation_logprobs": torch.cat([pad, prev + 0.1 * torch.randn(ROWS, COLS, generator=gen)], 1),
        "prev_logprobs": torch.cat([pad, prev], 1),
        "advantages": torch.tensor([1.0, -0.5, 0.7])[:, None].expand(ROWS, COLS + 1).contiguous(),
        "token_mask": torch.cat([pad, torch.ones(ROWS, COLS)], 1),
        "sample_mask": torch.ones(ROWS),
    }
    return data, logits


def adapter() -> NeMoRLRolloutCorrectedLoss:
    cfg = RolloutCorrectionConfig.from_preset("decoupled_token_is")
    return NeMoRLRolloutCorrectedLoss(cfg, PolicyLossConfig(loss_agg_mode="seq-mean-token-mean"), vocab_size=VOCAB)


def worker(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    data, logits = make_batch()
    out: dict[str, Any] = {}
    for name, placements in (("shard_vocab", [Shard(2)]), ("replicate", [Replicate()])):
        leaf = distribute_tensor(logits, mesh, placements).requires_grad_(True)
        loss, _ = adapter()(data=data, global_valid_seqs=float(ROWS), global_valid_toks=float(ROWS * COLS),
                            logits=leaf)
        loss.backward()
        assert leaf.grad is not None
        out[name] = {"loss": float(loss.detach()), "grad": leaf.grad.full_tensor()}
    try:
        adapter()(data=data, global_valid_seqs=float(ROWS), global_valid_toks=float(ROWS * COLS),
                  logits=distribute_tensor(logits, mesh, [Shard(0)]))
    except ValueError as exc:
        out["batch_shard_error"] = str(exc)
    return out
