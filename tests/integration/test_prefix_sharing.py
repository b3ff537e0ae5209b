"""Packed rows with a shared prefix (`models.packing`, `models.prefix_sharing`, `policy.prefix_sharing`) against the
plain packed and the padded forward, on a real Megatron GPTModel.

One-process gloo, a tiny random Llama with grouped-query attention and the CPU layer spec. A microbatch of GRPO
shape, shuffled: three groups of rows that begin with the same prompt (one group also shares its first response
tokens), suffixes of uneven lengths, and a lone row; random padding after every row. The shared pack's logprobs
and the gradients of a loss with per-row sequence sums equal the plain pack's and the padded forward's (fp32
rounding); a changed suffix token changes only its own row (no suffix sees another); suffix positions continue
after the prefix (a pack whose suffixes restart at position 0, or attend to each other, gives other logprobs).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from default_lane import require
from packed_grads import sequence_loss_grads

require("megatron.core", "megatron")

from nemo_rollout_correction.models.packing import PackedRows, shared_prefix_groups
from nemo_rollout_correction.models.policy import MegatronPolicy
from nemo_rollout_correction.models.schedule import forward_microbatches
from nemo_rollout_correction.trainer.policy_update import row_loss_starts, shares_prefixes

pytestmark = [pytest.mark.integration]

# rows (shuffled on purpose): prompt A (rows 0, 3, 5; 20 tokens), B (rows 1, 4; 13 tokens), C (rows 2, 6; 9 tokens,
# rows 2 and 6 also share their first 4 response tokens), and row 7 alone
PROMPTS = {0: "A", 3: "A", 5: "A", 1: "B", 4: "B", 2: "C", 6: "C", 7: "D"}
PROMPT_LEN = {"A": 20, "B": 13, "C": 9, "D": 11}
LENGTHS = torch.tensor([31, 14, 25, 22, 40, 38, 17, 19])


def _rows(seed: int = 5) -> torch.Tensor:
    """`[8, 40]` tokens: each row its prompt, then random response tokens, then random padding."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, (len(LENGTHS), int(LENGTHS.max())), generator=gen)
    prompts = {name: torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(100 + n))
               for name, n in PROMPT_LEN.items()}
    for row, name in PROMPTS.items():
        ids[row, :PROMPT_LEN[name]] = prompts[name]
    ids[6, 9:13] = ids[2, 9:13]  # a shared response start: the prefix reaches past the prompt
    ids[7, 0] = ids[0, 0] + 1  # the lone row shares nothing
    return ids


def _mask(width: int) -> torch.Tensor:
    """`[rows, width - 1]`: each row's response positions (its loss)."""
    cols = torch.arange(width - 1)[None, :]
    prompt = torch.tensor([PROMPT_LEN[PROMPTS[r]] for r in range(len(LENGTHS))])
    return (cols >= (prompt - 1)[:, None]) & (cols < (LENGTHS - 1)[:, None])


@pytest.fixture(scope="module")
def policy(tiny_tied_policy: MegatronPolicy) -> MegatronPolicy:
    assert tiny_tied_policy.shares_prefixes, tiny_tied_policy.prefix_sharing_unsupported
    return tiny_tied_policy


def test_groups_and_layout() -> None:
    ids = _rows()
    groups = shared_prefix_groups(ids, LENGTHS)
    assert groups == [(20, [0, 3, 5]), (13, [1, 4]), (13, [2, 6]), (0, [7])]
    packed = PackedRows.of(ids, LENGTHS, row_loss_starts(_mask(40)), share_prefixes=True)
    assert packed.shares_prefixes and packed.groups is not None
    assert packed.total == int(LENGTHS.sum()) - 2 * 20 - 13 - 13  # each prefix once
    assert packed.cu_seqlens.tolist() == [0, 20 + 11 + 2 + 18, 51 + 13 + 1 + 27, 92 + 13 + 12 + 4, 121 + 19]
    assert packed.groups[0] == (20, (11, 2, 18))
    # group A: prefix positions 0..19, then each suffix continues at 20
    assert packed.position_ids[0, :23].tolist() == [*range(20), 20, 21, 22]
    assert packed.position_ids[0, 31:34].tolist() == [20, 21, 20]
    assert torch.equal(packed.input_ids[0, 31:33], ids[3, 20:22])
    # one logit per read column, as unshared; the prefix's last position feeds every row of group A
    plain = PackedRows.of(ids, LENGTHS, row_loss_starts(_mask(40)))
    assert torch.equal(packed.target_rows, plain.target_rows) and torch.equal(packed.labels, plain.labels)
    assert (packed.logit_index == 19).sum() == 3
    # no shared prefix (or sharing off): the plain layout
    alone = PackedRows.of(ids[[0, 1, 7]], LENGTHS[[0, 1, 7]], share_prefixes=True)
    assert alone.groups is None and alone.cu_seqlens.tolist() == [0, 31, 45, 64]


def test_every_row_keeps_a_token() -> None:
    ids = _rows()
    ids[1, :14] = ids[4, :14]  # row 1 (14 tokens) is the start of row 4 (40 tokens)
    assert shared_prefix_groups(ids, LENGTHS)[1] == (13, [1, 4])


