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

from torch import Tensor

from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.distributed.runtime import Runtime
from nemo_rollout_correction.distributed.tensor_gather import broadcast_object
from nemo_rollout_correction.harness import metric_names as names
from nemo_rollout_correction.rollout.partial import (
    ContinueRequest,
    PartialPool,
    stamp_new,
    token_version_tensor,
    version_metrics,
)
from nemo_rollout_correction.rollout.placement import STEP_SEED_STRIDE, request_seed
from nemo_rollout_correction.rollout.samples import RolloutBatch, RolloutSample
from nemo_rollout_correction.tasks.prompts import PromptRecord, PromptSampler
from nemo_rollout_correction.tasks.rewards import score
from nemo_rollout_correction.trainer.checkpoint_door import VerifiedCheckpoint
from nemo_rollout_correction.trainer.dynamic_sampling import DapoOptions, StepRollouts, collect_step_rollouts

__all__ = ["AsyncPartialJobs", "LocalGenerator", "PartialRollouts", "SharedGenerator", "detokenizer", "load_state",
           "save_state", "state_file"]


class SharedGenerator(Protocol):
    """What the driver needs from the fleet (`RolloutFleet.generate_shared`, collective)."""

    def generate_shared(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> RolloutBatch:
        """`n` samples of up to `max_tokens` per prompt, prompt i seeded `seed + i * n`; every rank gets them all."""
        ...


class LocalGenerator(Protocol):
    """What the async driver needs from the fleet: this rank's engine, no collectives (runs in the worker)."""

    def generate_here(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> RolloutBatch:
        """`n` samples of up to `max_tokens` per prompt from this rank's engine, prompt i seeded `seed + i * n`."""
        ...

    def push_weights(self, weights: dict[str, Tensor]) -> float:
        """Load `weights` into this rank's engine."""
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


def load_state(checkpoint: VerifiedCheckpoint) -> dict[str, Any] | None:
    """The checkpoint's carried-over groups (None when it has none), read as data only (through the door)."""
    state: dict[str, Any] | None = checkpoint.read(state_file(checkpoint.step_dir))
    return state


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


def continue_requests(pool: PartialPool, requests: Sequence[ContinueRequest], version: int, cursor: _SeedCursor,
                      generate: Callable[[list[list[int]], int, int, int], RolloutBatch]) -> None:
    """Continue `requests` (sorted by max_tokens) under `version`: one engine call per run of equal max_tokens."""
    start = 0
    while start < len(requests):
        end = start
        while end < len(requests) and requests[end].max_tokens == requests[start].max_tokens:
            end += 1
        run = requests[start:end]
        batch = generate([r.prompt_token_ids for r in run], 1, run[0].max_tokens, cursor.take(len(run)))
        pool.apply(run, batch.samples, version)
        start = end


def step_cursor(cfg: TrainConfig, step: int, dapo: DapoOptions) -> _SeedCursor:
    """The seeds of step `step`'s pool calls: after the step's DAPO attempts' seeds, before the next step's."""
    base = cfg.rollout_seed + step * STEP_SEED_STRIDE
    target, n = cfg.task.prompts_per_step, cfg.rollout.num_samples_per_prompt
    return _SeedCursor(base + (dapo.max_refill_batches + 1) * target * n, base + STEP_SEED_STRIDE)


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
        cursor = step_cursor(self.cfg, step, self.dapo)
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
        # token staleness: the trainer's, over the tokens it trains (rollout/partial.py staleness_metrics_from_sums)
        mixed = version_metrics(token_version_tensor(trained, width), step)[names.ROLLOUT_MIXED_VERSION_FRACTION]
        rollouts.metrics[names.ROLLOUT_MIXED_VERSION_FRACTION] = mixed
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
        continue_requests(self.pool, requests, version, cursor, self._generate)

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


class AsyncPartialJobs:
    """Partial rollouts inside the async pipeline (`rollout.max_staleness = k >= 1`, trainer/async_rollouts.py).

    The pipeline's worker runs step j's generate job under version v = max(s0, j - k) with no collectives, so the
    pool lives on the engine's rank (one engine: `rollout.placement=rank0`, config rule) and one job is one step of
    the pool's schedule under v: (1) continue every unfinished response by B tokens, (2) generate the job's new
    batches with B tokens each, (3) finish the oldest incomplete groups without the budget until `prompts_per_step`
    are complete, (4) take them, re-decode their texts and score them. Each token records v (the engine's version:
    the pushes run in the same FIFO before the job), so its behaviour logprob is that of its own version.

    Unlike the synchronous step, the number of new batches cannot depend on which responses finished: the prompts
    of a job are drawn on the main thread of every rank when the job is queued (`draw`), before earlier jobs ran.
    The schedule is therefore fixed: a job draws max(1, stages - in_pool / prompts_per_step) batches, where in_pool
    (the groups the pool holds once the queued jobs have run, the same on every rank) grows by the drawn groups and
    shrinks by `prompts_per_step` per job: `stages` batches on the first job, one per job after, and the pool holds
    prompts_per_step x (stages - 1) groups between jobs. A group stays at most `stages` jobs; short responses may
    wait there (their tokens' staleness shows it). Which groups step j trains on is known on the engine rank only;
    `taken` broadcasts their prompts.

    Args:
        cfg: the run's config.
        fleet: this rank's engine (`generate_here`, `push_weights`).
        sampler: the step prompts (drawn on every rank, main thread).
        detokenize: a response's text from its token ids, as vLLM decodes it.
        reward_fn: the task's reward function (scored in the worker, like `RolloutFleet.generate_local`).
        dapo: the DAPO settings (the pool's seeds come after the refill attempts').
        log: progress lines.
    """

    def __init__(self, cfg: TrainConfig, fleet: LocalGenerator, *, sampler: PromptSampler,
                 tokenize: Callable[[PromptRecord], list[int]], detokenize: Callable[[list[int]], str],
                 reward_fn: Callable[..., Any], dapo: DapoOptions, log: Callable[[str], None]) -> None:
        self.cfg, self.fleet, self.sampler, self.tokenize = cfg, fleet, sampler, tokenize
        self.detokenize, self.reward_fn, self.dapo, self.log = detokenize, reward_fn, dapo, log
        self.n = cfg.rollout.num_samples_per_prompt
        self.target = cfg.task.prompts_per_step
        self.pool = PartialPool(cfg.rollout.partial_max_tokens_per_step, cfg.rollout.max_new_tokens)
        self.in_pool = 0  # groups in the pool once every queued job has run (every rank, main thread)
        self.engine_version = 0  # the engine's version in the worker's FIFO (set by `start`, +1 per push)
        # engine rank: per step, the prompts of the groups its job completed and the fraction it forced (`taken`)
        self.trained: dict[int, tuple[list[PromptRecord], float]] = {}

    def start(self, version: int) -> None:
        """The pipeline starts with the engine holding `version` (before any job is queued)."""
        self.engine_version = version

    # ---- main thread, every rank ------------------------------------------------------------------------------

    def draw(self) -> list[PromptRecord]:
        """The new prompts of the next queued job (the fixed schedule of the class docstring)."""
        batches = max(1, self.pool.stages - self.in_pool // self.target)
        records = [r for _ in range(batches) for r in self.sampler.next_batch()]
        self.in_pool += len(records) - self.target
        return records

    def taken(self, step: int, is_engine: bool) -> tuple[list[PromptRecord], float]:
        """Collective (a broadcast from rank 0, the engine's rank): the prompts of the groups step `step` trains on
        and the fraction of them finished past the budget (after the pipeline handed over step `step`'s batch)."""
        mine = self.trained.pop(step) if is_engine else None
        shared: Any = broadcast_object(mine, src=0)
        return list(shared[0]), float(shared[1])

    def metrics(self, samples: Sequence[RolloutSample], step: int, version: int, forced: float) -> dict[str, float]:
        """The per-token version metrics of the samples step `step` trains on, which the job of `version` completed:
        carried over = begun by an earlier job (first token older than `version`)."""
        width = max((len(s.prompt_token_ids) + len(s.token_ids) for s in samples), default=1)
        versions = version_metrics(token_version_tensor(samples, width), step)  # token staleness: the trainer's
        carried = sum(s.policy_version < version for s in samples) / max(len(samples), 1)
        return {names.ROLLOUT_MIXED_VERSION_FRACTION: versions[names.ROLLOUT_MIXED_VERSION_FRACTION],
                names.ROLLOUT_CARRIED_OVER_FRACTION: carried,
                names.ROLLOUT_PARTIAL_FORCED_FRACTION: forced,
                names.ROLLOUT_PARTIAL_POOL_GROUPS: float(self.in_pool)}

    # ---- the worker's jobs (engine rank, no collectives) ------------------------------------------------------

    def generate_local(self, records: list[PromptRecord], step: int,
                       attempt: int = 0) -> tuple[RolloutBatch, list[float]] | None:
        """Step `step`'s job: one stage of the pool under the engine's version with `records` as the new prompts
        (attempt 0), or a DAPO refill of whole responses (attempt k > 0, stamped with the engine's version)."""
        version = self.engine_version
        if attempt:  # whole responses under the engine's version, with the refill attempt's seeds
            seed = request_seed(self.cfg.rollout_seed, step, attempt, len(records), self.n)
            batch = self.fleet.generate_here([self.tokenize(r) for r in records], self.n,
                                             self.cfg.rollout.max_new_tokens, seed)
            refill = [dataclasses.replace(stamp_new(s, version), text=self.detokenize(s.token_ids))
                      for s in batch.samples]  # scored on the decode of the token ids, as the pool's are
            return RolloutBatch(refill, n=self.n, seconds=batch.seconds), self._score(records, refill)
        pool, n, seconds = self.pool, self.n, 0.0

        def generate(prompts: list[list[int]], count: int, max_tokens: int, seed: int) -> RolloutBatch:
            nonlocal seconds
            batch = self.fleet.generate_here(prompts, count, max_tokens, seed)
            seconds += batch.seconds
            return batch

        cursor = step_cursor(self.cfg, step, self.dapo)
        continue_requests(pool, pool.continuations(), version, cursor, generate)  # 1.
        for start in range(0, len(records), self.target):  # 2.
            chunk = records[start:start + self.target]
            prompts = [self.tokenize(r) for r in chunk]
            pool.add(chunk, generate(prompts, n, pool.first_max_tokens, cursor.take(len(prompts) * n)), version)
        continue_requests(pool, pool.force_requests(self.target), version, cursor, generate)  # 3.
        groups = pool.take_complete(self.target)  # 4.
        if len(groups) != self.target:
            raise RuntimeError(f"partial rollouts: {len(groups)} complete groups for {self.target} prompts per step")
        trained = [g.record for g in groups]
        samples = [dataclasses.replace(s, prompt_index=i, text=self.detokenize(s.token_ids))
                   for i, g in enumerate(groups) for s in g.samples]
        self.trained[step] = (trained, sum(g.forced for g in groups) / len(groups))
        return RolloutBatch(samples, n=n, seconds=seconds), self._score(trained, samples)

    def _score(self, records: list[PromptRecord], samples: list[RolloutSample]) -> list[float]:
        """The task rewards of `samples` (`prompt_index` into `records`), here on the engine's rank."""
        per_sample = [records[s.prompt_index] for s in samples]
        return score(self.reward_fn, [r.prompt for r in per_sample], [s.text for s in samples], per_sample,
                     [len(s.token_ids) for s in samples])

    def push_weights(self, weights: dict[str, Tensor]) -> float:
        """Load the next version into the engine (the worker's FIFO: the jobs after it generate with it)."""
        seconds = self.fleet.push_weights(weights)
        self.engine_version += 1
        return seconds

    # ---- checkpoints (after the pipeline's drain: the worker is idle) ------------------------------------------

    def state(self) -> dict[str, Any]:
        """The pool once every queued job has run, and the prompts of the queued steps' groups (engine rank)."""
        return {**self.pool.state(dataclasses.asdict), "in_pool": self.in_pool,
                "trained": [{"step": step, "records": [dataclasses.asdict(r) for r in records], "forced": forced}
                            for step, (records, forced) in sorted(self.trained.items())]}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's pool (`load_state`; a synchronous run's pool has no queued steps)."""
        self.pool = PartialPool.from_state(state, lambda r: PromptRecord(**r),
                                           budget=self.cfg.rollout.partial_max_tokens_per_step,
                                           max_new_tokens=self.cfg.rollout.max_new_tokens)
        self.in_pool = int(state.get("in_pool", len(self.pool.groups)))
        self.trained = {int(t["step"]): ([PromptRecord(**r) for r in t["records"]], float(t["forced"]))
                        for t in state.get("trained", [])}
        self.log(f"[nrc train] partial rollouts: restored {len(self.pool.groups)} carried-over groups "
                 f"({self.pool.num_complete()} complete) from the checkpoint")
