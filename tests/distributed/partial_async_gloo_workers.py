"""Workers of test_partial_async_gloo.py: async partial rollouts (`AsyncPartialJobs` in the real `RolloutPipeline`)
with the one engine on rank 0 of a gloo job, driven as `RolloutFleet._take_async` / `sync_weights` and
`InFlightRollouts.state` / `restore` drive them (trainer/fleet.py, trainer/in_flight.py, placement rank0).

Rank 0 hosts the engine: a deterministic token generator whose logprobs encode its version (so every token's
version label can be checked against the engine that really sampled it); the other ranks have none. Every rank
draws the job prompts and tracks `in_pool`; the prompts each step trains are broadcast from rank 0 (`taken`) and so
are the samples (`broadcast_rollouts`, as placement rank0 shares them). Per step each rank returns what it trains on
and the step's partial-rollout metrics; a second run stops after 2 steps, takes the checkpoint state (rank 0's pool
after the queued jobs, every rank's pending batches), restores it into fresh drivers and goes on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from nemo_rollout_correction.config.loader import load_config
from nemo_rollout_correction.distributed.tensor_gather import broadcast_object
from nemo_rollout_correction.harness.exchange import broadcast_rollouts
from nemo_rollout_correction.rollout.samples import RolloutBatch, RolloutSample
from nemo_rollout_correction.tasks.prompts import PromptRecord
from nemo_rollout_correction.trainer.async_rollouts import PendingBatch, RolloutPipeline
from nemo_rollout_correction.trainer.dynamic_sampling import DapoOptions
from nemo_rollout_correction.trainer.partial_rollouts import AsyncPartialJobs

N, PROMPTS, MAX_NEW, BUDGET, STEPS, SPLIT = 2, 2, 14, 4, 6, 2


class VersionedEngine:
    """Responses whose length depends on the prompt and the seed (some stop early with "stop", the others run to
    the budget); every token's logprob is minus the engine's version."""

    def __init__(self, version: int = 0) -> None:
        self.version = version

    def generate_here(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> RolloutBatch:
        samples = []
        for i, prompt in enumerate(prompts):
            for j in range(n):
                stop_at = (sum(prompt) * 7 + (seed + i * n + j) * 3) % (2 * MAX_NEW)  # < MAX_NEW: stops early
                count = min(max_tokens, stop_at + 1)
                finish = "stop" if count == stop_at + 1 else "length"
                tokens = [(len(prompt) + t) % 50 + 3 for t in range(count)]
                samples.append(RolloutSample(i, list(prompt), tokens, [-float(self.version)] * count, finish))
        return RolloutBatch(samples, n=n, seconds=0.0)

    def push_weights(self, weights: dict[str, torch.Tensor]) -> float:
        self.version = int(weights["version"])
        return 0.0


class Sampler:
    def __init__(self, drawn: int = 0) -> None:
        self.drawn = drawn

    def next_batch(self) -> list[PromptRecord]:
        out = [PromptRecord(prompt=f"p{self.drawn + i}", answer="") for i in range(PROMPTS)]
        self.drawn += PROMPTS
        return out


def _reward(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    return [float(len(c) % 3) for c in completions]


def _jobs(engine: VersionedEngine | None, sampler: Sampler) -> AsyncPartialJobs:
    cfg = load_config([f"rollout.partial_max_tokens_per_step={BUDGET}", f"rollout.max_new_tokens={MAX_NEW}",
                       f"rollout.num_samples_per_prompt={N}", f"task.prompts_per_step={PROMPTS}",
                       "rollout.max_staleness=1", "rollout.placement=rank0", "policy.micro_batch_size=4"])
    return AsyncPartialJobs(cfg, engine, sampler=sampler,  # type: ignore[arg-type]
                            tokenize=lambda r: [1, 2, int(r.prompt[1:]) + 3],
                            detokenize=lambda ids: " ".join(map(str, ids)), reward_fn=_reward,
                            dapo=DapoOptions.from_config(cfg), log=lambda m: None)


def _pipeline(jobs: AsyncPartialJobs, has_engine: bool) -> RolloutPipeline:
    return RolloutPipeline(jobs, jobs.draw, max_staleness=1, stale_policy="wait", samples_per_prompt=N,
                           has_engine=has_engine)


def _step(pipeline: RolloutPipeline, jobs: AsyncPartialJobs, step: int, is_engine: bool) -> dict[str, Any]:
    """One step as `RolloutFleet._take_async` + `sync_weights` run it: take, share, metrics, push the next version."""
    taken = pipeline.take(step)
    records, forced = jobs.taken(step, is_engine)
    batch, rewards = broadcast_rollouts(*(taken.local if taken.local is not None else (None, None)))
    out = {"records": [r.prompt for r in records], "version": taken.version, "rewards": list(rewards),
           "tokens": [s.token_ids for s in batch.samples], "versions": [s.token_versions for s in batch.samples],
           "logprobs": [s.logprobs for s in batch.samples], "in_pool": jobs.in_pool,
           "metrics": jobs.metrics(batch.samples, step, taken.version, forced)}
    pipeline.end_step(step, {"version": torch.tensor(step + 1)} if is_engine else None)
    return out


def worker(rank: int, world_size: int) -> dict[str, Any]:
    is_engine = rank == 0
    # uninterrupted
    jobs = _jobs(VersionedEngine() if is_engine else None, Sampler())
    jobs.start(0)
    pipeline = _pipeline(jobs, is_engine)
    pipeline.start(0)
    try:
        straight = [_step(pipeline, jobs, step, is_engine) for step in range(STEPS)]
    finally:
        pipeline.close()

    # stopped after SPLIT steps: the checkpoint's state (trainer/in_flight.py `state` after the pipeline's drain)
    sampler = Sampler()
    jobs = _jobs(VersionedEngine() if is_engine else None, sampler)
    jobs.start(0)
    pipeline = _pipeline(jobs, is_engine)
    pipeline.start(0)
    try:
        first = [_step(pipeline, jobs, step, is_engine) for step in range(SPLIT)]
        pipeline.drain()
        pending = [dataclasses.replace(p, future=None) for p in pipeline.pending]
    finally:
        pipeline.close()
    in_pool_at_split = jobs.in_pool  # this rank's tracker
    pool: Any = broadcast_object(jobs.state() if is_engine else None, src=0)  # partial_rollouts.pt, rank 0's
    shared: Any = broadcast_object([(p.step, p.records, p.version) for p in pending], src=0)  # rank_0.pt's prompts
    restored = [PendingBatch(step=s, records=list(r), version=v, local=p.local)
                for (s, r, v), p in zip(shared, pending, strict=True)]
    resumed = _jobs(VersionedEngine(version=SPLIT) if is_engine else None, Sampler(sampler.drawn))
    resumed.restore(pool)
    resumed.start(SPLIT)
    pipeline = _pipeline(resumed, is_engine)
    pipeline.start(SPLIT, restored)
    try:
        second = [_step(pipeline, resumed, step, is_engine) for step in range(SPLIT, STEPS)]
    finally:
        pipeline.close()
    dist.barrier()
    return {"straight": straight, "resumed": first + second, "in_pool_at_split": in_pool_at_split,
            "saved_in_pool": pool["in_pool"]}
