"""The output layer applied from a sequence position on (`models.logit_positions`) against the full projection.

Real Megatron-Core (one-process gloo), a tiny random Llama: the logprobs of the cut forward equal the full
forward's on the positions it computes (fp32 rounding) and are 0 before them; the gradients of a loss over
those positions match; the no-grad scoring pass equals the training forward bit for bit (reused old logprobs);
and the trainer's start (`first_loss_position`) is the first column any row's loss reads.
"""

from __future__ import annotations

import pytest
import torch
from default_lane import require

require("megatron.core", "megatron")

from nemo_rollout_correction.models.logit_positions import from_position, output_layer
from nemo_rollout_correction.models.policy import MegatronPolicy
from nemo_rollout_correction.models.schedule import forward_microbatches, run_microbatches
from nemo_rollout_correction.trainer.policy_update import first_loss_position

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def policy(tiny_tied_policy: MegatronPolicy) -> MegatronPolicy:
    return tiny_tied_policy


def _batches() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, 512, (3, 21), generator=gen), torch.randint(3, 512, (2, 17), generator=gen)]
    masks = [torch.zeros(3, 20, dtype=torch.bool), torch.zeros(2, 16, dtype=torch.bool)]
    masks[0][0, 9:] = True  # rows with different prompt lengths: the earliest response decides
    masks[0][1, 7:15] = True
    masks[0][2, 12:] = True
    masks[1][:, 5:] = True
    return ids, masks


def test_first_loss_position() -> None:
    _, masks = _batches()
    assert [first_loss_position(m) for m in masks] == [7, 5]
    assert first_loss_position(torch.zeros(2, 4, dtype=torch.bool)) == 0  # nothing read: nothing cut


def test_cut_logits_equal_the_full_projection(policy: MegatronPolicy) -> None:
    assert policy.cuts_logits and output_layer(policy.model) is not None
    ids, masks = _batches()
    starts = [first_loss_position(m) for m in masks]
    full = policy.score_microbatches(ids)
    cut = policy.score_microbatches(ids, starts=starts)
    assert full is not None and cut is not None
    for f, c, start in zip(full, cut, starts, strict=True):
        assert f.shape == c.shape
        assert torch.equal(c[:, :start], torch.zeros_like(c[:, :start]))
        torch.testing.assert_close(c[:, start:], f[:, start:], rtol=1e-5, atol=1e-6)
        assert not torch.equal(f[:, :start], c[:, :start]), "the full pass computes the prompt positions"
    # the logits really are cut: [rows, width - start, vocab]
    with from_position(policy.model, 5):
        assert policy.logits(ids[1]).shape == (2, 12, 512)
    assert policy.logits(ids[1]).shape == (2, 17, 512)  # and the cut ends with the block
    with pytest.raises(ValueError, match="needs next-token scoring"):
        policy.score_microbatches(ids, labels=[i[:, 1:] for i in ids], starts=starts)


def _grads(policy: MegatronPolicy, ids: list[torch.Tensor], masks: list[torch.Tensor],
           starts: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    policy.model.zero_grad(set_to_none=True)
    kept: list[torch.Tensor] = []

    def hook(i: int, logits: torch.Tensor) -> torch.Tensor:
        logprobs = policy.logprobs_from_logits(logits, ids[i], start=starts[i])
        kept.append(logprobs.detach())
        return -(logprobs * masks[i]).sum() / masks[i].sum()

    run_microbatches(policy.model, ids, hook, forward_only=False, output_starts=starts)
    return kept, [p.grad.clone() for p in policy.model.parameters()]  # type: ignore[union-attr]


def test_cut_training_pass_gradients_and_reuse(policy: MegatronPolicy) -> None:
    ids, masks = _batches()
    starts = [first_loss_position(m) for m in masks]
    full_lp, full_grads = _grads(policy, ids, masks, [0, 0])
    cut_lp, cut_grads = _grads(policy, ids, masks, starts)
    for f, c, m in zip(full_lp, cut_lp, masks, strict=True):
        torch.testing.assert_close(c[m], f[m], rtol=1e-5, atol=1e-6)
    for f, c in zip(full_grads, cut_grads, strict=True):
        torch.testing.assert_close(c, f, rtol=1e-4, atol=1e-6)
    # the training forward with its graph (the first forward of an update) equals the no-grad scoring pass bit
    # for bit: its logprobs serve as the old logprobs
    graph = forward_microbatches(policy.model, ids, output_starts=starts)
    with_graph = [policy.logprobs_from_logits(out, i, start=s) for out, i, s in zip(graph, ids, starts, strict=True)]
    scored = policy.score_microbatches(ids, starts=starts)
    assert scored is not None
    assert all(torch.equal(a.detach(), b) for a, b in zip(with_graph, scored, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(cut_lp, scored, strict=True))
