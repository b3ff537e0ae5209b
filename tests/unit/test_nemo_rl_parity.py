"""Exact NeMo-RL parity of the adapter (issue 14, item 6), by hand-derived expectations.

NeMo-RL's ClippedPGLoss (nemo_rl/algorithms/loss/loss_functions.py, commit 7ea279a) with an IcePop
token mask multiplies the importance weights by the kept mask and leaves `token_mask` untouched:

    TOKEN_LEVEL:    sum_{i,t} m_it w_it c_it / global_valid_toks
    SEQUENCE_LEVEL: sum_i s_i (sum_t m_it w_it c_it / sum_t m_it) / global_valid_seqs

with m = token_mask, s = sample_mask, w = exp(prev - gen) inside the bounds and 0 outside, and
c = -min(r A, clip(r, 1 - eps, 1 + eps) A), r = exp(curr - prev). The expectations below are
written from that formula alone (plus NeMo-RL's `+ 1e-8` in masked_mean), not from our code.
Also: NeMo-RL's split train path (placeholder global_valid_* = 1, gradient divided by its own N
after the step) with set_step_denominators normalises exactly once.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.policy_loss import PolicyLossConfig
from nemo_rollout_correction.distributed import ParallelGroups
from nemo_rollout_correction.losses import NeMoRLRolloutCorrectedLoss, StepDenominators

ROWS, COLS, VOCAB = 4, 6, 7
LOW, HIGH, EPS = 0.8, 1.25, 0.2


def nemo_data(seed: int = 0) -> tuple[dict[str, Tensor], Tensor]:
    """A NeMo-RL microbatch `[ROWS, COLS + 1]` (leading prompt position) and logits `[ROWS, COLS + 1, VOCAB]`."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, COLS + 1, VOCAB, generator=gen)
    ids = torch.randint(0, VOCAB, (ROWS, COLS + 1), generator=gen)
    curr = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    prev = curr + 0.05 * torch.randn(ROWS, COLS, generator=gen)
    gen_lp = prev + 0.25 * torch.randn(ROWS, COLS, generator=gen)  # wide enough that IcePop rejects some
    token_mask = (torch.arange(COLS) < torch.tensor([[6], [4], [5], [3]])).float()
    pad = torch.zeros(ROWS, 1)
    data = {
        "input_ids": ids,
        "generation_logprobs": torch.cat([pad, gen_lp], 1),
        "prev_logprobs": torch.cat([pad, prev], 1),
        "advantages": torch.tensor([1.0, -0.5, 0.8, -1.2])[:, None].expand(ROWS, COLS + 1).contiguous(),
        "token_mask": torch.cat([pad, token_mask], 1),
        "sample_mask": torch.tensor([1.0, 1.0, 1.0, 0.0]),  # the last sample is filtered out
    }
    return data, logits


def nemo_rl_expected(data: dict[str, Tensor], logits: Tensor, level: str, global_valid: float) -> Tensor:
    """NeMo-RL's loss (see the module doc), differentiable in `logits`."""
    ids = data["input_ids"][:, 1:]
    curr = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[..., None]).squeeze(-1)
    prev, gen_lp = data["prev_logprobs"][:, 1:], data["generation_logprobs"][:, 1:]
    adv, m, s = data["advantages"][:, 1:], data["token_mask"][:, 1:], data["sample_mask"]
    w = torch.exp(prev - gen_lp)
    w = w * ((w >= LOW) & (w <= HIGH))
    r = torch.exp(curr - prev)
    c = -torch.minimum(r * adv, r.clamp(1 - EPS, 1 + EPS) * adv)
    if level == "token":
        return (w * c * m * s[:, None]).sum() / (global_valid + 1e-8)
    per_seq = (w * c * m).sum(-1) / (m.sum(-1) + 1e-8)
    return (per_seq * s).sum() / (global_valid + 1e-8)


def icepop(**fields: object) -> RolloutCorrectionConfig:
    return RolloutCorrectionConfig(rollout_is="token", rollout_is_mode="mask", rollout_is_threshold=HIGH,
                                   rollout_is_threshold_lower=LOW, rollout_token_veto_threshold=None,
                                   rejected_tokens_in_denominator=True, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("mode", "level"), [("seq-mean-token-mean", "seq"), ("token-mean", "token")])
