"""Held-out evaluation on the rollout engine: sampled and greedy responses scored by the task's reward.

`Evaluator.run(engine, step)` generates, on the engine rank, `eval.num_samples` sampled responses per
held-out prompt (the rollout's temperature/top-p/top-k and response budget, a seed of its own that does not
depend on the step, so two evaluations differ only by the weights) and, with `eval.greedy`, one greedy
response, scores them with the task's reward function (the reward pool when `task.reward_workers >= 1`) and
returns the `eval/*` metrics:

- `eval/reward_mean`, `eval/reward_std`, `eval/response_length_mean`, `eval/truncated_fraction` (sampled);
- `eval/pass_at_1` and `eval/pass_at_<num_samples>` (unbiased estimator, `core.pass_at_k`) when the task has a
  notion of a correct answer (`Task.success_threshold` or `eval.success_threshold`);
- `eval/greedy_reward_mean`, `eval/greedy_response_length_mean`, `eval/greedy_accuracy` (with a notion of
  correctness);
- `eval/num_prompts`, `eval/seconds`.

Held-out prompts come from `eval.dataset` (a file, read like `task.dataset_path`) or the task's held-out
split (`Task.eval_records`, never trained on). Only the engine rank evaluates: the metrics go to the logger
on that rank, so no other rank waits on a collective.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.core.pass_at_k import pass_at_k_mean
from nemo_rollout_correction.harness import metric_names as mn
from nemo_rollout_correction.rollout.options import SamplingOptions
from nemo_rollout_correction.rollout.samples import RolloutBatch
from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine
from nemo_rollout_correction.tasks.builtin import Task
from nemo_rollout_correction.tasks.prompts import PromptRecord, load_prompt_dataset
from nemo_rollout_correction.tasks.rewards import score

# Request seeds of evaluation: far from the training steps' seeds (seed + step * 100_003 + i), below 2**31.
_EVAL_SEED_OFFSET = 1_999_999_973


@dataclass(frozen=True)
class EvalPlan:
    """What one evaluation runs: the held-out prompts, how to sample, and what counts as correct."""

    records: list[PromptRecord]
    sampling: SamplingOptions
    greedy: bool
    success_threshold: float | None
    seed: int


def held_out_records(dataset: str | None, task_records: list[PromptRecord], num_prompts: int, *,
                     prompt_key: str = "prompt", answer_key: str = "answer") -> list[PromptRecord]:
    """The first `num_prompts` records of `eval.dataset`, or the task's held-out split.

    Raises:
        ValueError: no held-out prompts (a task without a split and no `eval.dataset`).
    """
    records = (load_prompt_dataset(dataset, prompt_key=prompt_key, answer_key=answer_key) if dataset is not None
               else task_records)
    if not records:
        raise ValueError("evaluation has no held-out prompts: set eval.dataset=<file.jsonl|file.parquet> "
                         "(the task has no held-out split)")
    return records[:num_prompts]


def _greedy(sampling: SamplingOptions) -> SamplingOptions:
    # Greedy decoding as top-k = 1 sampling: the engine's options refuse temperature 0 (a training rollout
    # needs a distribution to correct), and the argmax token is what top-k 1 keeps.
    return SamplingOptions(n=1, max_tokens=sampling.max_tokens, temperature=1.0, top_p=1.0, top_k=1)


class Evaluator:
    """Runs `EvalPlan` on the rollout engine and turns the rewards into `eval/*` metrics."""

    def __init__(self, plan: EvalPlan, prompt_token_ids: Callable[[PromptRecord], list[int]],
                 reward_fn: Callable[..., Sequence[float]]) -> None:
        self.plan = plan
        self.reward_fn = reward_fn
        self.prompts = [prompt_token_ids(record) for record in plan.records]

    def _generate_and_score(self, engine: VllmRolloutEngine, sampling: SamplingOptions
                            ) -> tuple[RolloutBatch, list[float]]:
        batch = engine.generate(self.prompts, sampling, seed=self.plan.seed)
        records = [self.plan.records[s.prompt_index] for s in batch.samples]
        rewards = score(self.reward_fn, [r.prompt for r in records], [s.text for s in batch.samples], records,
                        [len(s.token_ids) for s in batch.samples])
        return batch, rewards

    def run(self, engine: VllmRolloutEngine) -> dict[str, float]:
        """Evaluate the engine's current weights; returns the `eval/*` metrics (see the module docstring)."""
        start = time.perf_counter()
        plan = self.plan
        batch, rewards = self._generate_and_score(engine, plan.sampling)
        metrics = summarize(rewards, [len(s.token_ids) for s in batch.samples],
                            [s.finish_reason == "length" for s in batch.samples], num_prompts=len(self.prompts),
                            num_samples=plan.sampling.n, success_threshold=plan.success_threshold)
        if plan.greedy:
            greedy, greedy_rewards = self._generate_and_score(engine, _greedy(plan.sampling))
            metrics[mn.EVAL_GREEDY_REWARD_MEAN] = _mean(greedy_rewards)
            metrics[mn.EVAL_GREEDY_RESPONSE_LENGTH_MEAN] = _mean([float(len(s.token_ids)) for s in greedy.samples])
            if plan.success_threshold is not None:
                metrics[mn.EVAL_GREEDY_ACCURACY] = _mean([float(r >= plan.success_threshold) for r in greedy_rewards])
        metrics[mn.EVAL_SECONDS] = time.perf_counter() - start
        return metrics


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def summarize(rewards: Sequence[float], lengths: Sequence[int], truncated: Sequence[bool], *, num_prompts: int,
              num_samples: int, success_threshold: float | None) -> dict[str, float]:
    """The sampled responses' `eval/*` metrics; `rewards` etc. are `[num_prompts * num_samples]`, prompt-major."""
    if len(rewards) != num_prompts * num_samples:
        raise ValueError(f"{len(rewards)} rewards for {num_prompts} prompts x {num_samples} samples")
    reward_t = torch.tensor(list(rewards), dtype=torch.float64)
    metrics = {
        mn.EVAL_REWARD_MEAN: float(reward_t.mean()),
        "eval/reward_std": float(reward_t.std()) if reward_t.numel() > 1 else 0.0,
        mn.EVAL_RESPONSE_LENGTH_MEAN: _mean([float(n) for n in lengths]),
        "eval/truncated_fraction": _mean([float(t) for t in truncated]),
        "eval/num_prompts": float(num_prompts),
    }
    if success_threshold is not None:
        correct = (reward_t >= success_threshold).reshape(num_prompts, num_samples).sum(-1)
        n = torch.full((num_prompts,), num_samples)
        for k in sorted({1, num_samples}):
            metrics[f"eval/pass_at_{k}"] = pass_at_k_mean(n, correct, k)
    return metrics


