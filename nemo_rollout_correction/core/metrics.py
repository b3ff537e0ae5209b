"""Diagnostics: mergeable metric partials and their finalisation into `rollout_corr/*` values.

Names and definitions follow verl's rollout_corr metric set so dashboards port; where we
deliberately differ (sequences without tokens are excluded from per-sequence means, k1
fractions are about the ratio bounds, overflow is clamped), docs/metrics.md says so.

Token-local partials come from `token_metric_partials` on every rank. Per-sequence partials
come from `sequence_metric_partials` on the one rank that owns each complete sequence, so the
sum over ranks counts every sequence once.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from nemo_rollout_correction.core import keys as K
from nemo_rollout_correction.core.config import RejectionCriterion, RolloutCorrectionConfig
from nemo_rollout_correction.core.frontier import (
    dppo_tv_rejected,
    frontier_token_rejected,
    kpop_statistic,
    opsm_negative_advantage,
    opsm_sequence_kl,
    sq_log_ratio,
)
from nemo_rollout_correction.core.masking import LOG_RATIO_BOUND, TokenChunk
from nemo_rollout_correction.core.rejection import (
    seq_logprob_error,
    sequence_statistic,
    statistic_bounds,
    token_statistic,
)
from nemo_rollout_correction.core.sequence_stats import bounded_one, token_is_weights, token_rs_rejected
from nemo_rollout_correction.core.stats import LogHistogram, Partials

PREFIX = "rollout_corr/"
QUANTILES: tuple[tuple[str, float], ...] = (("p1", 0.01), ("p10", 0.10), ("p50", 0.50), ("p90", 0.90),
                                            ("p99", 0.99))

_PPL_LOG_BOUND = 300.0
_CONSTANT_RTOL = 1e-6
_PROB_SHIFT = 0.5
_NEG_INF = float("-inf")
_POS_INF = float("inf")


def _count(mask: Tensor) -> Tensor:
    return mask.sum().double()


def _masked_max(values: Tensor, mask: Tensor) -> Tensor:
    if values.numel() == 0:
        return torch.tensor(_NEG_INF, dtype=torch.float64)
    return torch.where(mask, values, _NEG_INF).max()


def _masked_min(values: Tensor, mask: Tensor) -> Tensor:
    if values.numel() == 0:
        return torch.tensor(_POS_INF, dtype=torch.float64)
    return torch.where(mask, values, _POS_INF).min()


def _valid_extremes(
    tok: TokenChunk, values: Tensor, invalid_value: float, known: tuple[float, float] | None = None
) -> tuple[Tensor, Tensor] | None:
    """(max, min) of `values` over valid tokens, where invalid tokens hold exactly `invalid_value`.

    A plain aminmax (or `known` (min, max) of the whole chunk) is exact whenever the max lies
    above (the min below) the invalid filler, since only a valid token can produce it; otherwise
    fall back to padding. None if the chunk has no valid token.
    """
    if tok.num_invalid >= tok.numel:
        return None
    if known is None:
        low, high = torch.aminmax(values)
        known = (float(low), float(high))
    low_value, high_value = known
    high = torch.tensor(high_value, dtype=torch.float64)
    low = torch.tensor(low_value, dtype=torch.float64)
    if tok.num_invalid and not high_value > invalid_value:
        high = (values + tok.pad).amax()
    if tok.num_invalid and not low_value < invalid_value:
        low = (values - tok.pad).amin()
    return high, low


def _masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, values, 0.0).sum().double()


# ---- token-local partials (every rank) --------------------------------------------------------


def token_metric_partials(
    tok: TokenChunk,
    cfg: RolloutCorrectionConfig,
    keep: Tensor,
    kept_weights: Tensor,
    valid_weights: Tensor | None,
    decisions: dict[str, Tensor],
) -> Partials:
    """Metric partials that only need this rank's tokens of one chunk.

    keep: `[rows, seq]` bool keep mask; kept_weights: `[rows, seq]` the IS weights written out
    (0 outside keep; 1 on kept tokens when no IS applies), before any batch normalisation;
    valid_weights: token-level IS weights on valid tokens, 0 elsewhere (token level only).
    """
    out = Partials()
    valid = tok.valid
    out.add_sum("hist:token_log_ratio", LogHistogram.count(tok.clamped, tok.num_invalid))
    known = tok.log_ratio_extremes if tok.clamped is tok.log_ratio else None
    extremes = _valid_extremes(tok, tok.clamped, 0.0, known)
    if extremes is not None:
        out.add_max("token_log_ratio_max", extremes[0])
        out.add_min("token_log_ratio_min", extremes[1])

    if cfg.rollout_token_veto_threshold is not None:
        # Only a vetoed row can hold a catastrophic token; skip the pass when none was vetoed.
        count = torch.zeros((), dtype=torch.float64)
        if bool(decisions["veto"].any()):
            # Invalid tokens hold log-ratio 0, never below log(threshold) < 0.
            count = _count(tok.log_ratio < math.log(cfg.rollout_token_veto_threshold))
        out.add_sum("num_catastrophic_tokens", count)

    if cfg.rollout_is == "token":
        assert valid_weights is not None  # the caller computes them at token level
        weights, _ = token_is_weights(tok, cfg)
        out.add_sum("is_w2_sum", torch.linalg.vector_norm(valid_weights).double().square())
        extremes = _valid_extremes(tok, weights, bounded_one(cfg))
        if extremes is not None:
            out.add_max("is_w_max", extremes[0])
            out.add_min("is_w_min", extremes[1])
        log_upper, log_lower = math.log(cfg.rollout_is_threshold), math.log(cfg.is_lower)
        # Invalid tokens hold log-ratio 0; they only need masking out when the bounds exclude 1.
        needs_mask = tok.num_invalid > 0 and not log_lower <= 0.0 <= log_upper
        high, low = tok.clamped > log_upper, tok.clamped < log_lower
        out.add_sum("is_high_count", _count(high & valid if needs_mask else high))
        out.add_sum("is_low_count", _count(low & valid if needs_mask else low))
        if cfg.metrics_only:  # the written weights are all 1: sum what would have been applied
            out.add_sum(K.IS_WEIGHT_KEPT_SUM, torch.linalg.vecdot(valid_weights, keep.float()).sum().double())
        else:
            out.add_sum(K.IS_WEIGHT_KEPT_SUM, kept_weights.sum().double())
        out.add_sum(K.IS_WEIGHT_KEPT_COUNT, _count(keep))
        if cfg.rollout_is_target_ess is not None:  # the step's chosen bound, identical on every rank
            out.add_max(K.AUTO_IS_THRESHOLD, torch.tensor(cfg.rollout_is_threshold, dtype=torch.float64))

    for criterion in cfg.rejection_criteria:
        if criterion.is_token_level:
            _token_criterion_partials(out, tok, criterion)
    if cfg.rejection_criteria:
        rejected = decisions["rs_any"].unsqueeze(-1)
        for token_rejected in token_rs_rejected(tok, cfg).values():  # RS criteria only, not the frontier masks
            rejected = rejected | token_rejected
        out.add_sum("rs_rejected_tokens", _count(rejected & valid))
    _frontier_token_partials(out, tok, cfg)
    _prob_pearson_partials(out, tok, keep)
    return out


def _frontier_token_partials(out: Partials, tok: TokenChunk, cfg: RolloutCorrectionConfig) -> None:
    """KPop and DPPO-TV statistics of this rank's tokens."""
    rejected = frontier_token_rejected(tok, cfg)
    if cfg.kpop_threshold is not None:
        stat = kpop_statistic(tok)
        out.add_sum(K.KPOP_SUM, stat.sum().double())
        extremes = _valid_extremes(tok, stat, 0.0)
        if extremes is not None:
            out.add_max(K.KPOP_MAX, extremes[0])
        out.add_sum(K.KPOP_REJECTED_TOKENS, _count(rejected["kpop"]))
    if cfg.dppo_tv_threshold is not None:
        high, low = dppo_tv_rejected(tok, cfg)
        diff = tok.train_prob - tok.rollout_prob  # 0 on invalid tokens
        out.add_sum(K.DPPO_REJECTED_HIGH, _count(high))
        out.add_sum(K.DPPO_REJECTED_LOW, _count(low))
        out.add_sum(K.DPPO_REJECTED_TOKENS, _count(rejected["dppo_tv"]))
        out.add_sum(K.DPPO_ABS_DIFF_SUM, diff.abs().sum().double())
        extremes = _valid_extremes(tok, diff, 0.0)
        if extremes is not None:
            out.add_max(K.DPPO_DIFF_MAX, extremes[0])
            out.add_min(K.DPPO_DIFF_MIN, extremes[1])
    if cfg.m2po_threshold is not None:
        sq = sq_log_ratio(tok)  # 0 on invalid tokens
        kept = tok.valid & ~rejected["m2po"]
        out.add_sum(K.M2PO_REJECTED_TOKENS, _count(rejected["m2po"]))
        out.add_sum(K.M2PO_SQ_SUM, sq.sum())
        kept_sq = torch.where(kept, sq, 0.0)
        out.add_sum(K.M2PO_SQ_KEPT_SUM, kept_sq.sum())
        out.add_max(K.M2PO_SQ_KEPT_MAX, kept_sq.max() if sq.numel() else torch.zeros((), dtype=torch.float64))


