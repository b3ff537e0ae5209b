"""Reduce a per-token loss to the scalar that is back-propagated.

The reduction contract (docs/design.md): ``core`` never divides by a count it did not receive. Every mode
that divides takes its denominator as an argument: the number of kept tokens, or of sequences with
at least one kept token, counted over *all* microbatches of the optimizer step across dp x cp. With
that global denominator, summing the microbatch losses gives the full-batch loss and gradient, so
gradient accumulation, data parallelism and context parallelism do not change the update.

When a denominator is left as ``None`` the local count of this call is used, which is only right
for a single process that sees the whole batch in one call.

Masked positions may hold NaN/inf (padding, rejected tokens, non-finite rollout logprobs); they are
removed with ``torch.where`` so they reach neither the loss nor its gradient. A zero denominator
(empty or all-rejected batch) gives a loss of exactly 0.0 with a zero gradient (DESIGN decision 5).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

__all__ = [
    "LOSS_AGG_MODES",
    "LossAggMode",
    "aggregate_loss",
    "count_for_denominator",
    "masked_sum",
    "safe_divide",
]

LossAggMode = Literal[
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)

# Modes whose denominator counts tokens; the others count sequences.
_TOKEN_MODES = ("token-mean", "token-sum")

Count = int | float | Tensor


def aggregate_loss(
    per_token_loss: Tensor,
    mask: Tensor,
    mode: LossAggMode,
    *,
    num_global_tokens: Count | None = None,
    num_global_seqs: Count | None = None,
    norm_length: int | float | None = None,
) -> Tensor:
    """Reduce ``per_token_loss`` over the kept tokens of ``mask`` to a scalar.

    Args:
        per_token_loss: ``[batch, seq]`` loss per token; masked positions may be non-finite.
        mask: ``[batch, seq]`` keep mask (bool, or 0/1 of any dtype).
        mode: one of ``LOSS_AGG_MODES``:
            ``token-mean``: sum of kept token losses / ``num_global_tokens``.
            ``token-sum``: sum of kept token losses (no denominator).
            ``seq-mean-token-sum``: sum over sequences of the per-sequence token sum / ``num_global_seqs``.
            ``seq-mean-token-mean``: sum over sequences of the per-sequence token mean /
            ``num_global_seqs``; a sequence without kept tokens contributes nothing.
            ``seq-mean-token-sum-norm``: ``seq-mean-token-sum / norm_length`` (Dr. GRPO's constant
            length normaliser), as verl 0.9.1's mode of the same name.
        num_global_tokens: kept-token count over the whole step (all microbatches, dp x cp); scalar
            int/float or 0-dim/1-element tensor. ``None``: the local count.
        num_global_seqs: count of sequences with >= 1 kept token over the whole step; ``None``: local.
        norm_length: constant length for ``seq-mean-token-sum-norm``; defaults to ``mask.shape[-1]``.
            Pass it explicitly (e.g. the maximum response length) when microbatches are padded to
            different lengths, otherwise the split changes the loss.

    Returns:
        A 0-dim tensor in ``per_token_loss``'s dtype; 0.0 with zero gradient when the denominator is 0.

    Under context parallelism ``seq-mean-token-mean`` needs each sequence's token count over the cp
    group; this function uses the local one, so a cp caller should reduce per-sequence sums itself.
    """
    _check_mode(mode)
    keep = _as_bool_mask(mask, per_token_loss, "per_token_loss")
    kept_loss = torch.where(keep, per_token_loss, torch.zeros_like(per_token_loss))

    if mode == "token-sum":
        return kept_loss.sum()
    if mode == "token-mean":
        denominator = _denominator(num_global_tokens, keep.sum(), per_token_loss, "num_global_tokens")
        return safe_divide(kept_loss.sum(), denominator)

    seq_loss = kept_loss.sum(dim=-1)  # [batch]
    num_seq_tokens = keep.sum(dim=-1)  # [batch]
    if mode == "seq-mean-token-mean":
        seq_loss = safe_divide(seq_loss, num_seq_tokens.to(seq_loss.dtype))
    local_num_seqs = (num_seq_tokens > 0).sum()
    denominator = _denominator(num_global_seqs, local_num_seqs, per_token_loss, "num_global_seqs")
    loss = safe_divide(seq_loss.sum(), denominator)
    if mode == "seq-mean-token-sum-norm":
        loss = loss / _norm_length(norm_length, keep)
    return loss


def count_for_denominator(mask: Tensor, mode: LossAggMode) -> Tensor:
    """Local count that the caller sums over microbatches and all-reduces over dp x cp.

    Args:
        mask: ``[batch, seq]`` keep mask (after rejection, so rejected tokens leave the denominator).
        mode: the aggregation mode the count is for.

    Returns:
        0-dim int64 tensor: kept tokens for token modes, sequences with >= 1 kept token for seq modes.
        Under context parallelism a sequence is split over cp ranks, so for seq modes count each
        sequence on one cp rank only (or reduce per-sequence token counts first).
    """
    _check_mode(mode)
    keep = mask if mask.dtype == torch.bool else mask != 0
    if keep.dim() != 2:
        raise ValueError(f"mask must be [batch, seq], got shape {tuple(mask.shape)}")
    if mode in _TOKEN_MODES:
        return keep.sum()
    return (keep.sum(dim=-1) > 0).sum()


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is true; masked entries (even NaN/inf) add exactly 0.

    Args:
        values: any shape, broadcastable with ``mask``.
        mask: bool tensor.
        dim: reduce over this dim, or over everything when ``None``.
    """
    kept = torch.where(mask, values, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def safe_divide(numerator: Tensor, denominator: Tensor) -> Tensor:
    """``numerator / denominator`` where the denominator is positive, else 0.0 with zero gradient.

    The inner ``where`` keeps the division itself finite: a 0/0 in the untaken branch of the outer
    ``where`` would still send NaN into the backward pass.
    """
    positive = denominator > 0
    safe_denominator = torch.where(positive, denominator, torch.ones_like(denominator))
    return torch.where(positive, numerator / safe_denominator, torch.zeros_like(numerator))


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}")


def _as_bool_mask(mask: Tensor, values: Tensor, values_name: str) -> Tensor:
    if values.dim() != 2:
        raise ValueError(f"{values_name} must be [batch, seq], got shape {tuple(values.shape)}")
    if mask.shape != values.shape:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} does not match {values_name} shape {tuple(values.shape)}"
        )
    return mask if mask.dtype == torch.bool else mask != 0


def _denominator(count: Count | None, local_count: Tensor, like: Tensor, name: str) -> Tensor:
    """The denominator as a detached 0-dim tensor in ``like``'s dtype and device."""
    if count is None:
        return local_count.to(dtype=like.dtype)
    if isinstance(count, Tensor):
        if count.numel() != 1:
            raise ValueError(f"{name} must hold a single count, got shape {tuple(count.shape)}")
        # No value check here: reading a device tensor would force a host sync in the hot path.
        return count.detach().reshape(()).to(dtype=like.dtype, device=like.device)
    if count < 0:
        raise ValueError(f"{name} must be >= 0, got {count}")
    return torch.tensor(count, dtype=like.dtype, device=like.device)


def _norm_length(norm_length: int | float | None, keep: Tensor) -> float:
    if norm_length is None:
        # A [batch, 0] mask has no tokens; any positive length leaves the 0.0 loss unchanged.
        return float(max(keep.shape[-1], 1))
    if not norm_length > 0:
        raise ValueError(f"norm_length must be > 0, got {norm_length}")
    return float(norm_length)
