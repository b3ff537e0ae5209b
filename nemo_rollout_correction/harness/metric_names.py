"""Names of the metrics the trainer emits (`metrics.jsonl`, MLflow) and that other code reads: one constant each.

The trainer (`trainer/step_report.py`) writes these names; the console (`trainer/console.py`), the MLflow
observer (`cli/observer.py`) and the audit (`audit/mismatch.py`) read them. A string typed twice could drift
(a typo read through `.get(key, default)` showed 0.0 silently); every reader names a constant from here and
indexes the metrics (`metrics[KEY]`, a missing key raises). Keys a step emits only under some configurations
are read with `optional`, which still refuses a name that is not listed here. docs/metrics.md documents every
key (tests/unit/test_metrics_documented.py checks it against what a real step emits).
"""

from __future__ import annotations

from collections.abc import Mapping

# -- every step ------------------------------------------------------------------------------------------
REWARD_MEAN = "reward/mean"
REWARD_STD = "reward/std"
REWARD_MAX = "reward/max"
REWARD_MIN = "reward/min"
RESPONSE_LENGTH_MEAN = "response/length_mean"
RESPONSE_LENGTH_MAX = "response/length_max"
RESPONSE_TRUNCATED_FRACTION = "response/truncated_fraction"
PERF_NUM_SAMPLES = "perf/num_samples"
PERF_NUM_GENERATED_TOKENS = "perf/num_generated_tokens"
PERF_GENERATION_TOKENS_PER_S = "perf/generation_tokens_per_s"
OPTIM_NUM_UPDATES = "optim/num_updates"
OPTIM_OLD_LOGPROBS_REUSED = "optim/old_logprobs_reused"
ROLLOUT_NUM_ENGINES = "rollout/num_engines"
ROLLOUT_REFIT_VERIFIED = "rollout/refit_verified"
TIMING_CORRECTION_FRACTION = "timing/correction_fraction"
TIMING_GENERATION = "timing/generation_s"
TIMING_TRAIN = "timing/train_s"

# -- steps with an optimizer update (a DAPO-skipped step has none of these) ------------------------------------
LOSS_POLICY = "loss/policy"
LOSS_KL_PENALTY = "loss/kl_penalty"
LOSS_PG_CLIPFRAC = "loss/pg_clipfrac"
LOSS_PG_CLIPFRAC_LOWER = "loss/pg_clipfrac_lower"
LOSS_PPO_KL = "loss/ppo_kl"
LOSS_GRAD_NORM = "loss/grad_norm"
OPTIM_LR = "optim/lr"
OPTIM_LOSS_SCALE = "optim/loss_scale"
OPTIM_SKIPPED_UPDATES = "optim/skipped_updates"
PERF_TRAIN_TOKENS_PER_S = "perf/train_tokens_per_s"
LOGLINEAR_ABS_ERROR_MEAN = "rollout_corr/loglinear_abs_error_mean"
LOGLINEAR_RMSE = "rollout_corr/loglinear_rmse"

# -- partial rollouts (rollout.partial_max_tokens_per_step; rollout/partial.py, trainer/partial_rollouts.py) ----
ROLLOUT_MIXED_VERSION_FRACTION = "rollout/mixed_version_fraction"
ROLLOUT_TOKEN_STALENESS_MEAN = "rollout/token_staleness_mean"
ROLLOUT_TOKEN_STALENESS_MAX = "rollout/token_staleness_max"
ROLLOUT_CARRIED_OVER_FRACTION = "rollout/carried_over_fraction"
ROLLOUT_PARTIAL_FORCED_FRACTION = "rollout/partial_forced_fraction"
ROLLOUT_PARTIAL_POOL_GROUPS = "rollout/partial_pool_groups"