def _prob_pearson_partials(out: Partials, tok: TokenChunk, keep: Tensor) -> None:
    """Mergeable moments of (p_train, p_rollout) over kept tokens: n, sums, squares, cross products.

    Pearson's r needs only these six sums, so it is exact across chunks, microbatches, DP and CP.
    Hot path (every config), so: p and q go into one `[2, rows * seq]` float32 buffer, one exp
    pass (of q; p reuses rho - 1), and the three second moments come from one 2 x 2 Gram matrix
    (a BLAS product) and the two sums from one row reduction.
    Sums are accumulated in float32 and widened (K.PROB_* hold sums of p - 1/2 and q - 1/2).
    """
    buf = torch.empty((2, *keep.shape), dtype=torch.float32, device=keep.device)
    q = tok.write_rollout_logprobs(buf[1]).exp_()
    # p = q * rho = q + q * (rho - 1), from the rho - 1 the sequence statistics already computed
    # (one exp pass instead of two). rho is clamped at e^+-20: only a token with p or q below 2e-9
    # is affected, by an amount far below the rounding of the sums.
    torch.addcmul(q, q, tok.expm1, out=buf[0])
    # Moments of p - 1/2 rather than p: r is shift-invariant, and centring the probabilities keeps
    # the float32 sums far from the cancellation in S_pp = sum p^2 - (sum p)^2 / n (the same constant
    # shift on every chunk and rank, so the partials still merge by addition).
    buf.sub_(_PROB_SHIFT)
    # Zero outside keep (masking, not subtracting the known value of invalid positions: padding
    # would otherwise inflate the float32 sums and their rounding error).
    if keep is tok.valid:
        keep_f = tok.valid_f
        count = torch.tensor(float(tok.numel - tok.num_invalid), dtype=torch.float64)
    else:
        keep_f = keep.float()
        count = keep_f.sum().double()
    buf.mul_(keep_f)
    flat = buf.view(2, -1)
    sums = flat.sum(dim=1).double()
    gram = (flat @ flat.T).double()
    out.add_sum(K.PROB_N, count)
    out.add_sum(K.PROB_SUM_TRAIN, sums[0])
    out.add_sum(K.PROB_SUM_ROLLOUT, sums[1])
    out.add_sum(K.PROB_SUM_TRAIN_SQ, gram[0, 0])
    out.add_sum(K.PROB_SUM_ROLLOUT_SQ, gram[1, 1])
    out.add_sum(K.PROB_SUM_CROSS, gram[0, 1])


