"""Per-token KL(pi_theta || pi_ref) estimators for a KL penalty.

Names follow Schulman's "Approximating KL divergence" note, with ``d = logprobs - ref_logprobs``:

- ``k1``: ``d``; unbiased value, high variance, can be negative.
- ``abs``: ``|d|``.
- ``k2``: ``0.5 * d**2``; biased value, but its gradient is an unbiased KL gradient estimate.
- ``k3``: ``r - log(r) - 1`` with ``r = exp(-d)``; unbiased, low-variance, non-negative value, but
  its gradient is biased (seed 001: E[grad k3] = E[-r grad log pi] != grad KL).
- ``k1+`` / ``k3+``: the value of k1 / k3 with the gradient of k2, by the straight-through trick
  ``k2 - sg(k2) + sg(value)``. Use these as a loss term when the value is also logged or rewarded.

verl's spellings are accepted as aliases: ``kl`` -> k1, ``mse`` -> k2, ``low_var_kl`` -> k3.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

__all__ = ["KL_ESTIMATORS", "KL_ESTIMATOR_ALIASES", "KLEstimator", "kl_penalty"]

KLEstimatorName = Literal["k1", "abs", "k2", "k3", "k1+", "k3+"]
KLEstimatorAlias = Literal["kl", "mse", "low_var_kl"]
"""verl's spellings, resolved by `KL_ESTIMATOR_ALIASES`."""
KLEstimator = Literal[KLEstimatorName, KLEstimatorAlias]
"""`grpo.kl_estimator`: an estimator or one of verl's aliases."""
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimatorName)
KL_ESTIMATOR_ALIASES: dict[str, str] = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}

# Same cap as the IS log-ratios (DESIGN decision 3): exp(20) is large but finite in fp32.
LOG_RATIO_CLAMP = 20.0


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    estimator: KLEstimator,
    *,
    mask: Tensor | None = None,
) -> Tensor:
    """Per-token KL estimate between the current policy and the reference policy.

    Args:
        logprobs: ``[batch, seq]`` (any shape) pi_theta logprobs, with gradient.
        ref_logprobs: same shape, reference-policy logprobs (treated as constants by the caller).
        estimator: one of ``KL_ESTIMATORS`` or an alias in ``KL_ESTIMATOR_ALIASES``.
        mask: optional keep mask of the same shape; masked positions give exactly 0 value and 0
            gradient even if their inputs are NaN/inf. Without it, reduce the result with
            ``aggregate_loss`` and make sure masked inputs are finite.

    Returns:
        Tensor of the inputs' shape.
    """
    name = _resolve(estimator)
    if ref_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"ref_logprobs shape {tuple(ref_logprobs.shape)} does not match "
            f"logprobs shape {tuple(logprobs.shape)}"
        )
    keep: Tensor | None = None
    if mask is not None:
        if mask.shape != logprobs.shape:
            raise ValueError(
                f"mask shape {tuple(mask.shape)} does not match logprobs shape {tuple(logprobs.shape)}"
            )
        keep = mask if mask.dtype == torch.bool else mask != 0
        # Zero the inputs before arithmetic: a masked inf through exp would make a NaN gradient.
        logprobs = torch.where(keep, logprobs, torch.zeros_like(logprobs))
        ref_logprobs = torch.where(keep, ref_logprobs, torch.zeros_like(ref_logprobs))

    kl = _estimate(logprobs - ref_logprobs, name)
    return kl if keep is None else torch.where(keep, kl, torch.zeros_like(kl))


def _resolve(estimator: str) -> str:
    name = KL_ESTIMATOR_ALIASES.get(estimator, estimator)
    if name not in KL_ESTIMATORS:
        valid = [*KL_ESTIMATORS, *(f"{alias} (= {target})" for alias, target in KL_ESTIMATOR_ALIASES.items())]
        raise ValueError(f"unknown KL estimator {estimator!r}; valid names: {', '.join(valid)}")
    return name


def _estimate(log_ratio: Tensor, name: str) -> Tensor:
    """KL estimate from ``log_ratio = logprobs - ref_logprobs`` for a canonical estimator name."""
    if name == "k1":
        return log_ratio
    if name == "abs":
        return log_ratio.abs()
    if name == "k2":
        return _k2(log_ratio)
    if name == "k3":
        return _k3(log_ratio)
    value = log_ratio if name == "k1+" else _k3(log_ratio)
    return _straight_through(value=value, gradient_from=_k2(log_ratio))


def _k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: Tensor) -> Tensor:
    # With r = pi_ref / pi_theta, log r = -log_ratio; clamp before exp so r stays finite.
    log_r = (-log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_r) - log_r - 1.0


def _straight_through(value: Tensor, gradient_from: Tensor) -> Tensor:
    """Forward: ``value``; backward: the gradient of ``gradient_from``."""
    return gradient_from - gradient_from.detach() + value.detach()
