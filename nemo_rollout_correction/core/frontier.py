"""The 2025-26 masks: OPSM (sequence), KPop binary-KL (token) and DPPO-TV (token).

All three edit the keep mask (DESIGN.md decision 2) and compare the trainer's policy
(`old_logprobs`: pi_old in decoupled mode, the current policy in bypass mode) with the rollout
policy (`rollout_logprobs`). docs/math.md ("Frontier masks") gives the formulas and sources.

- OPSM (DeepSeek-V3.2; TRL `off_policy_mask_threshold`, slime `--use-opsm`): a sequence is
  rejected when its advantage is negative and its mean token log-ratio
  mean(log pi_rollout - log pi_train), a k1 estimate of KL(pi_rollout || pi_train), exceeds the
  threshold. It reads two per-sequence sums (log-ratio and advantage), which the context-parallel
  reduction already completes over the CP group, so it needs no extra collective.
- KPop (AReaL `rejection_sampling.metric: binary_kl`): per token, the Bernoulli distributions
  [p, 1 - p] of the sampled token's probability under each policy; a token is rejected when
  max(KL(P_train || P_rollout), KL(P_rollout || P_train)) exceeds the threshold.
- DPPO-TV (prime-rl `default_loss_fn`): a total-variation trust region on the sampled token's
  probability, one-sided by the advantage sign: with A > 0 reject p_train - p_rollout > high,
  otherwise reject p_rollout - p_train > low.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.masking import TokenChunk
from nemo_rollout_correction.core.stats import Partials

KPOP_EPS = 1e-8
"""Probabilities are clamped to [eps, 1 - eps] before the Bernoulli KL (AReaL's value)."""

_LOG_EPS = math.log(KPOP_EPS)
_LOG_ONE_MINUS_EPS = math.log1p(-KPOP_EPS)

SUM_ADVANTAGE = "sum_advantage"
"""Per-sequence SUM partial: the advantages of a sequence's valid tokens (OPSM's sign test)."""


def binary_kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """KL([p, 1 - p] || [q, 1 - q]) elementwise from log-probabilities (p, q clamped to [eps, 1 - eps]).

    log(1 - p) is computed as log(-expm1(log p)): exact near p = 1, where 1 - p would round to 0.
    """
    lp = log_p.clamp(_LOG_EPS, _LOG_ONE_MINUS_EPS)
    lq = log_q.clamp(_LOG_EPS, _LOG_ONE_MINUS_EPS)
    l1p = torch.log(-torch.expm1(lp))
    l1q = torch.log(-torch.expm1(lq))
    p = torch.exp(lp)
    return p * (lp - lq) + (1.0 - p) * (l1p - l1q)


def kpop_statistic(tok: TokenChunk) -> Tensor:
    """max(KL(P_train || P_rollout), KL(P_rollout || P_train)) per token `[rows, seq]` (0 on invalid; cached)."""
    if "kpop" not in tok.cache:
        train, rollout = tok.train_logprobs, tok.rollout_logprobs
        # Invalid tokens hold log-prob 0 under both policies: identical distributions, KL 0.
        tok.cache["kpop"] = torch.maximum(binary_kl(train, rollout), binary_kl(rollout, train))
    return tok.cache["kpop"]


def dppo_tv_rejected(tok: TokenChunk, cfg: RolloutCorrectionConfig) -> tuple[Tensor, Tensor]:
    """(rejected with A > 0, rejected with A <= 0) `[rows, seq]` bool, valid tokens only (cached)."""
    if "dppo_high" not in tok.cache:
        high, low = cfg.dppo_tv_threshold, cfg.dppo_tv_low
        assert high is not None and low is not None  # only called with DPPO-TV on
        advantages = _need_advantages(tok, "dppo_tv_threshold")
        diff = tok.train_prob - tok.rollout_prob  # 0 on invalid tokens
        positive = advantages > 0
        # prime-rl: torch.where(A > 0, high violation, low violation); A = 0 takes the low side.
        tok.cache["dppo_high"] = (diff > high) & positive & tok.valid
        tok.cache["dppo_low"] = (diff < -low) & ~positive & tok.valid
    return tok.cache["dppo_high"], tok.cache["dppo_low"]


def frontier_token_rejected(tok: TokenChunk, cfg: RolloutCorrectionConfig) -> dict[str, Tensor]:
    """Valid tokens each token-level frontier mask rejects (`kpop`, `dppo_tv`), `[rows, seq]` bool."""
    out: dict[str, Tensor] = {}
    if cfg.kpop_threshold is not None:
        if "kpop_rejected" not in tok.cache:
            tok.cache["kpop_rejected"] = (kpop_statistic(tok) > cfg.kpop_threshold) & tok.valid
        out["kpop"] = tok.cache["kpop_rejected"]
    if cfg.dppo_tv_threshold is not None:
        high, low = dppo_tv_rejected(tok, cfg)
        out["dppo_tv"] = high | low
    if cfg.m2po_threshold is not None:
        out["m2po"] = m2po_rejected(tok, cfg)
    return out


def sq_log_ratio(tok: TokenChunk) -> Tensor:
    """The squared clamped log-ratio `[rows, seq]` float64 (0 on invalid tokens): M2PO's per-token second moment.
    float64 holds the square of a float32 exactly, so every layout compares the same numbers (cached)."""
    if "sq_log_ratio" not in tok.cache:
        tok.cache["sq_log_ratio"] = tok.clamped.double().square()
    return tok.cache["sq_log_ratio"]


def m2po_rejected(tok: TokenChunk, cfg: RolloutCorrectionConfig) -> Tensor:
    """Valid tokens `[rows, seq]` whose squared log-ratio exceeds the step's M2PO cutoff."""
    cutoff = cfg.m2po_cutoff
    if cutoff is None:
        raise ValueError("m2po_threshold is set but the step's cutoff is not: it depends on every token of the step, "
                         "so resolve it first (core.step_thresholds.resolve_step_thresholds on one process, "
                         "RolloutCorrectedPolicyLoss.for_step / distributed.resolve_step_config across ranks)")
    if "m2po_rejected" not in tok.cache:
        tok.cache["m2po_rejected"] = (sq_log_ratio(tok) > cutoff) & tok.valid
    return tok.cache["m2po_rejected"]


def add_sequence_advantage(seq: Partials, tok: TokenChunk, cfg: RolloutCorrectionConfig) -> None:
    """Phase 1: the per-sequence advantage sum OPSM needs (a SUM over CP ranks like every other)."""
    if cfg.opsm_threshold is None:
        return
    advantages = _need_advantages(tok, "opsm_threshold")
    seq.sums[SUM_ADVANTAGE] = torch.linalg.vecdot(torch.where(tok.valid, advantages, 0.0), tok.valid_f).double()


def opsm_sequence_kl(seq: Partials) -> Tensor:
    """mean over valid tokens of (rollout_logprobs - old_logprobs) per sequence `[rows]` (0 without tokens)."""
    return -seq.sums["sum_log_ratio"] / seq.sums["num_tokens"].clamp(min=1.0)


def opsm_negative_advantage(seq: Partials) -> Tensor:
    """Sequences `[rows]` whose mean advantage over valid tokens is negative."""
    return seq.sums[SUM_ADVANTAGE] < 0


def opsm_rejected(seq: Partials, cfg: RolloutCorrectionConfig) -> Tensor:
    """Sequences `[rows]` OPSM rejects: negative advantage and sequence KL above the threshold."""
    assert cfg.opsm_threshold is not None  # only called with OPSM on
    has = seq.sums["num_tokens"] > 0
    return opsm_negative_advantage(seq) & (opsm_sequence_kl(seq) > cfg.opsm_threshold) & has


def _need_advantages(tok: TokenChunk, field: str) -> Tensor:
    if tok.advantages is None:
        raise ValueError(f"{field} is set, so the rollout correction needs the advantages: pass advantages= "
                         "([batch] or [batch, seq]) to compute_rollout_correction / the loss")
    return tok.advantages


__all__ = [
    "KPOP_EPS",
    "SUM_ADVANTAGE",
    "add_sequence_advantage",
    "binary_kl",
    "dppo_tv_rejected",
    "frontier_token_rejected",
    "kpop_statistic",
    "m2po_rejected",
    "opsm_negative_advantage",
    "opsm_rejected",
    "opsm_sequence_kl",
    "sq_log_ratio",
]