def _token_criterion_partials(out: Partials, tok: TokenChunk, criterion: RejectionCriterion) -> None:
    key = f"rs:{criterion.name}:"
    stat = token_statistic(tok, criterion)
    low, high = statistic_bounds(criterion)
    extremes = _valid_extremes(tok, stat, 0.0)
    if extremes is not None:
        out.add_max(key + "max", extremes[0])
        out.add_min(key + "min", extremes[1])
    high_count, low_count = _outside_counts(stat, criterion, tok.valid)
    out.add_sum(key + "high_count", high_count)
    out.add_sum(key + "low_count", low_count)
    clamped = stat.clamp(low, high).mul_(tok.valid_f)
    out.add_sum(key + "clamped_sum", clamped.sum().double())
    out.add_sum(key + "clamped_sq_sum", torch.linalg.vector_norm(clamped).double().square())


def _outside_counts(stat: Tensor, criterion: RejectionCriterion, mask: Tensor) -> tuple[Tensor, Tensor]:
    """How many values lie above / below the kept interval (k2/k3 have no lower side)."""
    low, high = statistic_bounds(criterion)
    if criterion.statistic == "k1":
        return _count((stat > high) & mask), _count((stat < low) & mask)
    return _count((stat > high) & mask), torch.zeros((), dtype=torch.float64)


# ---- per-sequence partials (the owning rank only) ---------------------------------------------


