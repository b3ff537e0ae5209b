"""Phase 1: per-sequence partial statistics of a row chunk.

Everything a sequence-level decision or metric needs is a per-sequence SUM, MAX or MIN of
token terms, so a sequence split across context-parallel ranks is handled by reducing these
`[rows]` vectors over the CP group before phase 2, never by gathering the tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.frontier import add_sequence_advantage, frontier_token_rejected
from nemo_rollout_correction.core.keys import SUM_EXP_ABS_LOG_RATIO
from nemo_rollout_correction.core.masking import TokenChunk
from nemo_rollout_correction.core.rejection import token_rejected
from nemo_rollout_correction.core.stats import Partials
from nemo_rollout_correction.core.weights import bound_weights


def token_is_weights(tok: TokenChunk, cfg: RolloutCorrectionConfig) -> tuple[Tensor, Tensor | None]:
    """Bounded token-level IS weights `[rows, seq]` and the mask-mode in-bounds flags (cached).

    Invalid tokens carry the bound applied to a ratio of exactly 1 (see `bounded_one`).
    """
    if "is_weight" not in tok.cache:
        if cfg.rollout_is_mode == "truncate":
            # exp then clamp in place: one temporary instead of ratio + weights.
            upper = cfg.rollout_is_threshold
            lower = cfg.is_lower if cfg.rollout_is_two_sided else None
            tok.cache["is_weight"] = torch.exp(tok.clamped).clamp_(min=lower, max=upper)
        else:
            weights, in_bounds = bound_weights(torch.exp(tok.clamped), tok.clamped, cfg)
            tok.cache["is_weight"] = weights
            if in_bounds is not None:
                tok.cache["is_in_bounds"] = in_bounds
    return tok.cache["is_weight"], tok.cache.get("is_in_bounds")


def bounded_one(cfg: RolloutCorrectionConfig) -> float:
    """The weight the bound gives a ratio of exactly 1: what invalid tokens carry."""
    upper, lower = cfg.rollout_is_threshold, cfg.is_lower
    if cfg.rollout_is_mode == "mask":
        return 1.0 if lower <= 1.0 <= upper else 0.0
    floor = lower if cfg.rollout_is_two_sided else float("-inf")
    return min(max(1.0, floor), upper)


def token_rs_rejected(tok: TokenChunk, cfg: RolloutCorrectionConfig) -> dict[str, Tensor]:
    """Per token-level criterion: valid tokens it rejects, `[rows, seq]` bool (cached)."""
    out: dict[str, Tensor] = {}
    for criterion in cfg.rejection_criteria:
        if criterion.is_token_level:
            key = f"rs_rejected:{criterion.name}"
            if key not in tok.cache:
                tok.cache[key] = token_rejected(tok, criterion)
            out[criterion.name] = tok.cache[key]
    return out


def token_rs_rejected_any(tok: TokenChunk, cfg: RolloutCorrectionConfig) -> Tensor | None:
    """Valid tokens rejected by any token-level rejection `[rows, seq]` (cached); None without any.

    The union of the token RS criteria and the token-level frontier masks (KPop, DPPO-TV): every
    rejection except token IS masking, which the callers combine themselves.

    Both phases call this: phase 2 may run on a fresh chunk view (context parallelism), so it
    must never rely on phase 1 having filled the cache.
    """
    if "rs_rejected_any" not in tok.cache:
        any_rejected: Tensor | None = None
        for mask in (*token_rs_rejected(tok, cfg).values(), *frontier_token_rejected(tok, cfg).values()):
            any_rejected = mask if any_rejected is None else any_rejected | mask
        if any_rejected is None:
            return None
        tok.cache["rs_rejected_any"] = any_rejected
    return tok.cache["rs_rejected_any"]


def _row_sum(x: Tensor) -> Tensor:
    # Sum in the native dtype (bool -> int64 exact counts, float32 with torch's cascade summation)
    # and widen the [rows] result: `sum(dtype=float64)` would first copy the whole chunk to float64.
    return x.sum(dim=-1).double()


def _row_sum_sq(x: Tensor) -> Tensor:
    # One fused pass instead of square-then-sum.
    norm: Tensor = torch.linalg.vector_norm(x, dim=-1)
    return norm.double().square()


def _row_amax(x: Tensor) -> Tensor:
    # amax over an empty last dimension raises; a [rows, 0] chunk has no tokens to reduce.
    return x.amax(dim=-1).double() if x.shape[-1] else torch.zeros(x.shape[0], dtype=torch.float64)


def _row_amin(x: Tensor) -> Tensor:
    if x.shape[-1]:
        return x.amin(dim=-1).double()
    return torch.full((x.shape[0],), float("inf"), dtype=torch.float64)


def chunk_sequence_partials(tok: TokenChunk, cfg: RolloutCorrectionConfig) -> Partials:
    """Per-sequence partials `[rows]` of one chunk (float64)."""
    seq = Partials()
    num_tokens = _row_sum(tok.valid_f)
    seq.sums["num_tokens"] = num_tokens
    if tok.nonfinite is None:
        seq.sums["num_nonfinite"] = torch.zeros_like(num_tokens)
    else:
        seq.sums["num_nonfinite"] = _row_sum(tok.nonfinite)
    sum_log_ratio = _row_sum(tok.log_ratio)
    sum_rollout = tok.row_sum_rollout.double()
    seq.sums["sum_log_ratio"] = sum_log_ratio
    seq.sums["sum_rollout_logprobs"] = sum_rollout
    seq.sums["sum_k3"] = tok.row_sum_k3().double()
    # sum rho^2 = sum (rho - 1)^2 + 2 sum (rho - 1) + n, with rho - 1 = 0 on invalid tokens.
    sum_expm1 = _row_sum(tok.expm1)
    tok.cache["row_sum_expm1"] = sum_expm1
    seq.sums["sum_ratio_sq"] = _row_sum_sq(tok.expm1) + 2.0 * sum_expm1 + num_tokens

    statistics = {c.statistic for c in cfg.rejection_criteria}
    if "k2" in statistics:
        seq.sums["sum_k2"] = 0.5 * _row_sum_sq(tok.clamped)
    for criterion in cfg.rejection_criteria:
        # k2/k3 are >= 0 and exactly 0 on invalid tokens, so a plain row max is the valid max.
        if criterion.granularity == "seq_max" and f"max_{criterion.statistic}" not in seq.maxs:
            values = tok.k2 if criterion.statistic == "k2" else tok.k3
            seq.maxs[f"max_{criterion.statistic}"] = _row_amax(values)

    if cfg.seq_logprob_error_threshold is not None:
        # sum_t exp(|delta_t|) over valid tokens, as sum expm1(|delta|) + n: expm1(0) = 0 on invalid tokens.
        seq.sums[SUM_EXP_ABS_LOG_RATIO] = _row_sum(torch.expm1(tok.clamped.abs())) + num_tokens

    if cfg.rollout_token_veto_threshold is not None:
        # Unclamped, so a veto threshold below e^-20 still fires on a ratio of e^-50. Invalid tokens
        # hold 0, which never changes the decision min < log(threshold) < 0: the partial is the
        # row minimum over valid tokens and 0, with no padding mask needed.
        seq.mins["min_log_ratio"] = _row_amin(tok.log_ratio)

    if cfg.rollout_is == "token":
        weights, in_bounds = token_is_weights(tok, cfg)
        seq.sums["sum_token_is_weight"] = torch.linalg.vecdot(weights, tok.valid_f).double()
        seq.sums["sum_token_raw_weight"] = sum_expm1 + num_tokens
        if in_bounds is not None:
            seq.sums["num_is_rejected"] = _row_sum(tok.valid & ~in_bounds)

    add_sequence_advantage(seq, tok, cfg)
    for name, mask in token_rs_rejected(tok, cfg).items():
        seq.sums[f"num_rs_rejected:{name}"] = _row_sum(mask)
    any_rejected = token_rs_rejected_any(tok, cfg)
    if any_rejected is not None:
        seq.sums["num_rs_token_rejected"] = _row_sum(any_rejected)
    return seq


def sequence_mean_k3(log_ratio: Tensor, loss_mask: Tensor) -> Tensor:
    """Per-sequence mean k3 = rho - 1 - log rho over `loss_mask` (`[rows, seq]` -> `[rows]` float64; 0 for a row
    without tokens). Used by the trainer's review and the audit's per-sequence tables.

    In float64 with expm1 and clamped at 0: in float32 the cancellation of near-equal terms made tiny fp32-engine
    mismatches (|log rho| ~ 1e-6) come out negative. `log_ratio` is clamped to +-20 first (design decision 3).
    """
    r64 = log_ratio.double().clamp(-20, 20)
    k3 = (torch.expm1(r64) - r64).clamp(min=0.0)
    return torch.where(loss_mask, k3, 0.0).sum(-1) / loss_mask.sum(-1).clamp(min=1)