def test_shared_logprobs_equal_plain_and_padded(policy: MegatronPolicy) -> None:
    ids = _rows()
    mask = _mask(40)
    real = torch.arange(39)[None, :] < (LENGTHS - 1)[:, None]
    padded = policy.score_microbatches([ids])
    plain = policy.score_microbatches([ids], packed=[PackedRows.of(ids, LENGTHS)])
    shared = policy.score_microbatches([ids], packed=[PackedRows.of(ids, LENGTHS, share_prefixes=True)])
    assert padded is not None and plain is not None and shared is not None
    torch.testing.assert_close(shared[0][real], plain[0][real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared[0][real], padded[0][real], rtol=1e-5, atol=1e-5)
    assert torch.equal(shared[0][~real], torch.zeros_like(shared[0][~real]))
    starts = row_loss_starts(mask)  # the trainer's layout: logits from each row's response on
    cut = policy.score_microbatches([ids], packed=[PackedRows.of(ids, LENGTHS, starts, share_prefixes=True)])
    assert cut is not None
    torch.testing.assert_close(cut[0][mask], padded[0][mask], rtol=1e-5, atol=1e-5)


def test_no_suffix_sees_another(policy: MegatronPolicy) -> None:
    ids = _rows()
    other = ids.clone()
    other[0, 25] += 1  # a response token of row 0: group A's first suffix, rows 3 and 5 follow it in the pack
    base = policy.score_microbatches([ids], packed=[PackedRows.of(ids, LENGTHS, share_prefixes=True)])
    changed = policy.score_microbatches([other], packed=[PackedRows.of(other, LENGTHS, share_prefixes=True)])
    assert base is not None and changed is not None
    keep = torch.arange(8) != 0
    assert torch.equal(base[0][keep], changed[0][keep]), "a row's logprobs depend on another row's suffix"
    assert torch.equal(base[0][0, :24], changed[0][0, :24]) and not torch.equal(base[0][0], changed[0][0])


def test_suffix_positions_continue(policy: MegatronPolicy) -> None:
    """Positions are what the rotary reads: a pack whose suffixes restart at 0, or whose suffixes attend to each
    other (one causal segment per group), computes other logprobs than the padded forward."""
    ids = _rows()
    real = torch.arange(39)[None, :] < (LENGTHS - 1)[:, None]
    padded = policy.score_microbatches([ids])
    packed = PackedRows.of(ids, LENGTHS, share_prefixes=True)
    assert padded is not None and packed.groups is not None
    restarted = torch.cat([torch.cat([torch.arange(p), *(torch.arange(n) for n in suffixes)])
                           for p, suffixes in packed.groups])
    wrong_positions = dataclasses.replace(packed, position_ids=restarted[None, :])
    segments = packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]  # the same tokens, one causal segment per group
    flat = dataclasses.replace(packed, groups=None, max_seqlen=int(segments.max()))
    for wrong in (wrong_positions, flat):
        out = policy.score_microbatches([ids], packed=[wrong])
        assert out is not None
        assert not torch.allclose(out[0][real], padded[0][real], rtol=1e-3, atol=1e-3)


def test_shared_gradients_equal_plain_and_padded(policy: MegatronPolicy) -> None:
    ids = _rows()
    mask = _mask(40)
    starts = row_loss_starts(mask)
    pad_lp, pad_grads = sequence_loss_grads(policy, ids, None, mask)
    plain_lp, plain_grads = sequence_loss_grads(policy, ids, PackedRows.of(ids, LENGTHS, starts), mask)
    torch.testing.assert_close(plain_lp[mask], pad_lp[mask], rtol=1e-5, atol=1e-5)
    shared = PackedRows.of(ids, LENGTHS, starts, share_prefixes=True)
    shared_lp, shared_grads = sequence_loss_grads(policy, ids, shared, mask)
    torch.testing.assert_close(shared_lp[mask], pad_lp[mask], rtol=1e-5, atol=1e-5)
    assert pad_grads.keys() == shared_grads.keys() == plain_grads.keys() and pad_grads
    for name, grad in pad_grads.items():
        torch.testing.assert_close(shared_grads[name], plain_grads[name], rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # the training forward with its graph equals the no-grad scoring pass bit for bit (reused old logprobs)
    with_graph = policy.packed_logprobs(forward_microbatches(policy.model, [ids], packed=[shared])[0], shared)
    scored = policy.score_microbatches([ids], packed=[shared])
    assert scored is not None and torch.equal(with_graph.detach(), scored[0])


def test_where_it_is_not_built(policy: MegatronPolicy) -> None:
    """null resolves to off on a model that cannot run shared packs (the Transformer Engine spec); true is refused
    there naming the key and the reason; false and unpacked runs never share."""
    from nemo_rollout_correction.config.loader import from_dict
    from nemo_rollout_correction.config.schema import ConfigError

    te_like = dataclasses.replace(policy, prefix_sharing_unsupported="the core attention is TEDotProductAttention")
    default, on, off = from_dict({}), from_dict({"policy": {"prefix_sharing": True}}), \
        from_dict({"policy": {"prefix_sharing": False}})
    assert shares_prefixes(default, policy, None) and shares_prefixes(on, policy, None)
    assert not shares_prefixes(off, policy, None)
    assert not shares_prefixes(from_dict({"policy": {"sequence_packing": False}}), policy, None)
    assert not shares_prefixes(default, te_like, None) and not shares_prefixes(default, policy, te_like)
    with pytest.raises(ConfigError, match=r"policy\.prefix_sharing=true.*TEDotProductAttention"):
        shares_prefixes(on, te_like, None)
    ids = _rows()
    with pytest.raises(RuntimeError, match=r"prefix_sharing\.install"):  # a model whose decoder was not wrapped
        from nemo_rollout_correction.models import schedule

        bare = torch.nn.Linear(2, 2)
        schedule._stage_forward(bare, ids, None, packed=PackedRows.of(ids, LENGTHS, share_prefixes=True))