def sequence_metric_partials(seq: Partials, cfg: RolloutCorrectionConfig, decisions: dict[str, Tensor]) -> Partials:
    """Metric partials derived from complete per-sequence statistics of one chunk's rows."""
    out = Partials()
    num_tokens = seq.sums["num_tokens"]
    has = num_tokens > 0
    n = num_tokens.clamp(min=1.0)

    out.add_sum(K.NUM_VALID_TOKENS, num_tokens.sum())
    out.add_sum(K.NUM_VALID_SEQS, _count(has))
    out.add_sum(K.NUM_NONFINITE_TOKENS, seq.sums["num_nonfinite"].sum())
    out.add_sum("num_nonfinite_seqs", _count(seq.sums["num_nonfinite"] > 0))
    out.add_sum(K.NUM_KEPT_SEQS, _count(decisions["keep"]))
    if "veto" in decisions:
        out.add_sum("num_vetoed_seqs", _count(decisions["veto"]))

    # sum old = sum rollout + sum log-ratio: derived here rather than carried as one more
    # per-sequence row through the context-parallel reduction.
    mean_old = (seq.sums["sum_rollout_logprobs"] + seq.sums["sum_log_ratio"]) / n
    mean_rollout = seq.sums["sum_rollout_logprobs"] / n
    # A perplexity above e^300 is meaningless but must not overflow the float64 sums to inf.
    out.add_sum("training_ppl_sum", _masked_sum(torch.exp((-mean_old).clamp(max=_PPL_LOG_BOUND)), has))
    out.add_sum("training_log_ppl_sum", _masked_sum(-mean_old, has))
    out.add_sum("rollout_ppl_sum", _masked_sum(torch.exp((-mean_rollout).clamp(max=_PPL_LOG_BOUND)), has))
    out.add_sum("rollout_log_ppl_sum", _masked_sum(-mean_rollout, has))
    log_ppl_diff = mean_rollout - mean_old
    out.add_sum("log_ppl_diff_sum", _masked_sum(log_ppl_diff, has))
    out.add_sum("log_ppl_abs_diff_sum", _masked_sum(log_ppl_diff.abs(), has))
    out.add_max("log_ppl_diff_max", _masked_max(log_ppl_diff, has))
    out.add_min("log_ppl_diff_min", _masked_min(log_ppl_diff, has))
    out.add_sum("ppl_ratio_sum", _masked_sum(torch.exp(log_ppl_diff.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)), has))

    sum_log_ratio = seq.sums["sum_log_ratio"]
    out.add_sum("kl_sum", -sum_log_ratio.sum())
    out.add_sum("k3_sum", seq.sums["sum_k3"].sum())
    out.add_sum("ratio_sq_sum", seq.sums["sum_ratio_sq"].sum())
    seq_log_ratio = sum_log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    out.add_sum("chi2_seq_sum", _masked_sum(torch.exp(2.0 * seq_log_ratio), has))

    if cfg.rollout_is == "token":
        _token_is_sequence_partials(out, seq, cfg, has, n)
    elif cfg.rollout_is is not None:
        _sequence_is_partials(out, seq, cfg, decisions, has, num_tokens)

    rs_seq_rejected = decisions["rs_any"]
    for criterion in cfg.rejection_criteria:
        rejected = _criterion_sequence_partials(out, seq, criterion, decisions, has, num_tokens)
        rs_seq_rejected = rs_seq_rejected | rejected
    if cfg.rejection_criteria:
        out.add_sum("rs_rejected_seqs", _count(rs_seq_rejected & has))
    if cfg.opsm_threshold is not None:
        rejected = decisions["opsm"]
        seq_kl = opsm_sequence_kl(seq)
        out.add_sum(K.OPSM_REJECTED_SEQS, _count(rejected))
        out.add_sum(K.OPSM_REJECTED_TOKENS, (num_tokens * rejected).sum())
        out.add_sum(K.OPSM_NEGATIVE_SEQS, _count(opsm_negative_advantage(seq) & has))
        out.add_sum(K.OPSM_SEQ_KL_SUM, _masked_sum(seq_kl, has))
        out.add_max(K.OPSM_SEQ_KL_MAX, _masked_max(seq_kl, has))
    if cfg.seq_logprob_error_threshold is not None:
        rejected = decisions["seq_lp_error"]
        error = seq_logprob_error(seq)
        out.add_sum(K.SEQ_LP_ERROR_REJECTED_SEQS, _count(rejected))
        out.add_sum(K.SEQ_LP_ERROR_REJECTED_TOKENS, (num_tokens * rejected).sum())
        out.add_sum(K.SEQ_LP_ERROR_SUM, _masked_sum(error, has))
        out.add_max(K.SEQ_LP_ERROR_MAX, _masked_max(error, has))
    return out


def _token_is_sequence_partials(out: Partials, seq: Partials, cfg: RolloutCorrectionConfig, has: Tensor,
                                n: Tensor) -> None:
    out.add_sum("is_w_sum", seq.sums["sum_token_is_weight"].sum())
    if "num_is_rejected" in seq.sums:
        out.add_sum("is_rejected_tokens", seq.sums["num_is_rejected"].sum())
    seq_mean = seq.sums["sum_token_is_weight"] / n
    _add_seq_value_stats(out, "is_seq", seq_mean, has)
    # The high/low sequence fractions use the raw (pre-bound) per-sequence mean: a mean of
    # truncated weights can never exceed the upper bound.
    raw_mean = seq.sums["sum_token_raw_weight"] / n
    out.add_sum("is_seq_high_count", _count((raw_mean > cfg.rollout_is_threshold) & has))
    out.add_sum("is_seq_low_count", _count((raw_mean < cfg.is_lower) & has))


