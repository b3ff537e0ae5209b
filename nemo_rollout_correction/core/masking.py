"""Input checks and the per-chunk token view: which tokens are valid, and their log-ratios.

A token is *valid* when it is a loss token and both logprobs are finite. Invalid positions
get a log-ratio of exactly 0 through `torch.where` (never `x * mask`: NaN * 0 is NaN), so every
later sum over a chunk can ignore the mask for additive terms that vanish at 0.
"""

from __future__ import annotations

from functools import cached_property

import torch
from torch import Tensor

LOG_RATIO_BOUND = 20.0
"""Log-ratios are clamped to +-20 before exp: exp(20) ~ 4.9e8 caps instead of overflowing."""


def validate_inputs(old_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor) -> None:
    """Raise ValueError for inputs that cannot be corrected (shape, dtype or device mismatch).

    old_logprobs, rollout_logprobs: `[batch, seq]` floating point, same dtype.
    loss_mask: `[batch, seq]` bool, integer or floating (non-zero = loss token).
    """
    for name, tensor in (("old_logprobs", old_logprobs), ("rollout_logprobs", rollout_logprobs),
                         ("loss_mask", loss_mask)):
        if not isinstance(tensor, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 2:
            raise ValueError(f"{name} must be 2-D [batch, seq], got shape {tuple(tensor.shape)}")
    if old_logprobs.shape != rollout_logprobs.shape or old_logprobs.shape != loss_mask.shape:
        raise ValueError(
            "shape mismatch: old_logprobs "
            f"{tuple(old_logprobs.shape)}, rollout_logprobs {tuple(rollout_logprobs.shape)}, "
            f"loss_mask {tuple(loss_mask.shape)} must all be the same [batch, seq]"
        )
    for name, tensor in (("old_logprobs", old_logprobs), ("rollout_logprobs", rollout_logprobs)):
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
    if old_logprobs.dtype != rollout_logprobs.dtype:
        raise ValueError(
            f"dtype mismatch: old_logprobs is {old_logprobs.dtype} but rollout_logprobs is "
            f"{rollout_logprobs.dtype}; cast both to torch.float32 (the comparison is done in fp32)"
        )
    if loss_mask.dtype.is_complex:
        raise ValueError(f"loss_mask must be bool, integer or floating, got {loss_mask.dtype}")
    devices = {old_logprobs.device, rollout_logprobs.device, loss_mask.device}
    if len(devices) != 1:
        raise ValueError(f"old_logprobs, rollout_logprobs and loss_mask must be on one device, got {devices}")


class TokenChunk:
    """Token-level views of rows `[start, stop)`, computed lazily and at most once.

    Shapes are `[rows, seq]`. `log_ratio` = old_logprobs - rollout_logprobs on valid tokens
    and 0 elsewhere; `clamped` is the same clamped to +-LOG_RATIO_BOUND; `ratio` = exp(clamped).
    """

    def __init__(self, old_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor) -> None:
        self.old = old_logprobs.float()
        self.rollout = rollout_logprobs.float()
        self.loss = loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0
        self.cache: dict[str, Tensor] = {}
        """Config-dependent token tensors shared by the two phases of one chunk."""

    @cached_property
    def finite(self) -> Tensor:
        """Both logprobs finite, `[rows, seq]` bool."""
        return torch.isfinite(self.old) & torch.isfinite(self.rollout)

    @cached_property
    def valid(self) -> Tensor:
        """Loss token with finite logprobs, `[rows, seq]` bool."""
        return self.loss & self.finite

    @cached_property
    def nonfinite(self) -> Tensor:
        """Loss token with a NaN/inf logprob, `[rows, seq]` bool."""
        return self.loss & ~self.finite

    @cached_property
    def old_valid(self) -> Tensor:
        """old_logprobs on valid tokens, 0 elsewhere."""
        return torch.where(self.valid, self.old, 0.0)

    @cached_property
    def rollout_valid(self) -> Tensor:
        """rollout_logprobs on valid tokens, 0 elsewhere."""
        return torch.where(self.valid, self.rollout, 0.0)

    @cached_property
    def log_ratio(self) -> Tensor:
        """log rho = old - rollout on valid tokens, 0 elsewhere."""
        return self.old_valid - self.rollout_valid

    @cached_property
    def clamped(self) -> Tensor:
        """log rho clamped to +-LOG_RATIO_BOUND."""
        return self.log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)

    @cached_property
    def ratio(self) -> Tensor:
        """rho = exp(clamped log rho); exactly 1 on invalid tokens."""
        return torch.exp(self.clamped)

    @cached_property
    def k2(self) -> Tensor:
        """k2 = (log rho)^2 / 2 per token (0 on invalid tokens)."""
        return self.clamped.square().mul_(0.5)

    @cached_property
    def k3(self) -> Tensor:
        """k3 = rho - 1 - log rho per token (0 on invalid tokens); >= 0."""
        return (self.ratio - 1.0).sub_(self.clamped)
