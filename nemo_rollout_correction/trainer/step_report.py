"""`StepReport`: what a finished step reports, its metrics (`metrics.jsonl`, the observer) and its review.

What it owns: the step's timer (`StepTimer`), the metric values built from the step's records (the rollouts,
the rewards, the `Update`s of `trainer/policy_update.py`, the engines' refit seconds), the per-sequence review
the observer plots (`StepReview`), the `metrics.jsonl` file and the calls to the observer. Metric names are the
constants of `harness/metric_names.py`. It touches no model, optimizer or engine: every input is handed to it.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nemo_rollout_correction.core.sequence_stats import sequence_mean_k3
from nemo_rollout_correction.distributed.context_parallel import gather_cp_tokens
from nemo_rollout_correction.distributed.groups import ParallelGroups
from nemo_rollout_correction.harness import metric_names as mn
from nemo_rollout_correction.harness.scoring import sequence_log_ratios
from nemo_rollout_correction.losses.step_plan import OBJECTIVE_SUMS
from nemo_rollout_correction.rollout.multi_turn import multi_turn_counts
from nemo_rollout_correction.rollout.partial import staleness_metrics_from_sums
from nemo_rollout_correction.rollout.samples import RolloutBatch
from nemo_rollout_correction.tasks.prompts import PromptRecord
from nemo_rollout_correction.trainer.mismatch_alert import MismatchAlarm
from nemo_rollout_correction.trainer.observer import StepReview, TrainObserver
from nemo_rollout_correction.trainer.policy_update import Microbatch, Scored, Update

__all__ = ["PHASES", "StepReport", "StepTimer"]

PHASES = ("generation", "old_logprob", "ref_logprob", "correction", "train")
"""Phases timed every step (`timing/<phase>_s`, 0 when a step skips one); `rollout_wait`, `refit` and `step`
are added when they run."""


class StepTimer:
    """Seconds per phase of one step (`timing/<phase>_s`); a phase may repeat and its seconds add up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the seconds spent inside to phase `name`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def record(self, seconds: dict[str, float]) -> None:
        """Set phases measured elsewhere (the fleet's `generation`, `rollout_wait`)."""
        self.seconds.update(seconds)


