"""`shard_next_token_batch`: a next-token batch cut for context parallelism, reassembled exactly."""

from __future__ import annotations

import pytest
import torch

from nemo_rollout_correction.distributed.context_parallel import (
    cp_token_indices,
    shard_next_token_batch,
    unshard_sequence,
)


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("width", [5, 12, 13])
def test_shards_reassemble_to_the_unsharded_next_token_view(cp: int, width: int) -> None:
    generator = torch.Generator().manual_seed(width)
    ids = torch.randint(3, 100, (2, width), generator=generator)
    logprobs = torch.randn(2, width - 1, generator=generator)
    mask = torch.rand(2, width - 1, generator=generator) > 0.3
    shards = [shard_next_token_batch(ids, {"rollout_logprobs": logprobs, "loss_mask": mask}, cp, r, pad_id=0)
              for r in range(cp)]
    padded = shards[0].padded
    assert padded % (2 * cp) == 0 and width <= padded < width + 2 * cp
    for rank, shard in enumerate(shards):
        assert torch.equal(shard.position_ids, cp_token_indices(padded, cp, rank))
        assert shard.input_ids.shape == shard.labels.shape == (2, padded // cp)
    full_ids = unshard_sequence([s.input_ids for s in shards])
    full_labels = unshard_sequence([s.labels for s in shards])
    assert torch.equal(full_ids[:, :width], ids) and bool((full_ids[:, width:] == 0).all())
    # The label at position t is the input at t + 1 (across chunk and rank boundaries), pad past the end.
    assert torch.equal(full_labels[:, : width - 1], ids[:, 1:]) and bool((full_labels[:, width - 1 :] == 0).all())
    full_lp = unshard_sequence([s.tokens["rollout_logprobs"] for s in shards])
    full_mask = unshard_sequence([s.tokens["loss_mask"] for s in shards])
    assert torch.equal(full_lp[:, : width - 1], logprobs) and bool((full_lp[:, width - 1 :] == 0).all())
    assert torch.equal(full_mask[:, : width - 1], mask) and not bool(full_mask[:, width - 1 :].any())


def test_token_tensors_must_have_the_next_token_width() -> None:
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"loss_mask: shape \(2, 8\) != \(rows, width - 1\)"):
        shard_next_token_batch(ids, {"loss_mask": torch.ones(2, 8, dtype=torch.bool)}, 2, 0, pad_id=0)
