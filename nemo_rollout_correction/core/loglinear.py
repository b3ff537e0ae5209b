"""pi_old without a forward pass: log-linear interpolation between the rollout and the current policy.

The decoupled step re-scores every rollout token with the trainer before the update (`old_logprobs`),
one extra forward over the batch. AReaL's `prox_logp_method: loglinear` replaces that pass with an
interpolation in log space between two quantities the step has anyway: the engine's `rollout_logprobs`
(behaviour policy, version v_b) and the loss pass's `logprobs` (current policy, version v_theta):

    alpha = (v_old - v_b) / (v_theta - v_b)            clamped to [0, 1]
    log pi_old ~= (1 - alpha) * rollout_logprobs + alpha * logprobs

(a geometric mean of the two policies in probability space). Versions count optimizer updates: v_b is
the weights' version when the token was sampled, v_old that of pi_old (in decoupled PPO the policy at
the start of the step), v_theta that of the policy being optimised.

One deliberate difference from AReaL: when v_theta == v_b (so v_old == v_b too: the synchronous,
one-update-per-step loop) AReaL sets alpha = 0, i.e. pi_old = pi_rollout, which silently turns the
engine/trainer mismatch correction off (log_is_ratio = old - rollout = 0). Here alpha = 1 in that case:
pi_old has the same weights as the current policy, and the loss pass's logprobs are pi_old exactly (the
trainer's numerics), which is what the old-logprob forward would have computed.

Error (docs/math.md): write f(v) for the trainer's logprob of a token under the weights of version v and
delta = rollout_logprobs - f(v_b) for the engine's numerical mismatch. If |f''| <= M on [v_b, v_theta],

    |approx - f(v_old)| <= (M / 2) * (v_old - v_b) * (v_theta - v_old) + (1 - alpha) * |delta|

(the linear-interpolation remainder plus the part of the engine mismatch that the interpolation keeps).
Pure torch; no distributed code. `loglinear_error_partials` returns sums for the step's fused reduction.
"""

from __future__ import annotations

import torch
from torch import Tensor

Version = int | float | Tensor


def _as_tensor(value: Version, like: Tensor) -> Tensor:
    return torch.as_tensor(value, dtype=torch.float64, device=like.device)


def loglinear_alpha(behave_version: Version, old_version: Version, current_version: Version, *,
                    like: Tensor | None = None) -> Tensor:
    """Interpolation weight alpha = (v_old - v_b) / (v_theta - v_b), clamped to [0, 1]; 1 where v_theta == v_b.

    Args:
        behave_version: v_b, the policy version that sampled each token: a number or a `[batch, seq]` /
            `[batch, 1]` tensor (tokens of one sequence may come from different versions in async RL).
        old_version: v_old, the version of pi_old (the policy at the start of the step in decoupled PPO).
        current_version: v_theta, the version being optimised (v_b <= v_old <= v_theta).
        like: a tensor whose device the result takes (default CPU).

    Returns:
        float64 tensor broadcastable against `[batch, seq]`. Out-of-order versions are clamped, not raised:
        checking them would need a host sync inside the math.
    """
    ref = like if like is not None else torch.zeros(())
    v_b, v_o, v_t = (_as_tensor(v, ref) for v in (behave_version, old_version, current_version))
    span = v_t - v_b
    safe = torch.where(span > 0, span, torch.ones_like(span))
    alpha = torch.where(span > 0, (v_o - v_b) / safe, torch.ones_like(span))
    return alpha.clamp(0.0, 1.0)


def loglinear_old_logprobs(rollout_logprobs: Tensor, logprobs: Tensor, alpha: Tensor | float) -> Tensor:
    """`old_logprobs` `[batch, seq]` ~= (1 - alpha) * rollout_logprobs + alpha * logprobs, without a forward.

    Args:
        rollout_logprobs: `[batch, seq]` the engine's logprob of each sampled token (pi_rollout).
        logprobs: `[batch, seq]` the current policy's logprobs from the loss pass; detached here (pi_old
            carries no gradient).
        alpha: interpolation weight in [0, 1] (`loglinear_alpha`), a number or broadcastable tensor.

    Returns:
        `[batch, seq]` in the dtype of `logprobs`, detached. Endpoints are exact: alpha = 1 returns `logprobs`
        bit for bit and alpha = 0 returns `rollout_logprobs` (torch.lerp is exact at both ends; the
        `torch.where` keeps a non-finite rollout value out of an alpha = 1 token).
    """
    if rollout_logprobs.shape != logprobs.shape:
        raise ValueError(f"rollout_logprobs {tuple(rollout_logprobs.shape)} and logprobs {tuple(logprobs.shape)} "
                         "must have the same [batch, seq] shape")
    current = logprobs.detach()
    weight = torch.as_tensor(alpha, device=current.device).to(current.dtype).expand_as(current)
    rollout = rollout_logprobs.to(current.dtype)
    mixed = torch.lerp(rollout, current, weight)
    return torch.where(weight >= 1, current, torch.where(weight <= 0, rollout, mixed))


def loglinear_error_bound(alpha: Tensor | float, behave_version: float, old_version: float, current_version: float,
                          curvature: float, engine_mismatch: Tensor) -> Tensor:
    """The per-token bound (M / 2)(v_old - v_b)(v_theta - v_old) + (1 - alpha)|delta| (see the module docstring).

    Args:
        curvature: M, an upper bound on |d^2 f / dv^2| of the token's trainer logprob along the version path.
        engine_mismatch: `[batch, seq]` delta = rollout_logprobs - f(v_b).
    """
    interpolation = 0.5 * curvature * (old_version - behave_version) * (current_version - old_version)
    return interpolation + (1 - torch.as_tensor(alpha, dtype=engine_mismatch.dtype)) * engine_mismatch.abs()


def loglinear_error_partials(approx_old_logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Partial statistics of the approximation error over `mask` (for steps that compute both).

    Args:
        approx_old_logprobs / old_logprobs: `[batch, seq]` the interpolation and the forward's pi_old.
        mask: `[batch, seq]` bool, the loss tokens to compare.

    Returns:
        float64 scalars: `abs_error_sum`, `sq_error_sum`, `abs_error_max` (0 when empty), `num_tokens`; the
        means are sums / num_tokens after the step's reduction over dp x cp (SUM for sums, MAX for the max).
        Non-finite differences are excluded (they are the non-finite policy's business).
    """
    diff = (approx_old_logprobs.double() - old_logprobs.double())
    valid = mask & torch.isfinite(diff)
    err = torch.where(valid, diff.abs(), torch.zeros_like(diff))
    return {
        "abs_error_sum": err.sum(),
        "sq_error_sum": (err * err).sum(),
        "abs_error_max": err.amax() if err.numel() else err.new_zeros(()),
        "num_tokens": valid.sum().to(torch.float64),
    }


__all__ = ["loglinear_alpha", "loglinear_error_bound", "loglinear_error_partials", "loglinear_old_logprobs"]
