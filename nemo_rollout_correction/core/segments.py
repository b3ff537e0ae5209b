"""The sequence unit `turn`: every sequence-level decision taken per policy turn instead of per trajectory.

A multi-turn trajectory is one row whose sampled tokens belong to turns `0..K-1` (observation tokens are out of
`loss_mask`). With `sequence_unit=turn`, sequence-level and geometric IS, sequence rejection, the veto and the
non-finite `reject_sequence` policy must see one turn as one sequence. Rather than teach every statistic about
segments, the rows are *expanded*: row `b` becomes `K` rows `b*K + k` holding the same logprobs and
`loss_mask & (turn == k)`. Every per-sequence partial of the correction is then a per-turn partial, unchanged
code computes it, and the outputs fold back with a sum (IS weights: 0 outside each turn's keep mask, the turns
are disjoint) or an any (masks). `K` is the configured most turns, identical on every rank, so a sequence split
over context-parallel ranks expands to the same rows everywhere and the CP reduction of per-row partials stays
correct. Turns a trajectory does not have are empty rows, which no statistic counts (no valid token).

Cost: `K` times the correction's memory and time for the expanded microbatch; the model passes are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Segments", "expand_rows", "expand_tokens", "fold_any", "fold_rows", "fold_sum", "segment_loss_mask",
           "turn_mismatch_sums"]


@dataclass(frozen=True)
class Segments:
    """The turn of every token of a microbatch (this rank's shard) and how many turns a row may have.

    ids: `[batch, seq]` int64, the turn `0..count-1` of each sampled token, -1 elsewhere (observations, prompt,
        padding). count: K, the most turns (`rollout.max_turns`), the same on every rank.
    """

    ids: Tensor
    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"Segments.count must be >= 1, got {self.count}")
        if self.ids.numel() and int(self.ids.max()) >= self.count:
            raise ValueError(f"a token of turn {int(self.ids.max())} but Segments.count={self.count} "
                             "(rollout.max_turns)")


def expand_tokens(x: Tensor, count: int) -> Tensor:
    """`[batch, seq]` -> `[batch * count, seq]`: each row repeated `count` times, consecutively."""
    return x.repeat_interleave(count, dim=0)


def expand_rows(x: Tensor, count: int) -> Tensor:
    """`[batch]` (or `[batch, seq]`) -> `[batch * count, ...]`, like `expand_tokens`."""
    return x.repeat_interleave(count, dim=0)


def segment_loss_mask(loss_mask: Tensor, segments: Segments) -> Tensor:
    """`[batch * K, seq]` bool: row `b * K + k` is `loss_mask[b] & (segments.ids[b] == k)`."""
    turns = torch.arange(segments.count, device=segments.ids.device)
    per_turn = loss_mask.bool()[:, None, :] & (segments.ids[:, None, :] == turns[None, :, None])
    return per_turn.reshape(-1, loss_mask.shape[-1])


def fold_sum(x: Tensor, count: int) -> Tensor:
    """`[batch * K, ...]` -> `[batch, ...]`: the sum over each row's turns (disjoint supports)."""
    return x.reshape(-1, count, *x.shape[1:]).sum(dim=1)


def fold_any(x: Tensor, count: int) -> Tensor:
    """`[batch * K, seq]` bool -> `[batch, seq]`: a token is set if it is set in its turn's row."""
    return x.reshape(-1, count, *x.shape[1:]).any(dim=1)


def fold_rows(x: Tensor, count: int) -> Tensor:
    """`[batch * K]` -> `[batch]` per-row totals (e.g. kept tokens of a trajectory = the sum over its turns)."""
    return fold_sum(x, count)


def turn_mismatch_sums(reference_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor, turn_ids: Tensor,
                       count: int) -> dict[str, float]:
    """Per turn `k < count`: the mismatch partial sums behind `rollout_corr/turn_<k>/*` (summed over microbatches
    and ranks by the caller, then divided by `turn_<k>/num_tokens`).

    reference_logprobs: `[batch, seq]` the trainer's pi_old; rollout_logprobs: `[batch, seq]` the engine's;
    loss_mask: `[batch, seq]` sampled tokens; turn_ids: `[batch, seq]` the turn of each token.
    Keys `turn_<k>/num_tokens`, `turn_<k>/sum_k3` (k3 = rho - 1 - log rho) and `turn_<k>/sum_abs_log_ratio`, for
    every k (zeros for turns without tokens), so every rank sends the same keys. Non-finite log-ratios are left out
    (they are counted by the correction's non-finite metrics).
    """
    log_ratio = (reference_logprobs.detach().double() - rollout_logprobs.detach().double()).clamp(-20, 20)
    finite = loss_mask.bool() & torch.isfinite(log_ratio)
    safe = torch.where(finite, log_ratio, 0.0)
    k3 = (torch.expm1(safe) - safe).clamp(min=0.0)
    out: dict[str, float] = {}
    for k in range(count):
        in_turn = finite & (turn_ids == k)
        out[f"turn_{k}/num_tokens"] = float(in_turn.sum())
        out[f"turn_{k}/sum_k3"] = float(torch.where(in_turn, k3, 0.0).sum())
        out[f"turn_{k}/sum_abs_log_ratio"] = float(torch.where(in_turn, safe.abs(), 0.0).sum())
    return out
