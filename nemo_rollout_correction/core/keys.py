"""Names of the partial statistics that more than one module reads: one constant each.

A partial is written by core (`metrics`, `correction`) and read by core's finalisation, by
`distributed.correction` (loss denominators, the batch-normalisation mean, non-finite checks) and
by the losses. A typo in a string key used to read as 0.0 (`Partials.get_sum` defaulted), which
for a denominator silently zeroed the loss; now every reader names a constant from here and
`Partials.get_sum` raises `KeyError` for a name that is absent.

Kind: every name below is a SUM partial unless its comment says MAX / MIN.
"""

from __future__ import annotations

# -- counts (loss denominators and population sizes) ------------------------------------------
NUM_VALID_TOKENS = "num_valid_tokens"
"""Loss tokens with finite logprobs."""
NUM_VALID_SEQS = "num_valid_seqs"
"""Sequences with at least one valid token (counted by the rank owning the sequence)."""
NUM_KEPT_TOKENS = "num_kept_tokens"
"""Tokens left in keep_mask after rejection, veto and non-finite handling."""
NUM_KEPT_SEQS = "num_kept_seqs"
"""Sequences not rejected as a whole."""
NUM_DENOMINATOR_TOKENS = "num_denominator_tokens"
"""Tokens counted in the token-mode loss denominator (denominator_mask)."""
NUM_NONFINITE_TOKENS = "num_nonfinite_tokens"
"""Loss tokens with a NaN/inf logprob."""

# -- batch-normalised IS ------------------------------------------------------------------------
IS_WEIGHT_KEPT_SUM = "is_weight_kept_sum"
"""Applied IS weights over kept tokens (token level) or kept sequences (sequence levels)."""
IS_WEIGHT_KEPT_COUNT = "is_weight_kept_count"
"""The population of IS_WEIGHT_KEPT_SUM."""
BATCH_NORM_FACTOR = "batch_norm_factor"
"""MAX: the global mean the IS weights were divided by."""

# -- OPSM (sequence level, owner rank) ----------------------------------------------------------
OPSM_REJECTED_SEQS = "opsm:rejected_seqs"
OPSM_REJECTED_TOKENS = "opsm:rejected_tokens"
OPSM_NEGATIVE_SEQS = "opsm:negative_advantage_seqs"
OPSM_SEQ_KL_SUM = "opsm:seq_kl_sum"
OPSM_SEQ_KL_MAX = "opsm:seq_kl_max"
"""MAX: the largest sequence KL."""

# -- KPop (token level) -------------------------------------------------------------------------
KPOP_SUM = "kpop:sum"
KPOP_MAX = "kpop:max"
"""MAX: the largest symmetric binary KL."""
KPOP_REJECTED_TOKENS = "kpop:rejected_tokens"

# -- DPPO-TV (token level) ----------------------------------------------------------------------
DPPO_REJECTED_TOKENS = "dppo_tv:rejected_tokens"
DPPO_REJECTED_HIGH = "dppo_tv:rejected_high"
DPPO_REJECTED_LOW = "dppo_tv:rejected_low"
DPPO_ABS_DIFF_SUM = "dppo_tv:abs_diff_sum"
DPPO_DIFF_MAX = "dppo_tv:diff_max"
"""MAX: the largest p_train - p_rollout."""
DPPO_DIFF_MIN = "dppo_tv:diff_min"
"""MIN: the smallest p_train - p_rollout."""

# -- Pearson correlation of the two probabilities over kept tokens ------------------------------
PROB_N = "prob:n"
PROB_SUM_TRAIN = "prob:sum_train"
PROB_SUM_ROLLOUT = "prob:sum_rollout"
PROB_SUM_TRAIN_SQ = "prob:sum_train_sq"
PROB_SUM_ROLLOUT_SQ = "prob:sum_rollout_sq"
PROB_SUM_CROSS = "prob:sum_cross"

# -- sequence log-prob error (NeMo-RL seq_logprob_error_threshold) -------------------------------
SUM_EXP_ABS_LOG_RATIO = "sum_exp_abs_log_ratio"
"""Per-sequence (phase 1) SUM of exp(|clamped log-ratio|) over valid tokens."""
SEQ_LP_ERROR_SUM = "seq_lp_error:sum"
"""The per-sequence statistic summed over valid sequences."""
SEQ_LP_ERROR_MAX = "seq_lp_error:max"
"""MAX: the largest per-sequence statistic."""
SEQ_LP_ERROR_REJECTED_SEQS = "seq_lp_error:rejected_seqs"
SEQ_LP_ERROR_REJECTED_TOKENS = "seq_lp_error:rejected_tokens"

# -- M2PO (token level, step cutoff) ------------------------------------------------------------------
M2PO_REJECTED_TOKENS = "m2po:rejected_tokens"
"""SUM: valid tokens whose squared log-ratio exceeds the step's cutoff."""
M2PO_SQ_SUM = "m2po:sq_sum"
"""SUM: squared log-ratios of the valid tokens."""
M2PO_SQ_KEPT_SUM = "m2po:sq_kept_sum"
"""SUM: squared log-ratios of the valid tokens M2PO keeps."""
M2PO_SQ_KEPT_MAX = "m2po:sq_kept_max"
"""MAX: the largest squared log-ratio M2PO keeps."""

# -- adaptive IS threshold (rollout_is_target_ess) -----------------------------------------------------
AUTO_IS_THRESHOLD = "auto_is:threshold"
"""MAX: the upper IS bound the step chose (the same on every rank)."""