def _sequence_is_partials(out: Partials, seq: Partials, cfg: RolloutCorrectionConfig,
                          decisions: dict[str, Tensor], has: Tensor, num_tokens: Tensor) -> None:
    weight = decisions["is_weight"]
    log_raw = decisions["is_log_raw"]
    clamped = log_raw.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    log_upper, log_lower = math.log(cfg.rollout_is_threshold), math.log(cfg.is_lower)
    # Token-weighted, as if each token carried its sequence's weight (verl's definition).
    out.add_sum("is_w_sum", (num_tokens * weight).sum())
    out.add_sum("is_w2_sum", (num_tokens * weight.square()).sum())
    out.add_max("is_log_max", _masked_max(clamped, has))
    out.add_min("is_log_min", _masked_min(clamped, has))
    out.add_sum("is_high_count", _count((log_raw > log_upper) & has))
    out.add_sum("is_low_count", _count((log_raw < log_lower) & has))
    out.add_sum("is_seq_high_count", _count((log_raw > log_upper) & has))
    out.add_sum("is_seq_low_count", _count((log_raw < log_lower) & has))
    _add_seq_value_stats(out, "is_seq", weight, has)
    out.add_sum("hist:is_raw_log_weight", LogHistogram.count_weighted(clamped, torch.where(has, num_tokens, 0.0)))
    if "is_rejected" in decisions:
        out.add_sum("is_rejected_tokens", (num_tokens * decisions["is_rejected"]).sum())
    kept = decisions["keep"]
    out.add_sum(K.IS_WEIGHT_KEPT_SUM, _masked_sum(weight, kept))
    out.add_sum(K.IS_WEIGHT_KEPT_COUNT, _count(kept))


def _criterion_sequence_partials(out: Partials, seq: Partials, criterion: RejectionCriterion,
                                 decisions: dict[str, Tensor], has: Tensor, num_tokens: Tensor) -> Tensor:
    """Per-sequence statistics of one criterion; returns the sequences it rejected."""
    key = f"rs:{criterion.name}:"
    stat = sequence_statistic(seq, criterion)
    _add_seq_value_stats(out, key + "seq", stat, has)
    high_count, low_count = _outside_counts(stat, criterion, has)
    out.add_sum(key + "seq_high_count", high_count)
    out.add_sum(key + "seq_low_count", low_count)
    if criterion.is_token_level:
        token_total = {"k1": seq.sums["sum_log_ratio"]}.get(criterion.statistic)
        if token_total is None:
            token_total = seq.sums[f"sum_{criterion.statistic}"]
        out.add_sum(key + "sum", token_total.sum())
        num_rejected = seq.sums[f"num_rs_rejected:{criterion.name}"]
        out.add_sum(key + "rejected_tokens", num_rejected.sum())
        rejected = num_rejected > 0
        out.add_sum(key + "rejected_seqs", _count(rejected))
        return rejected
    # Sequence-level criterion: token-weighted values, as if each token carried its sequence's statistic.
    low, high = statistic_bounds(criterion)
    weights = torch.where(has, num_tokens, 0.0)
    out.add_sum(key + "sum", (weights * stat).sum())
    clamped = stat.clamp(low, high)
    out.add_sum(key + "clamped_sum", (weights * clamped).sum())
    out.add_sum(key + "clamped_sq_sum", (weights * clamped.square()).sum())
    out.add_max(key + "max", _masked_max(stat, has))
    out.add_min(key + "min", _masked_min(stat, has))
    out.add_sum(key + "high_count", high_count)
    out.add_sum(key + "low_count", low_count)
    rejected = decisions[f"rs:{criterion.name}"]
    out.add_sum(key + "rejected_tokens", (num_tokens * rejected).sum())
    out.add_sum(key + "rejected_seqs", _count(rejected))
    return rejected


def _add_seq_value_stats(out: Partials, key: str, values: Tensor, has: Tensor) -> None:
    out.add_sum(key + "_sum", _masked_sum(values, has))
    out.add_sum(key + "_sq_sum", _masked_sum(values.square(), has))
    out.add_max(key + "_max", _masked_max(values, has))
    out.add_min(key + "_min", _masked_min(values, has))


# ---- finalisation ------------------------------------------------------------------------------


