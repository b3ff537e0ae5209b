"""Step 1's device: `PolicyUpdate._microbatches` puts every training tensor of a microbatch on the policy's device.

The policy's parameters are on the `meta` device here, standing in for CUDA: rollout tensors are built on the CPU,
so any microbatch tensor left there would mix devices with the policy's logprobs in the first plan or loss call
(on GPU: "Expected all tensors to be on the same device").
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from nemo_rollout_correction.trainer.policy_update import Microbatch, PolicyUpdate


def test_microbatch_tensors_follow_the_policy_device() -> None:
    rows, width = 6, 9
    tensors = {
        "input_ids": torch.randint(0, 50, (rows, width)),
        "rollout_logprobs": -torch.rand(rows, width - 1),
        "loss_mask": torch.ones(rows, width - 1, dtype=torch.bool),
        "prompt_lengths": torch.full((rows,), 3),
        "response_lengths": torch.full((rows,), width - 3),
        "staleness": torch.zeros(rows, dtype=torch.int64),
    }
    meta = torch.device("meta")
    trainer = SimpleNamespace(
        groups=SimpleNamespace(dp_size=1, dp_rank=0, cp_size=1, cp_rank=0),
        cfg=SimpleNamespace(policy=SimpleNamespace(micro_batch_size=4, max_tokens_per_microbatch=0),
                            packs_sequences=False),
        policy=SimpleNamespace(device=meta, routing=None, cuts_logits=True),
        pad_id=0,
    )
    microbatches: list[Microbatch] = PolicyUpdate._microbatches(trainer, tensors, torch.randn(rows),  # type: ignore[arg-type]
                                                               torch.arange(rows))
    assert len(microbatches) == 2
    for mb in microbatches:
        for name in ("input_ids", "rollout_logprobs", "loss_mask", "advantages", "staleness"):
            assert getattr(mb, name).device == meta, name
        assert mb.rows.device.type == "cpu"  # row indices into the step's host tensors stay on the host
        # what the loss does first with them: mixing with the policy's (meta) logprobs works
        logprobs = torch.empty(mb.rollout_logprobs.shape, device=meta)
        _ = torch.where(mb.loss_mask, logprobs - mb.rollout_logprobs, 0.0) * mb.advantages[:, None]
