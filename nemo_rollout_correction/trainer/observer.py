"""What the trainer reports, and to whom: the `TrainObserver` protocol and the per-step review data.

The trainer does not import the tracking layer (they are independent siblings in docs/design.md's layering);
the CLI plugs an MLflow-backed observer in. Every observer method runs on the logging rank only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor


@dataclass
class StepReview:
    """Per-step detail for review artifacts (plots, worst-sequence tables); built only when asked for.

    raw_is_weights / applied_is_weights: `[num_kept_tokens]` token IS ratios exp(old - rollout) before and
        after truncation/masking, over kept tokens of this rank's rows.
    seq_log_ratio / seq_max_abs_log_ratio / seq_is_weight: `[num_rows]` per-sequence mismatch; seq_kl:
        `[num_rows]` mean over the row's response tokens of the k3 estimate of KL(rollout || train),
        exp(r) - 1 - r with r = log(pi_train / pi_rollout) (non-negative; computed in float64).
    response_lengths: `[num_rows]`; kept: `[num_rows]` whether any token of the row was kept.
    rewards: `[num_rows]`; prompts / responses: the texts of the rows.
    token_trainer_logprobs / token_rollout_logprobs / token_positions: `[num_response_tokens]` one entry per
        response token of the rows (row-major): the trainer's and the engine's logprob of the sampled token
        (may be non-finite) and its 0-based index in the response.
    """

    step: int
    raw_is_weights: Tensor
    applied_is_weights: Tensor
    seq_log_ratio: Tensor
    seq_max_abs_log_ratio: Tensor
    seq_kl: Tensor
    seq_is_weight: Tensor
    response_lengths: Tensor
    kept: Tensor
    rewards: Tensor
    prompts: list[str] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    token_trainer_logprobs: Tensor | None = None
    token_rollout_logprobs: Tensor | None = None
    token_positions: Tensor | None = None


class TrainObserver(Protocol):
    """Receives the run's configuration, step metrics and review data (logging rank only)."""

    def on_start(self, resolved_config: dict[str, Any], resume_state: dict[str, Any] | None) -> None:
        """Called once before the first step (also on resume, with the state saved by `checkpoint_state`)."""

    def wants_review(self, step: int) -> bool:
        """Whether `on_step` should receive a `StepReview` for `step`."""

    def on_step(self, step: int, metrics: dict[str, float], review: StepReview | None) -> None:
        """Step metrics (`reward/`, `loss/`, `rollout_corr/`, `timing/`, `perf/` prefixes) after step `step`."""

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        """`eval/*` metrics of an evaluation outside a step (before training: step 0); in-step ones come
        with `on_step`."""

    def on_alert(self, step: int, tags: dict[str, str]) -> None:
        """The mismatch alarm fired at step `step` (trainer/mismatch_alert.py): run tags naming what fired."""

    def checkpoint_state(self) -> dict[str, Any]:
        """State to store in checkpoints so a resumed run continues the same record (e.g. the MLflow run id)."""

    def on_end(self, status: str) -> None:
        """Called once at the end: "FINISHED", "FAILED" or "KILLED"; must flush everything."""


class NullObserver:
    """Logs nothing (tracking disabled, or a non-logging rank)."""

    def on_start(self, resolved_config: dict[str, Any], resume_state: dict[str, Any] | None) -> None:
        """Nothing to set up."""

    def wants_review(self, step: int) -> bool:
        """Never."""
        return False

    def on_step(self, step: int, metrics: dict[str, float], review: StepReview | None) -> None:
        """Drop the metrics."""

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Drop the metrics."""

    def on_alert(self, step: int, tags: dict[str, str]) -> None:
        """Drop the tags."""

    def checkpoint_state(self) -> dict[str, Any]:
        """No state."""
        return {}

    def on_end(self, status: str) -> None:
        """Nothing to flush."""


__all__ = ["NullObserver", "StepReview", "TrainObserver"]