def finalize_metrics(partials: Partials, cfg: RolloutCorrectionConfig) -> dict[str, float]:
    """Turn (reduced) partials into `rollout_corr/<name>` floats: a ratio over an empty population is 0.0,
    except `prob_pearson`, which is NaN where Pearson's r is undefined (docs/metrics.md)."""
    f = _Finalizer(partials)
    m: dict[str, float] = {}
    num_tokens, num_seqs = f.sum(K.NUM_VALID_TOKENS), f.sum(K.NUM_VALID_SEQS)
    num_nonfinite = f.sum(K.NUM_NONFINITE_TOKENS)

    m["num_valid_tokens"] = num_tokens
    m["num_valid_seqs"] = num_seqs
    m["num_kept_tokens"] = f.sum(K.NUM_KEPT_TOKENS)
    m["num_kept_seqs"] = f.sum(K.NUM_KEPT_SEQS)
    m["num_denominator_tokens"] = f.sum(K.NUM_DENOMINATOR_TOKENS)
    m["kept_token_fraction"] = _div(m["num_kept_tokens"], num_tokens)
    m["nonfinite_token_count"] = num_nonfinite
    m["nonfinite_seq_count"] = f.sum("num_nonfinite_seqs")
    m["nonfinite_token_fraction"] = _div(num_nonfinite, num_tokens + num_nonfinite)

    m["training_ppl"] = _div(f.sum("training_ppl_sum"), num_seqs)
    m["training_log_ppl"] = _div(f.sum("training_log_ppl_sum"), num_seqs)
    m["rollout_ppl"] = _div(f.sum("rollout_ppl_sum"), num_seqs)
    m["rollout_log_ppl"] = _div(f.sum("rollout_log_ppl_sum"), num_seqs)
    m["ppl_ratio"] = _div(f.sum("ppl_ratio_sum"), num_seqs)
    m["log_ppl_diff"] = _div(f.sum("log_ppl_diff_sum"), num_seqs)
    m["log_ppl_abs_diff"] = _div(f.sum("log_ppl_abs_diff_sum"), num_seqs)
    m["log_ppl_diff_max"] = f.max("log_ppl_diff_max")
    m["log_ppl_diff_min"] = f.min("log_ppl_diff_min")
    m["kl"] = _div(f.sum("kl_sum"), num_tokens)
    m["k3_kl"] = _div(f.sum("k3_sum"), num_tokens)
    m["chi2_token"] = _div(f.sum("ratio_sq_sum"), num_tokens) - 1.0 if num_tokens > 0 else 0.0
    m["chi2_seq"] = _div(f.sum("chi2_seq_sum"), num_seqs) - 1.0 if num_seqs > 0 else 0.0
    m["token_log_ratio_max"] = f.max("token_log_ratio_max")
    m["token_log_ratio_min"] = f.min("token_log_ratio_min")
    token_hist = partials.sums.get("hist:token_log_ratio")
    for (label, _), value in zip(QUANTILES, _hist_quantiles(token_hist), strict=True):
        m[f"token_ratio_{label}"] = value

    if cfg.rollout_token_veto_threshold is not None:
        m["veto_fraction"] = _div(f.sum("num_vetoed_seqs"), num_seqs)
        m["catastrophic_token_fraction"] = _div(f.sum("num_catastrophic_tokens"), num_tokens)
    if cfg.rollout_is is not None:
        _finalize_is(m, f, partials, cfg, num_tokens, num_seqs)
    if cfg.rejection_criteria:
        for criterion in cfg.rejection_criteria:
            _finalize_criterion(m, f, criterion, num_tokens, num_seqs)
        m["rollout_rs_masked_fraction"] = _div(f.sum("rs_rejected_tokens"), num_tokens)
        m["rollout_rs_seq_masked_fraction"] = _div(f.sum("rs_rejected_seqs"), num_seqs)
    _finalize_frontier(m, f, cfg, num_tokens, num_seqs)
    m["prob_pearson"] = prob_pearson(f.sum(K.PROB_N), f.sum(K.PROB_SUM_TRAIN), f.sum(K.PROB_SUM_ROLLOUT),
                                     f.sum(K.PROB_SUM_TRAIN_SQ), f.sum(K.PROB_SUM_ROLLOUT_SQ),
                                     f.sum(K.PROB_SUM_CROSS))
    return {PREFIX + key: float(value) for key, value in m.items()}


def _finalize_frontier(m: dict[str, float], f: _Finalizer, cfg: RolloutCorrectionConfig, num_tokens: float,
                       num_seqs: float) -> None:
    if cfg.opsm_threshold is not None:
        m["opsm_seq_masked_fraction"] = _div(f.sum(K.OPSM_REJECTED_SEQS), num_seqs)
        m["opsm_masked_fraction"] = _div(f.sum(K.OPSM_REJECTED_TOKENS), num_tokens)
        m["opsm_negative_advantage_seq_fraction"] = _div(f.sum(K.OPSM_NEGATIVE_SEQS), num_seqs)
        m["opsm_seq_kl_mean"] = _div(f.sum(K.OPSM_SEQ_KL_SUM), num_seqs)
        m["opsm_seq_kl_max"] = f.max(K.OPSM_SEQ_KL_MAX)
    if cfg.seq_logprob_error_threshold is not None:
        m["seq_logprob_error_mean"] = _div(f.sum(K.SEQ_LP_ERROR_SUM), num_seqs)
        m["seq_logprob_error_max"] = f.max(K.SEQ_LP_ERROR_MAX)
        m["seq_logprob_error_seq_masked_fraction"] = _div(f.sum(K.SEQ_LP_ERROR_REJECTED_SEQS), num_seqs)
        m["seq_logprob_error_masked_fraction"] = _div(f.sum(K.SEQ_LP_ERROR_REJECTED_TOKENS), num_tokens)
    if cfg.kpop_threshold is not None:
        m["kpop_masked_fraction"] = _div(f.sum(K.KPOP_REJECTED_TOKENS), num_tokens)
        m["kpop_binary_kl_mean"] = _div(f.sum(K.KPOP_SUM), num_tokens)
        m["kpop_binary_kl_max"] = f.max(K.KPOP_MAX)
    if cfg.dppo_tv_threshold is not None:
        m["dppo_tv_masked_fraction"] = _div(f.sum(K.DPPO_REJECTED_TOKENS), num_tokens)
        m["dppo_tv_masked_fraction_high"] = _div(f.sum(K.DPPO_REJECTED_HIGH), num_tokens)
        m["dppo_tv_masked_fraction_low"] = _div(f.sum(K.DPPO_REJECTED_LOW), num_tokens)
        m["dppo_tv_prob_diff_abs_mean"] = _div(f.sum(K.DPPO_ABS_DIFF_SUM), num_tokens)
        m["dppo_tv_prob_diff_max"] = f.max(K.DPPO_DIFF_MAX)
        m["dppo_tv_prob_diff_min"] = f.min(K.DPPO_DIFF_MIN)
    if cfg.m2po_threshold is not None:
        rejected = f.sum(K.M2PO_REJECTED_TOKENS)
        m["m2po_masked_fraction"] = _div(rejected, num_tokens)
        m["m2po_second_moment"] = _div(f.sum(K.M2PO_SQ_SUM), num_tokens)
        m["m2po_second_moment_kept"] = _div(f.sum(K.M2PO_SQ_KEPT_SUM), num_tokens - rejected)
        m["m2po_kept_sq_log_ratio_max"] = f.max(K.M2PO_SQ_KEPT_MAX)