class StepReport:
    """The step's metrics and review, written to `metrics.jsonl` and handed to the observer (module docstring).

    Args:
        groups: this rank's parallel groups (the review's rows are the logging rank's, dp rank 0).
        observer: the run's observer (a `NullObserver` off the logging rank).
        metrics_path: `<run.output_dir>/metrics.jsonl`, written by the logging rank (`is_main`).
        ppo_epochs: `grpo.ppo_epochs` (a clip fraction per epoch when > 1).
        num_engines: the fleet's engines (`rollout/num_engines`).
        alarm: the mismatch alarm (`rollout_correction.alert`, trainer/mismatch_alert.py); None: off.
    """

    def __init__(self, groups: ParallelGroups, observer: TrainObserver, metrics_path: Path, *, is_main: bool,
                 ppo_epochs: int, num_engines: int, alarm: MismatchAlarm | None = None) -> None:
        self.groups, self.observer, self.metrics_path, self.is_main = groups, observer, metrics_path, is_main
        self.ppo_epochs, self.num_engines, self.alarm = ppo_epochs, num_engines, alarm

    # ---- metrics ------------------------------------------------------------------------------------------

    def metrics(self, batch: RolloutBatch, rewards: Tensor, updates: Sequence[Update], timings: dict[str, float],
                engine_refit_seconds: Sequence[float], refit_verified: bool = False) -> dict[str, float]:
        """The step's metrics; loss, policy and `rollout_corr/*` values average over the step's updates.

        `refit_verified`: whether the engine's latest weight sync was verified (`RolloutFleet.refit_verified`).
        """

        def mean(values: list[float]) -> float:
            return sum(values) / max(len(values), 1)

        def clipfrac(update: Update, key: str = "pg_clipfrac_sum") -> float:
            return update.result.sums[key] / max(update.result.sums["num_tokens"], 1.0)

        num_tokens = max(sum(u.result.sums["num_tokens"] for u in updates), 1.0)
        lengths = torch.tensor([len(s.token_ids) for s in batch.samples], dtype=torch.float32)
        metrics: dict[str, float] = {
            mn.REWARD_MEAN: float(rewards.mean()),
            mn.REWARD_STD: float(rewards.std()) if rewards.numel() > 1 else 0.0,
            mn.REWARD_MAX: float(rewards.max()),
            mn.REWARD_MIN: float(rewards.min()),
            mn.RESPONSE_LENGTH_MEAN: float(lengths.mean()),
            mn.RESPONSE_LENGTH_MAX: float(lengths.max()),
            mn.RESPONSE_TRUNCATED_FRACTION: (sum(s.finish_reason == "length" for s in batch.samples)
                                             / len(batch.samples)),
            mn.PERF_NUM_SAMPLES: float(len(batch.samples)),
            mn.PERF_NUM_GENERATED_TOKENS: float(batch.num_generated_tokens),
            mn.PERF_GENERATION_TOKENS_PER_S: batch.num_generated_tokens / max(timings["generation"], 1e-9),
            mn.OPTIM_NUM_UPDATES: float(len(updates)),
            mn.ROLLOUT_NUM_ENGINES: float(self.num_engines),
        }
        if any(s.turn_ids is not None for s in batch.samples):  # multi-turn rollouts (docs/multi_turn.md)
            turns, observed, total = multi_turn_counts([s.turn_ids for s in batch.samples])
            metrics |= {mn.MULTI_TURN_NUM_TURNS_MEAN: sum(turns) / len(turns),
                        mn.MULTI_TURN_NUM_TURNS_MAX: float(max(turns)),
                        mn.MULTI_TURN_OBSERVATION_TOKENS_FRAC: observed / max(total, 1)}
        # each engine's latest weight load (shared-buffer refit on CPU), as reported with this step's rollouts
        for engine, seconds in enumerate(engine_refit_seconds):
            metrics[mn.engine_refit(engine)] = seconds
        metrics[mn.ROLLOUT_REFIT_VERIFIED] = float(refit_verified)
        metrics.update({mn.timing(k): v for k, v in timings.items()})
        metrics[mn.TIMING_CORRECTION_FRACTION] = timings["correction"] / max(timings["step"], 1e-9)
        if not updates:  # a skipped update (DAPO: no group with reward variance) has no loss or optimizer metrics
            return metrics
        last = updates[-1].applied
        metrics |= {
            mn.LOSS_POLICY: mean([u.result.sums["loss"] for u in updates]),
            mn.LOSS_KL_PENALTY: mean([u.result.sums["kl_penalty"] for u in updates]),
            mn.LOSS_PG_CLIPFRAC: mean([clipfrac(u) for u in updates]),
            mn.LOSS_PG_CLIPFRAC_LOWER: mean([clipfrac(u, "pg_clipfrac_lower_sum") for u in updates]),
            mn.LOSS_PPO_KL: mean([clipfrac(u, "ppo_kl_sum") for u in updates]),
            mn.LOSS_GRAD_NORM: mean([u.applied.grad_norm for u in updates]),
            mn.OPTIM_LR: last.lr,
            mn.OPTIM_LOSS_SCALE: last.loss_scale,
            mn.OPTIM_SKIPPED_UPDATES: float(sum(u.applied.skipped for u in updates)),
            mn.OPTIM_OLD_LOGPROBS_REUSED: float(updates[0].reused_old_logprobs),
            mn.PERF_TRAIN_TOKENS_PER_S: num_tokens / max(timings["train"], 1e-9),
        }
        for key in OBJECTIVE_SUMS:  # the configured objective's own (CISPO weight, rollout penalty), per loss token
            if key in updates[0].result.sums:
                metrics[mn.objective(key)] = mean([clipfrac(u, key) for u in updates])
        epochs = self.ppo_epochs
        if epochs > 1:  # the PPO clip acts from the second pass on: its clip fraction per epoch
            per_epoch = len(updates) // epochs
            for epoch in range(epochs):
                chunk = updates[epoch * per_epoch:(epoch + 1) * per_epoch]
                metrics[mn.pg_clipfrac_epoch(epoch + 1)] = mean([clipfrac(u) for u in chunk])
        for key in updates[0].result.rc_metrics:
            metrics[key] = mean([float(u.result.rc_metrics[key]) for u in updates])
        sums = updates[0].result.sums  # the mismatch by turn, before the step's first update (multi-turn)
        for turn in range(sum(1 for key in sums if key.endswith("/sum_k3") and key.startswith("turn_"))):
            count = sums[f"turn_{turn}/num_tokens"]
            metrics[mn.turn_mismatch(turn, "num_tokens")] = count
            metrics[mn.turn_mismatch(turn, "k3_kl")] = sums[f"turn_{turn}/sum_k3"] / max(count, 1.0)
            metrics[mn.turn_mismatch(turn, "log_ratio_abs_mean")] = (sums[f"turn_{turn}/sum_abs_log_ratio"]
                                                                    / max(count, 1.0))
        # per-token staleness and the mismatch by staleness of the trained tokens (async / partial rollouts)
        metrics |= staleness_metrics_from_sums(sums)
        if "loglinear_num_tokens" in updates[0].result.sums:  # a loglinear check step: error vs the forward
            counts = [max(u.result.sums["loglinear_num_tokens"], 1.0) for u in updates]
            metrics[mn.LOGLINEAR_ABS_ERROR_MEAN] = mean(
                [u.result.sums["loglinear_abs_error_sum"] / n for u, n in zip(updates, counts, strict=True)])
            metrics[mn.LOGLINEAR_RMSE] = mean(
                [math.sqrt(u.result.sums["loglinear_sq_error_sum"] / n) for u, n in zip(updates, counts, strict=True)])
        return metrics

    # ---- the review ---------------------------------------------------------------------------------------

    def wants_review(self, step: int) -> bool:
        """Whether the review of step `step` (1-based) is built: with PP or CP every step (small; the other ranks
        cannot see the observer), otherwise only when the observer asks for one."""
        return self.groups.pp_size > 1 or self.groups.cp_size > 1 or self.observer.wants_review(step)

    def review(self, step: int, batch: RolloutBatch, mini_batches: list[list[Microbatch]],
               scored: Sequence[Scored], updates: Sequence[Update], rewards: Tensor,
               records: list[PromptRecord]) -> StepReview:
        """Per-sequence mismatch detail of this rank's rows (the logging rank's slice; last pipeline stage).

        The trainer's logprobs of a row are pi_old where the step has one (decoupled: the forward's; loglinear:
        the last loss pass's interpolation), else those of the step's first loss pass over it (bypass mode: the
        policy before this step's update). Corrections are those of the first epoch's plans.
        """
        num_minis = len(mini_batches)
        plans = [update.plan for update in updates[:num_minis]]
        corrections = None
        if all(plan.corrections is not None for plan in plans):
            corrections = [c for plan in plans for c in plan.corrections or ()]
        microbatches = [mb for mini in mini_batches for mb in mini]
        first_pass = [p for update in updates[:num_minis] for p in update.passes]
        last_pass = [p for update in updates[len(updates) - num_minis:] for p in update.passes]
        references = [s.old_logprobs if s.old_logprobs is not None
                      else last.old_logprobs if last.old_logprobs is not None else first.logprobs
                      for s, first, last in zip(scored, first_pass, last_pass, strict=True)]
        return self._review(step, batch, microbatches, references, corrections, rewards, records)

    def _review(self, step: int, batch: RolloutBatch, microbatches: list[Microbatch], references: list[Tensor],
                corrections: list[Any] | None, rewards: Tensor, records: list[PromptRecord]) -> StepReview:
        raw, applied, seq_lr, seq_max, seq_kl, seq_w, lengths, kept, rows = [], [], [], [], [], [], [], [], []
        tok_train, tok_roll, tok_pos = [], [], []
        for i, (mb, reference) in enumerate(zip(microbatches, references, strict=True)):
            rollout = mb.rollout_logprobs
            keep = corrections[i].keep_mask if corrections is not None else mb.loss_mask
            weights = corrections[i].is_weights if corrections is not None else torch.ones_like(reference)
            mask = mb.loss_mask
            if self.groups.cp_size > 1:  # whole sequences from every CP rank's share
                reference, rollout, keep, weights, mask = (gather_cp_tokens(x, self.groups)
                                                           for x in (reference, rollout, keep, weights, mask))
            ratios = sequence_log_ratios(reference, rollout, mask, nonfinite="zero")
            log_ratio = ratios.log_ratio
            raw.append(log_ratio.clamp(-20, 20).exp()[keep])
            applied.append(weights[keep])
            seq_lr.append(ratios.seq_log_ratio)
            seq_max.append(ratios.seq_max_abs_log_ratio)
            seq_kl.append(sequence_mean_k3(log_ratio, mask))
            seq_w.append(seq_lr[-1].clamp(-20, 20).exp())
            lengths.append(mask.sum(-1))
            kept.append(keep.any(-1))
            rows.append(mb.rows)
            tok_train.append(reference[mask])
            tok_roll.append(rollout[mask])
            tok_pos.append((mask.cumsum(-1) - 1)[mask])  # index of each response token in its response
        idx = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
        samples = [batch.samples[int(r)] for r in idx]
        return StepReview(
            step=step,
            raw_is_weights=torch.cat(raw) if raw else torch.zeros(0),
            applied_is_weights=torch.cat(applied) if applied else torch.zeros(0),
            seq_log_ratio=torch.cat(seq_lr) if seq_lr else torch.zeros(0),
            seq_max_abs_log_ratio=torch.cat(seq_max) if seq_max else torch.zeros(0),
            seq_kl=torch.cat(seq_kl) if seq_kl else torch.zeros(0),
            seq_is_weight=torch.cat(seq_w) if seq_w else torch.zeros(0),
            response_lengths=torch.cat(lengths) if lengths else torch.zeros(0),
            kept=torch.cat(kept) if kept else torch.zeros(0, dtype=torch.bool),
            rewards=rewards[idx],
            prompts=[records[s.prompt_index].prompt for s in samples],
            responses=[s.text for s in samples],
            token_trainer_logprobs=torch.cat(tok_train) if tok_train else torch.zeros(0),
            token_rollout_logprobs=torch.cat(tok_roll) if tok_roll else torch.zeros(0),
            token_positions=torch.cat(tok_pos) if tok_pos else torch.zeros(0, dtype=torch.int64),
        )

    # ---- output -------------------------------------------------------------------------------------------

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Append a row to `metrics.jsonl`: a local record of every step, independent of the tracking server."""
        if self.is_main:
            with self.metrics_path.open("a") as handle:
                handle.write(json.dumps({"step": step, **metrics}) + "\n")

    def rewind(self, step: int) -> str | None:
        """On resume from the checkpoint of `step`: move the `metrics.jsonl` rows of later steps (recorded by the
        run that died before its next checkpoint, and about to be run again) to `metrics.after_step_<step>.jsonl`,
        so `metrics.jsonl` holds each step once. Returns a line saying what moved (None: nothing to move)."""
        if not self.is_main or not self.metrics_path.is_file():
            return None
        kept: list[str] = []
        later: list[str] = []
        for line in self.metrics_path.read_text().splitlines(keepends=True):
            try:
                row_step = int(json.loads(line).get("step", 0))
            except (ValueError, AttributeError):  # a torn last line of the crashed run: not a step of this run
                row_step = step + 1
            (later if row_step > step else kept).append(line)
        if not later:
            return None
        aside = self.metrics_path.with_name(f"metrics.after_step_{step}.jsonl")
        with aside.open("a") as handle:  # a second crash after the same checkpoint appends, nothing is lost
            handle.writelines(later)
        tmp = self.metrics_path.with_name(self.metrics_path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(self.metrics_path)
        return (f"[nrc train] {self.metrics_path.name}: {len(later)} rows recorded after the step-{step} checkpoint "
                f"moved to {aside.name} (those steps run again)")

    def publish(self, step: int, metrics: dict[str, float], review: StepReview | None) -> None:
        """Report step `step` (1-based): the mismatch alarm, `metrics.jsonl`, then the observer (with the review on
        its review steps); collective when the alarm is strict."""
        if not self.observer.wants_review(step):
            review = None
        if self.alarm is not None:  # warns, tags the run and adds `alert/mismatch` before the metrics are written
            self.alarm.check_step(step, metrics, self.observer)
        self.write(step, metrics)
        self.observer.on_step(step, metrics, review)
        if self.alarm is not None:  # alert.strict: every rank stops here, the step's record complete
            self.alarm.stop_if_strict(step)
