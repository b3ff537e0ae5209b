"""Partial rollouts in the synchronous step (`rollout.partial_max_tokens_per_step = B > 0`): the fleet's driver.

`rollout/partial.py` keeps the pool of carried-over groups and the step's schedule; this module runs that
schedule on the `RolloutFleet`'s engines (`RolloutFleet.generate_shared`: every rank gets every whole sample,
so every rank holds the same pool), scores the groups a step trains on, runs DAPO's refills, reports the
per-token version metrics, and saves / restores the pool with a checkpoint (`partial_rollouts.pt`, plain data:
`torch.load(weights_only=True)`).

Request seeds: a step's new batches and continuations take consecutive seeds after DAPO's region of the step
(`rollout.placement.request_seed`: attempts 0 .. grpo.max_refill_batches), so they never collide with a refill
or with another step, and a resumed run (same pool, same sampler position) draws the same tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.distributed.runtime import Runtime
from nemo_rollout_correction.distributed.tensor_gather import broadcast_object
from nemo_rollout_correction.rollout.partial import (
    ContinueRequest,
    PartialPool,
    stamp_new,
    token_version_tensor,
    version_metrics,
)
from nemo_rollout_correction.rollout.placement import STEP_SEED_STRIDE, request_seed
from nemo_rollout_correction.rollout.vllm_engine import RolloutBatch
from nemo_rollout_correction.trainer import metric_names as names
from nemo_rollout_correction.trainer.checkpoint import load_data_file
from nemo_rollout_correction.trainer.data import PromptRecord, PromptSampler
from nemo_rollout_correction.trainer.dynamic_sampling import DapoOptions, StepRollouts, collect_step_rollouts
from nemo_rollout_correction.trainer.rewards import score

__all__ = ["PartialRollouts", "SharedGenerator", "detokenizer", "load_state", "save_state", "state_file"]


class SharedGenerator(Protocol):
    """What the driver needs from the fleet (`RolloutFleet.generate_shared`, collective)."""

    def generate_shared(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> RolloutBatch:
        """`n` samples of up to `max_tokens` per prompt, prompt i seeded `seed + i * n`; every rank gets them all."""
        ...


def detokenizer(hf_dir: Path) -> Callable[[list[int]], str]:
    """A response's text from its token ids with the checkpoint's tokenizer, as vLLM's output text is decoded
    (`skip_special_tokens=True`, vLLM's default)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    return lambda token_ids: str(tokenizer.decode(token_ids, skip_special_tokens=True))


def state_file(step_dir: Path) -> Path:
    """Where the checkpoint of `step_dir` keeps the carried-over groups (written by rank 0; identical everywhere)."""
    return Path(step_dir) / "partial_rollouts.pt"


def save_state(step_dir: Path, state: dict[str, Any], *, is_main: bool) -> None:
    """Write `PartialRollouts.state()` (rank 0 only: every rank holds the same pool)."""
    if is_main:
        import torch

        torch.save(state, state_file(step_dir))


def load_state(step_dir: Path) -> dict[str, Any] | None:
    """The checkpoint's carried-over groups (None when it has none), read as data only."""
    path = state_file(step_dir)
    return load_data_file(path) if path.exists() else None


class _SeedCursor:
    """Consecutive request seeds of one step, after its DAPO attempts' seeds."""

    def __init__(self, first: int, end: int) -> None:
        self.next, self.end = first, end

    def take(self, count: int) -> int:
        seed = self.next
        self.next += count
        if self.next > self.end:
            raise RuntimeError(f"partial rollouts: a step needs more than {STEP_SEED_STRIDE} request seeds (it would "
                               "reuse the next step's); lower rollout.num_samples_per_prompt, task.prompts_per_step "
                               "or grpo.max_refill_batches, or raise rollout.partial_max_tokens_per_step")
        return seed


class PartialRollouts:
    """The synchronous step's rollouts with partial rollouts (module docstring). Every rank builds one and calls
    `collect` with the same step: its engine calls are collectives of the fleet.

    Args:
        cfg: the run's config.
        runtime: the job's ranks (rewards are computed on the main rank and broadcast).
        fleet: the engines (`generate_shared`).
        sampler: the step prompts.
        tokenize: a prompt's token ids.
        detokenize: a response's text from its token ids, as vLLM decodes it (skip_special_tokens=True).
        reward_fn: the task's reward function.
        dapo: the DAPO settings (refills generate whole responses under the current weights).
        log: progress lines.
    """

    def __init__(self, cfg: TrainConfig, runtime: Runtime, fleet: SharedGenerator, *, sampler: PromptSampler,
                 tokenize: Callable[[PromptRecord], list[int]], detokenize: Callable[[list[int]], str],
                 reward_fn: Callable[..., Any], dapo: DapoOptions,
                 log: Callable[[str], None]) -> None:
        self.cfg, self.runtime, self.fleet = cfg, runtime, fleet
        self.detokenize = detokenize
        self.sampler, self.tokenize, self.reward_fn, self.dapo, self.log = sampler, tokenize, reward_fn, dapo, log
        self.n = cfg.rollout.num_samples_per_prompt
        self.target = cfg.task.prompts_per_step
        self.pool = PartialPool(cfg.rollout.partial_max_tokens_per_step, cfg.rollout.max_new_tokens)
        self._seconds = 0.0

    # ---- one step ----------------------------------------------------------------------------------------

    def collect(self, step: int) -> StepRollouts:
        """The groups step `step` trains on (the engines hold version `step`), after DAPO; collective."""
        pool, n = self.pool, self.n
        self._seconds = 0.0
        base = self.cfg.rollout_seed + step * STEP_SEED_STRIDE
        cursor = _SeedCursor(base + (self.dapo.max_refill_batches + 1) * self.target * n, base + STEP_SEED_STRIDE)
        self._continue(pool.continuations(), step, cursor)  # 1. carried responses, B more tokens each
        last = None
        for _ in range(pool.stages):  # 2. new prompts, B tokens each, while the step or the pipeline needs them
            if not pool.wants_new_batch(self.target, last):
                break
            records = self.sampler.next_batch()
            prompts = [self.tokenize(r) for r in records]
            batch = self._generate(prompts, n, pool.first_max_tokens, cursor.take(len(prompts) * n))
            last = pool.add(records, batch, step)
        self._continue(pool.force_requests(self.target), step, cursor)  # 3. fill the step
        groups = pool.take_complete(self.target)  # 4.
        if len(groups) != self.target:  # the schedule guarantees it (rollout/partial.py)
            raise RuntimeError(f"partial rollouts: {len(groups)} complete groups for {self.target} prompts per step")
        records = [g.record for g in groups]
        # the text of the whole response (the pieces' texts need not join into it), scored as one response
        samples = [dataclasses.replace(s, prompt_index=i, text=self.detokenize(s.token_ids))
                   for i, g in enumerate(groups) for s in g.samples]
        first = RolloutBatch(samples, n=n, seconds=self._seconds)
        first_rewards = self._score(records, first)
        forced = sum(g.forced for g in groups) / len(groups)

        def generate_and_score(prompts: list[PromptRecord], attempt: int) -> tuple[RolloutBatch, list[float]]:
            if attempt == 0:
                return first, first_rewards
            # a DAPO refill: whole responses under the current weights, with the refill attempt's seeds
            seed = request_seed(self.cfg.rollout_seed, step, attempt, self.target, n)
            batch = self._generate([self.tokenize(r) for r in prompts], n, self.cfg.rollout.max_new_tokens, seed)
            batch = RolloutBatch([dataclasses.replace(stamp_new(s, step), text=self.detokenize(s.token_ids))
                                  for s in batch.samples], n=n, seconds=batch.seconds)  # scored as the pool's are
            return batch, self._score(prompts, batch)

        rollouts = collect_step_rollouts(records, self.sampler, generate_and_score, self.dapo)
        rollouts.batch.seconds = self._seconds  # every engine call of the step
        trained = rollouts.batch.samples
        width = max((len(s.prompt_token_ids) + len(s.token_ids) for s in trained), default=1)
        rollouts.metrics |= version_metrics(token_version_tensor(trained, width), step)
        rollouts.metrics |= {
            names.ROLLOUT_CARRIED_OVER_FRACTION: sum(s.policy_version < step for s in trained) / max(len(trained), 1),
            names.ROLLOUT_PARTIAL_FORCED_FRACTION: forced,
            names.ROLLOUT_PARTIAL_POOL_GROUPS: float(len(pool.groups)),
        }
        return rollouts

    def _generate(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> RolloutBatch:
        batch = self.fleet.generate_shared(prompts, n, max_tokens, seed)
        self._seconds += batch.seconds
        return batch

    def _continue(self, requests: Sequence[ContinueRequest], version: int, cursor: _SeedCursor) -> None:
        """Continue `requests` (sorted by max_tokens) under `version`: one engine call per run of equal max_tokens."""
        start = 0
        while start < len(requests):
            end = start
            while end < len(requests) and requests[end].max_tokens == requests[start].max_tokens:
                end += 1
            run = requests[start:end]
            batch = self._generate([r.prompt_token_ids for r in run], 1, run[0].max_tokens, cursor.take(len(run)))
            self.pool.apply(run, batch.samples, version)
            start = end

    def _score(self, records: list[PromptRecord], batch: RolloutBatch) -> list[float]:
        """The task rewards of `batch` (`n` samples per record), computed on the main rank, the same on every rank."""
        rewards: list[float] | None = None
        if self.runtime.is_main:
            per_sample = [records[s.prompt_index] for s in batch.samples]
            rewards = score(self.reward_fn, [r.prompt for r in per_sample], [s.text for s in batch.samples],
                            per_sample, [len(s.token_ids) for s in batch.samples])
        shared: Any = broadcast_object(rewards, src=0)
        return [float(r) for r in shared]

    # ---- checkpoints -----------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The pool as plain data (`save_state`)."""
        return self.pool.state(dataclasses.asdict)

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's pool (`load_state`)."""
        self.pool = PartialPool.from_state(state, lambda r: PromptRecord(**r),
                                           budget=self.cfg.rollout.partial_max_tokens_per_step,
                                           max_new_tokens=self.cfg.rollout.max_new_tokens)
        self.log(f"[nrc train] partial rollouts: restored {len(self.pool.groups)} carried-over groups "
                 f"({self.pool.num_complete()} complete) from the checkpoint")