def prob_pearson(n: float, sum_p: float, sum_q: float, sum_pp: float, sum_qq: float, sum_pq: float) -> float:
    """Pearson's r of (p, q) from its mergeable sums; NaN when undefined (n < 2 or a constant side).

    Undefined is reported as NaN, never as 0.0, which would read as "no correlation" (issue 24: a tiny
    model whose token probabilities are near-constant logged 0.0 on every step).

    Centred second moments from raw sums: S_pq = sum pq - sum p * sum q / n (in float64, from sums
    accumulated in float32). A variance below 1e-6 of the raw sum of squares is within the float32
    rounding of a constant side, where r is undefined.
    """
    if n < 2:
        return math.nan
    s_pq = sum_pq - sum_p * sum_q / n
    s_pp = sum_pp - sum_p * sum_p / n
    s_qq = sum_qq - sum_q * sum_q / n
    # A centred sum of squares within float32 accumulation error of the raw one: a constant side.
    if s_pp <= _CONSTANT_RTOL * sum_pp or s_qq <= _CONSTANT_RTOL * sum_qq:
        return math.nan
    return max(-1.0, min(1.0, s_pq / math.sqrt(s_pp * s_qq)))


def _finalize_is(m: dict[str, float], f: _Finalizer, partials: Partials, cfg: RolloutCorrectionConfig,
                 num_tokens: float, num_seqs: float) -> None:
    token_level = cfg.rollout_is == "token"
    mean = _div(f.sum("is_w_sum"), num_tokens)
    second = _div(f.sum("is_w2_sum"), num_tokens)
    m["rollout_is_mean"] = mean
    m["rollout_is_std"] = math.sqrt(max(second - mean * mean, 0.0))
    m["rollout_is_eff_sample_size"] = _div(mean * mean, second)
    if cfg.rollout_is_target_ess is not None:
        m["rollout_is_threshold_auto"] = f.max(K.AUTO_IS_THRESHOLD)
    if token_level:
        m["rollout_is_max"], m["rollout_is_min"] = f.max("is_w_max"), f.min("is_w_min")
        population = num_tokens
    else:
        has_seqs = num_seqs > 0
        m["rollout_is_max"] = math.exp(f.max("is_log_max")) if has_seqs else 0.0
        m["rollout_is_min"] = math.exp(f.min("is_log_min")) if has_seqs else 0.0
        population = num_seqs
    m["rollout_is_ratio_fraction_high"] = _div(f.sum("is_high_count"), population)
    m["rollout_is_ratio_fraction_low"] = _div(f.sum("is_low_count"), population)
    seq_stats = _seq_value_stats(f, "is_seq", num_seqs)
    m["rollout_is_seq_mean"], m["rollout_is_seq_std"] = seq_stats["mean"], seq_stats["std"]
    m["rollout_is_seq_max"], m["rollout_is_seq_min"] = seq_stats["max"], seq_stats["min"]
    m["rollout_is_seq_max_deviation"] = (
        max(abs(seq_stats["max"] - 1.0), abs(seq_stats["min"] - 1.0)) if num_seqs > 0 else 0.0
    )
    m["rollout_is_seq_fraction_high"] = _div(f.sum("is_seq_high_count"), num_seqs)
    m["rollout_is_seq_fraction_low"] = _div(f.sum("is_seq_low_count"), num_seqs)
    if cfg.rollout_is_mode == "mask":
        m["rollout_is_masked_fraction"] = _div(f.sum("is_rejected_tokens"), num_tokens)
        m["rollout_is_oob_ratio"] = m["rollout_is_masked_fraction"]
    if K.BATCH_NORM_FACTOR in partials.maxs:
        m["rollout_is_batch_norm_factor"] = f.max(K.BATCH_NORM_FACTOR)

    raw_hist = partials.sums.get("hist:token_log_ratio" if token_level else "hist:is_raw_log_weight")
    raw = _hist_quantiles(raw_hist)
    applied = _applied_quantiles(raw_hist, raw, cfg)
    for (label, _), raw_value, applied_value in zip(QUANTILES, raw, applied, strict=True):
        m[f"rollout_is_raw_{label}"] = raw_value
        m[f"rollout_is_{label}"] = applied_value


