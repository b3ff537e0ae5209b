"""One call per review step: plots + worst-sequences table into `review/step_<n>/`, logged as artifacts."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .arrays import as_1d, same_length
from .mlflow_tracker import MlflowTracker
from .plots import (
    plot_is_weight_histogram,
    plot_mismatch_by_position,
    plot_mismatch_vs_length,
    plot_reward_curve,
    plot_token_probabilities,
)
from .tables import SequenceReview, write_worst_sequences

logger = logging.getLogger("nemo_rollout_correction.tracking")

IS_HISTOGRAM = "is_weights.png"
MISMATCH_VS_LENGTH = "mismatch_vs_length.png"
REWARD_CURVE = "reward.png"
TOKEN_PROBABILITIES = "token_probabilities.png"
MISMATCH_BY_POSITION = "mismatch_by_position.png"
KL_LABEL = "KL(rollout || train) per token, k3 estimator"
WORST_SEQUENCES = "worst_sequences.parquet"


@dataclass(frozen=True)
class RewardHistory:
    """Reward curve so far: `[num_points]` steps, mean reward, optional std."""

    steps: Any
    mean: Any
    std: Any | None = None


@dataclass(frozen=True)
class TokenReview:
    """Per-token data of one step's response tokens, each `[num_tokens]` (one entry per response token).

    trainer_logprobs: the trainer's logprob of the sampled token (old_logprobs, or the loss pass's in bypass
    mode); rollout_logprobs: the engine's; positions: 0-based index of the token in its response.
    """

    trainer_logprobs: Any
    rollout_logprobs: Any
    positions: Any

    @classmethod
    def create(cls, *, trainer_logprobs: Any, rollout_logprobs: Any, positions: Any) -> TokenReview:
        """Convert to 1-D float64 arrays and check the lengths agree."""
        arrays = {name: as_1d(name, value) for name, value in
                  (("trainer_logprobs", trainer_logprobs), ("rollout_logprobs", rollout_logprobs),
                   ("positions", positions))}
        same_length(**arrays)
        return cls(**arrays)


def review_dir_name(step: int) -> str:
    """`step_000012`: zero-padded so the MLflow artifact browser lists steps in order."""
    return f"step_{step:06d}"


def write_review_artifacts(
    out_dir: Path | str,
    step: int,
    *,
    raw_is_weights: Any,
    applied_is_weights: Any,
    sequences: SequenceReview,
    rewards: RewardHistory | None = None,
    tokens: TokenReview | None = None,
    top_k: int = 16,
    sort_by: str = "max_abs_log_ratio",
    mismatch: str = "kl",
) -> Path:
    """Write the review files of one step into `<out_dir>/step_<n>/` and return that directory.

    Args:
        raw_is_weights / applied_is_weights: `[num_kept_tokens]` IS weights before bounding and as applied.
        sequences: per-sequence data of the step (`[num_sequences]` each).
        rewards: reward history for the curve (skipped when None).
        tokens: per-token logprobs for the token-probability and by-position plots (skipped when None).
        top_k / sort_by: worst-sequences table size (0: no table) and ranking key (see tables.SORT_KEYS).
        mismatch: y of the length plot: "kl" (`sequences.kl`, the per-token k3 estimate of KL(rollout || train),
            non-negative) or "mean_abs_log_ratio" (|seq log-ratio sum| / length).
    """
    import numpy as np

    directory = Path(out_dir) / review_dir_name(step)
    directory.mkdir(parents=True, exist_ok=True)
    plot_is_weight_histogram(raw_is_weights, applied_is_weights, directory / IS_HISTOGRAM,
                             title=f"IS weights, step {step}")
    if mismatch == "kl":
        y, label = sequences.kl, KL_LABEL
    elif mismatch == "mean_abs_log_ratio":
        lengths = np.maximum(sequences.response_lengths, 1)
        y, label = np.abs(sequences.seq_log_ratio_sum) / lengths, "|seq log ratio| / length"
    else:
        raise ValueError(f"mismatch={mismatch!r}: allowed 'kl', 'mean_abs_log_ratio'")
    plot_mismatch_vs_length(sequences.response_lengths, y, directory / MISMATCH_VS_LENGTH, mismatch_label=label,
                            title=f"{label} vs length, step {step}")
    if rewards is not None:
        plot_reward_curve(rewards.steps, rewards.mean, directory / REWARD_CURVE, std=rewards.std)
    if tokens is not None:
        plot_token_probabilities(tokens.trainer_logprobs, tokens.rollout_logprobs, directory / TOKEN_PROBABILITIES,
                                 title=f"token probabilities, step {step}")
        plot_mismatch_by_position(tokens.positions, tokens.trainer_logprobs, tokens.rollout_logprobs,
                                  directory / MISMATCH_BY_POSITION, title=f"mismatch by token position, step {step}")
    if top_k > 0:  # tracking.worst_sequences=0 turns the table off
        write_worst_sequences(sequences, step, directory / WORST_SEQUENCES, top_k=top_k, sort_by=sort_by)
    return directory


def log_review_artifacts(
    tracker: MlflowTracker,
    step: int,
    *,
    raw_is_weights: Any,
    applied_is_weights: Any,
    sequences: SequenceReview,
    rewards: RewardHistory | None = None,
    tokens: TokenReview | None = None,
    top_k: int = 16,
    sort_by: str = "max_abs_log_ratio",
    mismatch: str = "kl",
    out_dir: Path | str | None = None,
) -> Path | None:
    """Write the review files (see write_review_artifacts) and log them as artifacts `review/step_<n>/`.

    Files go to `out_dir` (default `<run_dir>/review/`). Only the active rank writes; others return None.
    A failure while writing (a plotting corner case, a full disk) is logged with its traceback and returns
    None: review files are diagnostics and must not end a training run.
    """
    if not tracker.active:
        return None
    try:
        directory = write_review_artifacts(
            out_dir if out_dir is not None else tracker.run_dir / "review",
            step,
            raw_is_weights=raw_is_weights,
            applied_is_weights=applied_is_weights,
            sequences=sequences,
            rewards=rewards,
            tokens=tokens,
            top_k=top_k,
            sort_by=sort_by,
            mismatch=mismatch,
        )
    except Exception:
        logger.exception("writing review artifacts for step %d failed; training continues without them", step)
        return None
    tracker.log_artifact(directory, f"review/{review_dir_name(step)}")
    return directory