def test_rejected_tokens_in_denominator_reproduces_nemo_rl(mode: str, level: str) -> None:
    data, logits = nemo_data()
    m = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    global_valid = float(m.sum()) if level == "token" else float(data["sample_mask"].sum())
    want_logits = logits.clone().requires_grad_(True)
    want = nemo_rl_expected(data, want_logits, level, global_valid)
    (want_grad,) = torch.autograd.grad(want, want_logits)

    adapter = NeMoRLRolloutCorrectedLoss(icepop(), PolicyLossConfig(loss_agg_mode=mode))  # type: ignore[arg-type]
    got_logits = logits.clone().requires_grad_(True)
    got, _ = adapter(data=data, global_valid_seqs=float(data["sample_mask"].sum()), global_valid_toks=float(m.sum()),
                     logits=got_logits)
    (got_grad,) = torch.autograd.grad(got, got_logits)
    kept = adapter.step_losses[0].correction.keep_mask
    assert (m.bool() & ~kept).any()  # IcePop rejected tokens: the case tells the two conventions apart
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-8)

    if level == "seq":  # dividing each sequence by its kept tokens (our own convention) would differ
        ours = NeMoRLRolloutCorrectedLoss(icepop(), PolicyLossConfig(loss_agg_mode=mode))  # type: ignore[arg-type]
        ours.loss.rc_cfg = RolloutCorrectionConfig.from_dict({**icepop().to_dict(),
                                                              "rejected_tokens_in_denominator": False})
        other, _ = ours(data=data, global_valid_seqs=float(data["sample_mask"].sum()), global_valid_toks=1.0,
                        logits=logits)
        assert abs(float(other.detach()) - float(want.detach())) > 1e-4


def _microbatches() -> list[tuple[dict[str, Tensor], Tensor]]:
    return [nemo_data(1), nemo_data(2)]


def _our_denominators(adapter: NeMoRLRolloutCorrectedLoss, mbs: list[tuple[dict[str, Tensor], Tensor]]
                      ) -> StepDenominators:
    single = ParallelGroups.single()
    corrections = []
    for data, _ in mbs:
        mask = (data["token_mask"][:, 1:] != 0) & (data["sample_mask"][:, None] != 0)
        corrections.append(adapter.loss.correct(data["prev_logprobs"][:, 1:], data["generation_logprobs"][:, 1:],
                                                mask, single))
    return StepDenominators.from_step(adapter.loss.prepare_step(corrections, single))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_split_train_path_with_step_denominators_normalises_once(mode: str) -> None:
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_mode="mask", rollout_is_threshold=HIGH,
                                  rollout_is_threshold_lower=LOW, rollout_token_veto_threshold=None)
    loss_cfg = PolicyLossConfig(loss_agg_mode=mode)  # type: ignore[arg-type]
    mbs = _microbatches()
    # NeMo-RL's own global counts of the step (what its split path divides the gradient by).
    n_toks = sum(float((d["token_mask"][:, 1:] * d["sample_mask"][:, None]).sum()) for d, _ in mbs)
    n_seqs = sum(float(d["sample_mask"].sum()) for d, _ in mbs)
    worker = StepDenominators(num_global_tokens=n_toks, num_global_seqs=n_seqs)
    n_worker = n_toks if mode == "token-mean" else n_seqs

    # Sync path: NeMo-RL passes the true counts; our override replaces them.
    sync = NeMoRLRolloutCorrectedLoss(cfg, loss_cfg)
    ours = _our_denominators(sync, mbs)
    n_ours = ours.num_global_tokens if mode == "token-mean" else ours.num_global_seqs
    assert n_ours <= n_worker and (mode != "token-mean" or n_ours < n_worker)  # rejection removed tokens
    sync.set_step_denominators(ours)
    leaves = [logits.clone().requires_grad_(True) for _, logits in mbs]
    total = sum(sync(data=d, global_valid_seqs=n_seqs, global_valid_toks=n_toks, logits=x)[0]
                for (d, _), x in zip(mbs, leaves, strict=True))
    sync_grads = torch.autograd.grad(total, leaves)

    # Split path: placeholders 1, then the worker scales the accumulated gradient by 1 / N_worker.
    split = NeMoRLRolloutCorrectedLoss(cfg, loss_cfg, split_train_path=True)
    with pytest.raises(ValueError, match="worker_denominators"):
        split.set_step_denominators(ours)
    split.set_step_denominators(ours, worker_denominators=worker)
    leaves = [logits.clone().requires_grad_(True) for _, logits in mbs]
    raw = sum(split(data=d, global_valid_seqs=torch.tensor(1.0), global_valid_toks=torch.tensor(1.0), logits=x)[0]
              for (d, _), x in zip(mbs, leaves, strict=True))
    split_grads = [g / n_worker for g in torch.autograd.grad(raw, leaves)]
    for a, b in zip(split_grads, sync_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(raw.detach() / n_worker, total.detach(), rtol=1e-6, atol=1e-8)

    # Without the flag, a placeholder call under an override would divide twice: it raises instead.
    wrong = NeMoRLRolloutCorrectedLoss(cfg, loss_cfg)
    wrong.set_step_denominators(ours)
    with pytest.raises(ValueError, match="split_train_path=True"):
        wrong(data=mbs[0][0], global_valid_seqs=1.0, global_valid_toks=1.0, logits=mbs[0][1])


def test_vocabulary_shard_without_tp_group_raises() -> None:
    data, logits = nemo_data()
    adapter = NeMoRLRolloutCorrectedLoss(RolloutCorrectionConfig(), vocab_size=VOCAB + 5)
    with pytest.raises(ValueError, match="groups="):
        adapter(data=data, global_valid_seqs=1.0, global_valid_toks=1.0, logits=logits)