def _applied_quantiles(hist: Tensor | None, raw: list[float], cfg: RolloutCorrectionConfig) -> list[float]:
    """Quantiles of the bounded weights, derived from the raw histogram.

    Truncation is monotone, so its quantiles are the truncated raw quantiles. Masking sends
    the mass outside the bounds to 0.
    """
    upper, lower = cfg.rollout_is_threshold, cfg.is_lower
    if cfg.rollout_is_mode == "truncate":
        floor = lower if cfg.rollout_is_two_sided else 0.0
        return [min(max(value, floor), upper) if value > 0 else 0.0 for value in raw]
    if hist is None:
        return [0.0] * len(QUANTILES)
    centers = LogHistogram.centers()
    inside = (centers >= math.log(lower)) & (centers <= math.log(upper))
    zero_mass = float(hist[~inside].sum())
    return LogHistogram.quantiles(torch.where(inside, hist, 0.0), [q for _, q in QUANTILES], zero_count=zero_mass)


def _finalize_criterion(m: dict[str, float], f: _Finalizer, criterion: RejectionCriterion, num_tokens: float,
                        num_seqs: float) -> None:
    key = f"rs:{criterion.name}:"
    name = f"rollout_rs_{criterion.name}"
    population = num_tokens if criterion.is_token_level else num_seqs
    m[f"{name}_mean"] = _div(f.sum(key + "sum"), num_tokens)
    m[f"{name}_max"] = f.max(key + "max")
    m[f"{name}_min"] = f.min(key + "min")
    m[f"{name}_fraction_high"] = _div(f.sum(key + "high_count"), population)
    m[f"{name}_fraction_low"] = _div(f.sum(key + "low_count"), population)
    clamped_mean = _div(f.sum(key + "clamped_sum"), num_tokens)
    clamped_second = _div(f.sum(key + "clamped_sq_sum"), num_tokens)
    m[f"{name}_std"] = math.sqrt(max(clamped_second - clamped_mean * clamped_mean, 0.0))
    seq_stats = _seq_value_stats(f, key + "seq", num_seqs)
    m[f"{name}_seq_mean"], m[f"{name}_seq_std"] = seq_stats["mean"], seq_stats["std"]
    m[f"{name}_seq_max"], m[f"{name}_seq_min"] = seq_stats["max"], seq_stats["min"]
    m[f"{name}_seq_max_deviation"] = max(abs(seq_stats["max"]), abs(seq_stats["min"]))
    m[f"{name}_seq_fraction_high"] = _div(f.sum(key + "seq_high_count"), num_seqs)
    m[f"{name}_seq_fraction_low"] = _div(f.sum(key + "seq_low_count"), num_seqs)
    m[f"{name}_masked_fraction"] = _div(f.sum(key + "rejected_tokens"), num_tokens)
    m[f"{name}_seq_masked_fraction"] = _div(f.sum(key + "rejected_seqs"), num_seqs)


def _seq_value_stats(f: _Finalizer, key: str, num_seqs: float) -> dict[str, float]:
    """Mean, unbiased std, max and min over sequences of a per-sequence value."""
    total, squares = f.sum(key + "_sum"), f.sum(key + "_sq_sum")
    mean = _div(total, num_seqs)
    variance = (squares - total * mean) / (num_seqs - 1.0) if num_seqs > 1 else 0.0
    return {"mean": mean, "std": math.sqrt(max(variance, 0.0)), "max": f.max(key + "_max"),
            "min": f.min(key + "_min")}


def _hist_quantiles(hist: Tensor | None) -> list[float]:
    if hist is None:
        return [0.0] * len(QUANTILES)
    return LogHistogram.quantiles(hist, [q for _, q in QUANTILES])


def _div(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else 0.0


def _scalars(values: dict[str, Tensor]) -> dict[str, float]:
    """0-d tensors as floats through one stack and one host transfer, not one `.item()` each."""
    if not values:
        return {}
    floats = torch.stack(list(values.values())).tolist()
    return dict(zip(values, floats, strict=True))


class _Finalizer:
    """Reads partials as floats in one conversion each; absent or infinite extremes read as 0."""

    def __init__(self, partials: Partials) -> None:
        self._sums = _scalars({k: v for k, v in partials.sums.items() if v.dim() == 0})
        self._maxs = _scalars(partials.maxs)
        self._mins = _scalars(partials.mins)

    def sum(self, name: str) -> float:
        return self._sums.get(name, 0.0)

    def max(self, name: str) -> float:
        value = self._maxs.get(name, 0.0)
        return value if math.isfinite(value) else 0.0

    def min(self, name: str) -> float:
        value = self._mins.get(name, 0.0)
        return value if math.isfinite(value) else 0.0
