"""trainer/partial_rollouts.py `AsyncPartialJobs`: partial rollouts as the async pipeline's engine jobs.

The engine is a deterministic token generator over plain lists (these tests check the schedule, the versions and
the checkpoint state); the real pipeline (`RolloutPipeline`, its worker thread) drives it. The real engine and
trainer run in tests/integration/test_partial_rollouts.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from nemo_rollout_correction.config.loader import load_config
from nemo_rollout_correction.rollout.partial import (
    max_token_staleness,
    staleness_metrics_from_sums,
    staleness_mismatch_sums,
    token_staleness,
)
from nemo_rollout_correction.rollout.samples import RolloutBatch, RolloutSample
from nemo_rollout_correction.tasks.prompts import PromptRecord
from nemo_rollout_correction.trainer.async_rollouts import RolloutPipeline
from nemo_rollout_correction.trainer.dynamic_sampling import DapoOptions
from nemo_rollout_correction.trainer.partial_rollouts import AsyncPartialJobs

N, PROMPTS, MAX_NEW, BUDGET = 2, 2, 16, 6


class FakeEngine:
    """Responses of `MAX_NEW` tokens (never EOS); each token's logprob encodes the engine's version, so a test can
    check that every token records the version that sampled it."""

    def __init__(self) -> None:
        self.version = 0
        self.calls: list[tuple[int, int, int]] = []  # (prompts, max_tokens, version)

    def generate_here(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> RolloutBatch:
        self.calls.append((len(prompts), max_tokens, self.version))
        samples = []
        for i, prompt in enumerate(prompts):
            for _ in range(n):
                tokens = [len(prompt) + t for t in range(max_tokens)]
                samples.append(RolloutSample(i, list(prompt), tokens, [-float(self.version)] * max_tokens, "length",
                                             text="x"))
        return RolloutBatch(samples, n=n, seconds=0.0)

    def push_weights(self, weights: dict[str, torch.Tensor]) -> float:
        self.version += 1
        return 0.0


class Sampler:
    def __init__(self) -> None:
        self.drawn = 0

    def next_batch(self) -> list[PromptRecord]:
        out = [PromptRecord(prompt=f"p{self.drawn + i}", answer="") for i in range(PROMPTS)]
        self.drawn += PROMPTS
        return out


def _zero_reward(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    return [0.0] * len(completions)


def _jobs(engine: FakeEngine, sampler: Sampler) -> AsyncPartialJobs:
    cfg = load_config([f"rollout.partial_max_tokens_per_step={BUDGET}", f"rollout.max_new_tokens={MAX_NEW}",
                       f"rollout.num_samples_per_prompt={N}", f"task.prompts_per_step={PROMPTS}",
                       "rollout.max_staleness=1", "policy.micro_batch_size=4"])
    return AsyncPartialJobs(cfg, engine, sampler=sampler, tokenize=lambda r: [1, 2, int(r.prompt[1:]) + 3],
                            detokenize=lambda ids: " ".join(map(str, ids)), reward_fn=_zero_reward,
                            dapo=DapoOptions.from_config(cfg), log=lambda m: None)


def trainer_staleness(batch: RolloutBatch, step: int) -> dict[str, float]:
    """The trainer's per-token staleness metrics of `batch` at version `step` (grpo.py -> policy_update.py ->
    step_report.py, one process)."""
    tensors = batch.to_tensors()
    staleness = token_staleness(tensors["token_versions"], step)
    sums = staleness_mismatch_sums(tensors["rollout_logprobs"], tensors["rollout_logprobs"], tensors["loss_mask"],
                                   staleness, 1 + max_token_staleness(1, BUDGET, MAX_NEW))
    return staleness_metrics_from_sums(sums)


def _run(steps: int, k: int = 1) -> tuple[list[dict[str, Any]], AsyncPartialJobs, FakeEngine]:
    engine, sampler = FakeEngine(), Sampler()
    jobs = _jobs(engine, sampler)
    jobs.start(0)
    pipeline = RolloutPipeline(jobs, jobs.draw, max_staleness=k, stale_policy="wait", samples_per_prompt=N,
                               has_engine=True)
    pipeline.start(0)
    out = []
    try:
        for step in range(steps):
            taken = pipeline.take(step)
            records, forced = jobs.taken(step, is_engine=True)
            assert taken.local is not None
            batch, _ = taken.local
            out.append({"step": step, "version": taken.version, "records": [r.prompt for r in records],
                        "samples": batch.samples, "forced": forced,
                        "metrics": jobs.metrics(batch.samples, step, taken.version, forced)
                        | trainer_staleness(batch, step)})
            pipeline.end_step(step, {"w": torch.zeros(1)})
    finally:
        pipeline.close()
    return out, jobs, engine


def test_every_token_records_the_engine_version_that_sampled_it() -> None:
    got, _, _ = _run(5)
    for r in got:
        for s in r["samples"]:
            assert len(s.token_versions) == len(s.token_ids) == len(s.logprobs) == MAX_NEW
            # the fake engine's logprob is minus its version: each token's own sampler
            assert [-lp for lp in s.logprobs] == [float(v) for v in s.token_versions]
            assert max(s.token_versions) == r["version"]  # the job of the batch's version finished it
            assert s.policy_version == s.token_versions[0]  # the oldest version
            assert s.token_versions == sorted(s.token_versions)
    # k = 1, 3 stages: step 4 trains responses begun by version 0 and finished by version 2 (three versions)
    assert [r["version"] for r in got] == [0, 0, 1, 2, 3]
    assert got[3]["samples"][0].token_versions == [0] * 6 + [1] * 6 + [2] * 4
    assert got[3]["metrics"]["rollout/token_staleness_max"] == 3.0  # k + stages - 1
    assert got[0]["metrics"]["rollout/token_staleness_max"] == 0.0
    assert got[3]["metrics"]["rollout/mixed_version_fraction"] == 1.0
    assert got[3]["metrics"]["rollout/carried_over_fraction"] == 1.0


def test_the_fixed_schedule_draws_stages_batches_first_then_one_and_trains_the_oldest_groups() -> None:
    got, jobs, engine = _run(5)
    # 3 batches (stages) on the first job, one per job after; every prompt is trained once, oldest first
    assert [r["records"] for r in got] == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"], ["p6", "p7"], ["p8", "p9"]]
    assert [r["forced"] for r in got] == [1.0, 1.0, 0.0, 0.0, 0.0]  # the warm-up finishes groups past the budget
    assert all(r["metrics"]["rollout/partial_pool_groups"] == PROMPTS * 2 for r in got)
    assert jobs.in_pool == len(jobs.pool.groups) == PROMPTS * 2  # the tracker (every rank) equals the pool
    assert max(m for _, m, _ in engine.calls) <= MAX_NEW and (PROMPTS * 3, BUDGET, 0) not in engine.calls


def test_checkpoint_state_resumes_the_same_schedule() -> None:
    """Stop after 2 steps (the pipeline drained, as a checkpoint does), restore into a fresh driver, go on."""
    straight, _, _ = _run(4)
    engine, sampler = FakeEngine(), Sampler()
    jobs = _jobs(engine, sampler)
    jobs.start(0)
    pipeline = RolloutPipeline(jobs, jobs.draw, max_staleness=1, stale_policy="wait", samples_per_prompt=N,
                               has_engine=True)
    pipeline.start(0)
    for step in range(2):
        pipeline.take(step)
        jobs.taken(step, is_engine=True)
        pipeline.end_step(step, {"w": torch.zeros(1)})
    pipeline.drain()
    state, pending = jobs.state(), pipeline.pending
    pipeline.close()
    assert [t["step"] for t in state["trained"]] == [2, 3] and state["in_pool"] == PROMPTS * 2
    engine2 = FakeEngine()
    engine2.version = 2
    resumed = _jobs(engine2, sampler)
    resumed.restore(state)
    resumed.start(2)
    pipeline = RolloutPipeline(resumed, resumed.draw, max_staleness=1, stale_policy="wait", samples_per_prompt=N,
                               has_engine=True)
    pipeline.start(2, [dataclasses.replace(p, future=None) for p in pending])
    try:
        for step in (2, 3):
            taken = pipeline.take(step)
            records, _ = resumed.taken(step, is_engine=True)
            assert taken.local is not None
            assert [r.prompt for r in records] == straight[step]["records"]
            assert [s.token_versions for s in taken.local[0].samples] == \
                [s.token_versions for s in straight[step]["samples"]]
            pipeline.end_step(step, {"w": torch.zeros(1)})
    finally:
        pipeline.close()


def test_partial_async_needs_one_engine() -> None:
    with pytest.raises(Exception, match=r"rollout\.placement=rank0"):
        load_config(["rollout.partial_max_tokens_per_step=6", "rollout.max_staleness=1",
                     "rollout.placement=per_dp_group"])


def test_a_dapo_refill_is_whole_responses_of_the_engine_version_scored_on_their_decode() -> None:
    engine, sampler = FakeEngine(), Sampler()
    jobs = _jobs(engine, sampler)
    jobs.start(0)
    jobs.push_weights({})
    jobs.push_weights({})
    records = sampler.next_batch()
    local = jobs.generate_local(records, step=2, attempt=1)
    assert local is not None
    batch, rewards = local
    assert len(batch.samples) == len(rewards) == PROMPTS * N
    assert engine.calls[-1] == (PROMPTS, MAX_NEW, 2)  # whole responses under the engine's version
    for s in batch.samples:
        assert s.token_versions == [2] * MAX_NEW and s.policy_version == 2
        assert s.text == " ".join(map(str, s.token_ids))  # the detokenizer's text, not the engine's
    assert jobs.pool.groups == [] and jobs.trained == {}  # a refill leaves the pool alone
