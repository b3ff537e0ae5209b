"""Packed rows (`models.packing`, `policy.sequence_packing`) against the padded forward, on a real Megatron GPTModel.

One-process gloo, a tiny random Llama with grouped-query attention and the CPU layer spec (whose core attention,
`models.sdpa_attention.SdpaDotProductAttention`, attends within each packed row; Megatron's own
`DotProductAttention` refuses packed rows). A batch of very uneven rows with random padding: the packed logprobs
equal the padded ones on every real position (fp32 rounding) and are 0 elsewhere; the gradients of a loss with
per-row sequence sums match; changing one row changes no other row's logprobs (no attention across rows), which
a single causal mask over the pack would break.
"""

from __future__ import annotations

import pytest
import torch
from default_lane import require
from packed_grads import sequence_loss_grads

require("megatron.core", "megatron")

from nemo_rollout_correction.models.packing import PackedRows
from nemo_rollout_correction.models.policy import MegatronPolicy
from nemo_rollout_correction.models.schedule import forward_microbatches
from nemo_rollout_correction.trainer.policy_update import row_loss_starts

pytestmark = [pytest.mark.integration]

LENGTHS = torch.tensor([3, 41, 7, 26, 2])


@pytest.fixture(scope="module")
def policy(tiny_tied_policy: MegatronPolicy) -> MegatronPolicy:
    return tiny_tied_policy


def _rows(seed: int = 5) -> torch.Tensor:
    """`[rows, 41]` random tokens; the padding after each row's length is random too (a leak would read it)."""
    return torch.randint(3, 512, (len(LENGTHS), int(LENGTHS.max())), generator=torch.Generator().manual_seed(seed))


def _real(width: int) -> torch.Tensor:
    """`[rows, width - 1]`: the positions whose next token is a real token of the row."""
    return torch.arange(width - 1)[None, :] < (LENGTHS - 1)[:, None]


def test_pack_layout() -> None:
    ids = _rows()
    packed = PackedRows.of(ids, LENGTHS)
    assert packed.total == int(LENGTHS.sum()) and packed.max_seqlen == 41
    assert packed.cu_seqlens.tolist() == [0, 3, 44, 51, 77, 79] and packed.cu_seqlens.dtype == torch.int32
    assert packed.position_ids[0, 3:6].tolist() == [0, 1, 2]  # row 1 restarts at 0
    assert torch.equal(packed.input_ids[0, 44:51], ids[2, :7])
    starts = torch.tensor([1, 0, 3, 0, 0])
    cut = PackedRows.of(ids, LENGTHS, starts)
    assert len(cut.logit_index) == int((LENGTHS - 1 - starts).sum())
    with pytest.raises(ValueError, match="row lengths"):
        PackedRows.of(ids, torch.tensor([3, 42, 7, 26, 2]))


def test_packed_logprobs_equal_the_padded_forward(policy: MegatronPolicy) -> None:
    ids = _rows()
    real = _real(ids.shape[1])
    padded = policy.score_microbatches([ids])
    packed = policy.score_microbatches([ids], packed=[PackedRows.of(ids, LENGTHS)])
    assert padded is not None and packed is not None
    assert packed[0].shape == padded[0].shape == (5, 40)
    torch.testing.assert_close(packed[0][real], padded[0][real], rtol=1e-5, atol=1e-5)
    assert torch.equal(packed[0][~real], torch.zeros_like(packed[0][~real]))
    # per-row starts: the positions before a row's start are not computed, the others unchanged
    starts = torch.tensor([1, 20, 3, 0, 0])
    cut = policy.score_microbatches([ids], packed=[PackedRows.of(ids, LENGTHS, starts)])
    assert cut is not None
    read = real & (torch.arange(40)[None, :] >= starts[:, None])
    torch.testing.assert_close(cut[0][read], padded[0][read], rtol=1e-5, atol=1e-5)
    assert torch.equal(cut[0][~read], torch.zeros_like(cut[0][~read]))


def test_no_attention_across_rows(policy: MegatronPolicy) -> None:
    ids = _rows()
    other = ids.clone()
    other[1] = _rows(seed=9)[1]  # a different row 1
    base = policy.score_microbatches([ids], packed=[PackedRows.of(ids, LENGTHS)])
    changed = policy.score_microbatches([other], packed=[PackedRows.of(other, LENGTHS)])
    assert base is not None and changed is not None
    keep = torch.tensor([True, False, True, True, True])
    assert torch.equal(base[0][keep], changed[0][keep]), "a row's logprobs depend on another row of the pack"
    assert not torch.equal(base[0][1], changed[0][1])


def test_packed_gradients_equal_the_padded_ones(policy: MegatronPolicy) -> None:
    ids = _rows()
    mask = _real(ids.shape[1]) & (torch.arange(40)[None, :] >= 1)  # every row's response: from column 1
    starts = row_loss_starts(mask)
    pad_lp, pad_grads = sequence_loss_grads(policy, ids, None, mask)
    pack_lp, pack_grads = sequence_loss_grads(policy, ids, PackedRows.of(ids, LENGTHS, starts), mask)
    torch.testing.assert_close(pack_lp[mask], pad_lp[mask], rtol=1e-5, atol=1e-5)
    assert pad_grads.keys() == pack_grads.keys() and pad_grads
    for name, grad in pad_grads.items():
        torch.testing.assert_close(pack_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # the training forward with its graph equals the no-grad scoring pass bit for bit (reused old logprobs)
    packed = PackedRows.of(ids, LENGTHS, starts)
    with_graph = policy.packed_logprobs(forward_microbatches(policy.model, [ids], packed=[packed])[0], packed)
    scored = policy.score_microbatches([ids], packed=[packed])
    assert scored is not None and torch.equal(with_graph.detach(), scored[0])
