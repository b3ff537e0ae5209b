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


def validate_advantages(advantages: Tensor | None, like: Tensor, required: bool) -> Tensor | None:
    """`advantages` as detached float32 `[batch, seq]` (a `[batch]` vector is broadcast), or None.

    Raises ValueError when `required` and missing, or for a shape that is neither `[batch]` nor
    `like`'s `[batch, seq]`. Not required: ignored (None), so callers may always pass them.
    """
    if advantages is None:
        if required:
            raise ValueError("this rollout-correction config masks by advantage (opsm_threshold or "
                             "dppo_tv_threshold is set): pass advantages= ([batch] or [batch, seq])")
        return None
    if not required:
        return None
    if not isinstance(advantages, Tensor):
        raise ValueError(f"advantages must be a torch.Tensor, got {type(advantages).__name__}")
    if advantages.dim() == 1 and advantages.shape[0] == like.shape[0]:
        advantages = advantages.unsqueeze(-1).expand(like.shape)
    if advantages.shape != like.shape:
        raise ValueError(f"advantages must be [batch] ({like.shape[0]}) or [batch, seq] {tuple(like.shape)}, "
                         f"got shape {tuple(advantages.shape)}")
    if advantages.device != like.device:
        raise ValueError(f"advantages are on {advantages.device}, the logprobs on {like.device}")
    return advantages.detach().float()


class TokenChunk:
    """Token-level views of one row chunk `[rows, seq]`, computed lazily and at most once.

    `log_ratio` = old_logprobs - rollout_logprobs on valid tokens and 0 elsewhere; `clamped`
    is that clamped to +-LOG_RATIO_BOUND; `ratio` = exp(clamped) (exactly 1 on invalid tokens).

    Masking uses float 0/1 multiplications, which are several times cheaper than boolean
    `torch.where` on CPU. That is only safe when every value is finite (NaN * 0 = NaN), so a
    chunk whose log-ratios do not all sum to a finite number takes the exact `torch.where`
    path instead (docs/design.md decision 4).
    """

    def __init__(self, old_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor,
                 advantages: Tensor | None = None) -> None:
        self.loss = loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0
        self.advantages = advantages
        """`[rows, seq]` float32 advantages of the chunk (None when the caller gave none)."""
        self.numel = self.loss.numel()
        self.cache: dict[str, Tensor] = {}
        """Config-dependent token tensors shared by the two phases of one chunk."""
        old, rollout = old_logprobs.float(), rollout_logprobs.float()
        raw = old - rollout
        # One cheap reduction decides the path: any NaN/inf anywhere makes the sum non-finite.
        self.all_finite = bool(torch.isfinite(raw.sum()))
        if self.all_finite:
            self.valid = self.loss
            self.valid_f = self.loss.float()
            self.nonfinite: Tensor | None = None
            self.log_ratio = raw.mul_(self.valid_f)
            # A row dot product masks without materialising rollout * mask.
            self.row_sum_rollout = torch.linalg.vecdot(rollout, self.valid_f)
            self._rollout = rollout
        else:
            finite = torch.isfinite(raw)
            self.valid = self.loss & finite
            self.valid_f = self.valid.float()
            self.nonfinite = self.loss & ~finite
            self.log_ratio = torch.where(self.valid, raw, 0.0)
            self._rollout = torch.where(self.valid, rollout, 0.0)
            self.row_sum_rollout = self._rollout.sum(dim=-1)

    def write_rollout_logprobs(self, out: Tensor) -> Tensor:
        """Write the float32 rollout logprobs, 0 on invalid tokens, into `out` (`[rows, seq]`); return it."""
        if self.all_finite:
            return torch.mul(self._rollout, self.valid_f, out=out)
        return out.copy_(self._rollout)

    @cached_property
    def rollout_logprobs(self) -> Tensor:
        """float32 rollout logprobs on valid tokens, 0 elsewhere (log-prob 0 = probability 1)."""
        if self.all_finite:
            return self._rollout * self.valid_f
        return self._rollout

    @cached_property
    def train_logprobs(self) -> Tensor:
        """float32 trainer logprobs (old_logprobs) on valid tokens, 0 elsewhere: rollout + log-ratio."""
        return self.rollout_logprobs + self.log_ratio

    @cached_property
    def rollout_prob(self) -> Tensor:
        """pi_rollout of the sampled token, exp(rollout_logprobs); 1 on invalid tokens."""
        return torch.exp(self.rollout_logprobs)

    @cached_property
    def train_prob(self) -> Tensor:
        """pi_train of the sampled token, exp(old_logprobs); 1 on invalid tokens."""
        return torch.exp(self.train_logprobs)

    @cached_property
    def num_invalid(self) -> int:
        """Positions of the chunk that are not valid tokens."""
        return self.numel - int(self.valid_f.sum())

    @cached_property
    def log_ratio_extremes(self) -> tuple[float, float]:
        """(min, max) of log_ratio over the whole chunk, invalid zeros included."""
        if self.numel == 0:
            return 0.0, 0.0
        low, high = torch.aminmax(self.log_ratio)
        return float(low), float(high)

    @cached_property
    def clamped(self) -> Tensor:
        """log rho clamped to +-LOG_RATIO_BOUND (0 on invalid tokens).

        The same tensor as log_ratio when nothing needs clamping (the normal case): no copy.
        """
        low, high = self.log_ratio_extremes
        if low >= -LOG_RATIO_BOUND and high <= LOG_RATIO_BOUND:
            return self.log_ratio
        return self.log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)

    @cached_property
    def expm1(self) -> Tensor:
        """rho - 1 = expm1(clamped), accurate for the tiny mismatches of a healthy run (0 on invalid)."""
        return torch.expm1(self.clamped)

    @cached_property
    def ratio(self) -> Tensor:
        """rho = exp(clamped log rho); exactly 1 on invalid tokens.

        A direct exp, not expm1 + 1: that sum rounds ratios below ~e^-17 to 0 in float32.
        """
        return torch.exp(self.clamped)

    @cached_property
    def pad(self) -> Tensor:
        """0 on valid tokens and -1e4 elsewhere: `x + pad` / `x - pad` hide invalid tokens from max / min."""
        return (self.valid_f - 1.0).mul_(1e4)

    @cached_property
    def k2(self) -> Tensor:
        """k2 = (log rho)^2 / 2 per token (0 on invalid tokens)."""
        return self.clamped.square().mul_(0.5)

    @cached_property
    def k3(self) -> Tensor:
        """k3 = rho - 1 - log rho per token (0 on invalid tokens); >= 0."""
        return self.expm1 - self.clamped

    def row_sum_k3(self) -> Tensor:
        """Per-row sums of k3 `[rows]`, without keeping the k3 tensor unless something else needs it."""
        k3 = self.__dict__.get("k3")
        if k3 is None:
            k3 = self.expm1 - self.clamped  # a transient temporary, freed on return
        return k3.sum(dim=-1)