def eval_prompt_count(cfg: TrainConfig) -> int:
    """Held-out prompts the task must set aside (`build_task(num_eval_prompts=...)`): 0 without evaluation or
    with `eval.dataset`."""
    return cfg.eval.num_prompts if cfg.eval.enabled and cfg.eval.dataset is None else 0


def build_evaluator(cfg: TrainConfig, task: Task, prompt_token_ids: Callable[[PromptRecord], list[int]]
                    ) -> Evaluator | None:
    """The run's evaluator from the `eval` section, or None when evaluation is off."""
    if not cfg.eval.enabled:
        return None
    records = held_out_records(cfg.eval.dataset, task.eval_records, cfg.eval.num_prompts,
                               prompt_key=cfg.task.prompt_key, answer_key=cfg.task.answer_key)
    r = cfg.rollout
    sampling = SamplingOptions(n=cfg.eval.num_samples, max_tokens=r.max_new_tokens, temperature=r.temperature,
                               top_p=r.top_p, top_k=r.top_k)
    threshold = cfg.eval.success_threshold if cfg.eval.success_threshold is not None else task.success_threshold
    plan = EvalPlan(records, sampling, cfg.eval.greedy, threshold, seed=cfg.rollout_seed + _EVAL_SEED_OFFSET)
    return Evaluator(plan, prompt_token_ids, task.reward_fn)


def evaluates_after(cfg: TrainConfig, step: int) -> bool:
    """Whether an evaluation follows step `step` (1-based)."""
    every = cfg.eval.every_n_steps
    return every > 0 and step % every == 0


def format_eval(metrics: dict[str, float]) -> str:
    """One progress line of an evaluation."""
    parts = [f"reward {metrics[mn.EVAL_REWARD_MEAN]:.3f}"]
    parts += [f"{key.removeprefix('eval/')} {value:.3f}" for key, value in sorted(metrics.items())
              if key.startswith(mn.EVAL_PASS_AT_PREFIX)]
    if mn.EVAL_GREEDY_REWARD_MEAN in metrics:
        parts.append(f"greedy reward {metrics[mn.EVAL_GREEDY_REWARD_MEAN]:.3f}")
    parts.append(f"len {metrics[mn.EVAL_RESPONSE_LENGTH_MEAN]:.1f}")
    parts.append(f"{metrics[mn.EVAL_SECONDS]:.1f}s")
    return "  ".join(parts)


__all__ = ["EvalPlan", "Evaluator", "build_evaluator", "eval_prompt_count", "evaluates_after", "format_eval",
           "held_out_records", "summarize"]
