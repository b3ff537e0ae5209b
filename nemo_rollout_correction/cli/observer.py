"""The MLflow-backed `TrainObserver`: step metrics, the resolved config, tags and review artifacts.

Glue between the trainer and the tracking layer (independent siblings in docs/design.md's layering), so it
lives in the CLI. Runs on the logging rank only.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

from nemo_rollout_correction.cli.failures import explain
from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.harness import metric_names as mn
from nemo_rollout_correction.tracking import MlflowTracker
from nemo_rollout_correction.tracking.review import RewardHistory, SequenceReview, TokenReview, log_review_artifacts
from nemo_rollout_correction.trainer.observer import StepReview


class MlflowObserver:
    """Forwards the trainer's reports to an `MlflowTracker` (started by the caller, so failures surface early)."""

    def __init__(self, cfg: TrainConfig, tracker: MlflowTracker) -> None:
        self.cfg = cfg
        self.tracker = tracker
        self.reward_steps: list[int] = []
        self.reward_means: list[float] = []
        self.reward_stds: list[float] = []

    def on_start(self, resolved_config: dict[str, Any], resume_state: dict[str, Any] | None) -> None:
        """Restore the reward curve on resume (the CLI logged the resolved config when the tracker started)."""
        if resume_state:
            self.reward_steps = list(resume_state.get("reward_steps", []))
            self.reward_means = list(resume_state.get("reward_means", []))
            self.reward_stds = list(resume_state.get("reward_stds", []))

    def wants_review(self, step: int) -> bool:
        """Review artifacts every `tracking.plot_every` steps (0 disables them)."""
        every = self.cfg.tracking.plot_every
        return every > 0 and step % every == 0

    def on_step(self, step: int, metrics: dict[str, float], review: StepReview | None) -> None:
        """Log the step's metrics (buffered through outages) and, on review steps, plots and tables."""
        self.reward_steps.append(step)
        self.reward_means.append(metrics[mn.REWARD_MEAN])
        self.reward_stds.append(metrics[mn.REWARD_STD])
        self.tracker.log_metrics(metrics, step=step)
        if review is None:
            return
        sequences = SequenceReview.create(
            prompts=review.prompts, responses=review.responses, response_lengths=review.response_lengths.numpy(),
            seq_log_ratio_sum=review.seq_log_ratio.double().numpy(),
            max_abs_log_ratio=review.seq_max_abs_log_ratio.double().numpy(), kl=review.seq_kl.double().numpy(),
            is_weight=review.seq_is_weight.double().numpy(), kept=review.kept.numpy(),
            reward=review.rewards.double().numpy())
        tokens = None
        if review.token_trainer_logprobs is not None and review.token_rollout_logprobs is not None \
                and review.token_positions is not None:
            tokens = TokenReview.create(trainer_logprobs=review.token_trainer_logprobs.double().numpy(),
                                        rollout_logprobs=review.token_rollout_logprobs.double().numpy(),
                                        positions=review.token_positions.double().numpy())
        log_review_artifacts(
            self.tracker, step, raw_is_weights=review.raw_is_weights.double().numpy(),
            applied_is_weights=review.applied_is_weights.double().numpy(), sequences=sequences,
            rewards=RewardHistory(self.reward_steps, self.reward_means, self.reward_stds), tokens=tokens,
            top_k=self.cfg.tracking.worst_sequences, out_dir=Path(self.cfg.run.output_dir) / "review")

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Log an evaluation made outside a step (before training: step 0)."""
        self.tracker.log_metrics(metrics, step=step)

    def on_alert(self, step: int, tags: dict[str, str]) -> None:
        """Tag the run with the mismatch alarm's message (the latest firing step), first step and count."""
        self.tracker.set_tags(tags)

    def checkpoint_state(self) -> dict[str, Any]:
        """The MLflow run id (a resumed run continues it) and the reward curve so far."""
        return {"mlflow_run_id": self.tracker.run_id, "reward_steps": self.reward_steps,
                "reward_means": self.reward_means, "reward_stds": self.reward_stds}

    def on_end(self, status: str) -> None:
        """Flush and close the MLflow run with `status`; a run that ends on an exception records it first."""
        # The trainer calls on_end from its `finally`, so the exception ending the run is the one in flight.
        error = sys.exception()
        if status != "FINISHED" and error is not None:
            record_error(self.tracker, error, Path(self.cfg.run.output_dir), explain(error, self.cfg))
        self.tracker.close(status)  # type: ignore[arg-type]


def record_error(tracker: MlflowTracker, error: BaseException, output_dir: Path, line: str | None = None) -> None:
    """Record why a run failed: tag `nrc.error` (`line`, an expected failure's clear line from `cli.failures`, else
    "Type: message") and artifact `error/traceback.txt`.

    Goes through the tracker's journal like every record, so it survives a tracking outage too.
    """
    tracker.set_tags({"nrc.error": line or f"{type(error).__name__}: {error}"})
    path = output_dir / "error" / "traceback.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(error)), encoding="utf-8")
        tracker.log_artifact(path, "error")
    except OSError:  # the tag already says what failed; a full disk must not hide the original error
        pass


__all__ = ["MlflowObserver", "record_error"]