# -- rollout correction (core/metrics.py writes them without the prefix; docs/metrics.md) ----------------------
RC_KL = "rollout_corr/kl"
RC_K3_KL = "rollout_corr/k3_kl"
RC_KEPT_TOKEN_FRACTION = "rollout_corr/kept_token_fraction"
RC_NUM_VALID_SEQS = "rollout_corr/num_valid_seqs"
RC_NUM_KEPT_SEQS = "rollout_corr/num_kept_seqs"
RC_IS_EFF_SAMPLE_SIZE = "rollout_corr/rollout_is_eff_sample_size"
RC_IS_RATIO_FRACTION_HIGH = "rollout_corr/rollout_is_ratio_fraction_high"
RC_IS_RATIO_FRACTION_LOW = "rollout_corr/rollout_is_ratio_fraction_low"
RC_IS_SEQ_FRACTION_HIGH = "rollout_corr/rollout_is_seq_fraction_high"
RC_IS_SEQ_FRACTION_LOW = "rollout_corr/rollout_is_seq_fraction_low"
RC_RS_MASKED_FRACTION = "rollout_corr/rollout_rs_masked_fraction"
RC_VETO_FRACTION = "rollout_corr/veto_fraction"
RC_TOKEN_LOG_RATIO_MAX = "rollout_corr/token_log_ratio_max"
RC_TOKEN_LOG_RATIO_MIN = "rollout_corr/token_log_ratio_min"
ALERT_MISMATCH = "alert/mismatch"  # trainer/mismatch_alert.py

# -- evaluation (trainer/evaluation.py) ------------------------------------------------------------------------
EVAL_REWARD_MEAN = "eval/reward_mean"
EVAL_GREEDY_REWARD_MEAN = "eval/greedy_reward_mean"
EVAL_GREEDY_RESPONSE_LENGTH_MEAN = "eval/greedy_response_length_mean"
EVAL_GREEDY_ACCURACY = "eval/greedy_accuracy"
EVAL_RESPONSE_LENGTH_MEAN = "eval/response_length_mean"
EVAL_SECONDS = "eval/seconds"
EVAL_PASS_AT_PREFIX = "eval/pass_at_"


def timing(phase: str) -> str:
    """`timing/<phase>_s`: seconds of one phase of the step."""
    return f"timing/{phase}_s"


def engine_refit(engine: int) -> str:
    """`rollout/engine<e>_refit_s`: engine e's latest weight load, as reported with the step's rollouts."""
    return f"rollout/engine{engine}_refit_s"


def objective(sum_key: str) -> str:
    """`loss/<name>` of an objective's per-token partial sum `<name>_sum` (`losses.step_plan.objective_sum_keys`)."""
    return f"loss/{sum_key.removesuffix('_sum')}"


def pg_clipfrac_epoch(epoch: int) -> str:
    """`loss/pg_clipfrac_epoch<k>`: the PPO clip fraction of the k-th (1-based) pass over the step's rollouts."""
    return f"loss/pg_clipfrac_epoch{epoch}"


# -- multi-turn rollouts (rollout/multi_turn.py) ---------------------------------------------------------------
MULTI_TURN_NUM_TURNS_MEAN = "multi_turn/num_turns_mean"
MULTI_TURN_NUM_TURNS_MAX = "multi_turn/num_turns_max"
MULTI_TURN_OBSERVATION_TOKENS_FRAC = "multi_turn/observation_tokens_frac"
TURN_MISMATCH_NAMES = ("k3_kl", "log_ratio_abs_mean", "num_tokens")


def turn_mismatch(turn: int, name: str) -> str:
    """`rollout_corr/turn_<k>/<name>` (`name` in `TURN_MISMATCH_NAMES`): the mismatch of the tokens of turn k."""
    return f"rollout_corr/turn_{turn}/{name}"


KNOWN: frozenset[str] = frozenset(value for name, value in dict(globals()).items()
                                  if name.isupper() and isinstance(value, str) and name != "EVAL_PASS_AT_PREFIX")
"""Every fixed name above (the `timing/*`, per-engine and per-epoch families are built by the functions)."""


def optional(metrics: Mapping[str, float], key: str, absent: float) -> float:
    """`metrics[key]`, or `absent` where this step legitimately has no such key (a skipped update, a correction
    without IS or RS). `key` must be one of the names above: a typo raises instead of reading `absent`."""
    if key not in KNOWN:
        raise KeyError(f"{key!r} is not a metric name of harness/metric_names.py")
    return float(metrics[key]) if key in metrics else absent


__all__ = [name for name in dir() if name.isupper()] + [
    "engine_refit", "objective", "optional", "pg_clipfrac_epoch", "timing", "turn_mismatch"]
