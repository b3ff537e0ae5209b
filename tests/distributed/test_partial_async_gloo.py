"""Async partial rollouts on 2 gloo ranks with the one engine on rank 0 equal one process (default lane, seconds).

What differs from one process under DP/TP/CP/PP > 1 with `rollout.placement=rank0` is which rank knows what: the
pool lives in rank 0's worker, every rank draws the job prompts and tracks `in_pool`, and the prompts each step trains
are broadcast from rank 0 (`AsyncPartialJobs.taken`). tests/distributed/partial_async_gloo_workers.py drives the real
`AsyncPartialJobs` in the real `RolloutPipeline` (worker thread on rank 0) as the fleet does, with a deterministic
generator in place of vLLM whose logprobs encode its version; it also stops after 2 steps, restores the checkpoint
state (rank 0's pool, every rank's pending batches) and goes on. The real engine and trainer under each layout:
tests/integration/test_partial_rollouts.py -k async_under (slow).
"""

from __future__ import annotations

from typing import Any

import dist_harness
import partial_async_gloo_workers as w
import pytest

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def runs() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    one = dist_harness.launch(w.worker, 1, timeout=120.0)[0]
    two = dist_harness.launch(w.worker, 2, timeout=120.0)
    return one, two


def test_the_schedule_spans_versions_and_every_token_is_labelled_with_its_sampler(
        runs: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    one, _ = runs
    steps = one["straight"]
    assert len(steps) == w.STEPS
    for step, r in enumerate(steps):
        for versions, logprobs in zip(r["versions"], r["logprobs"], strict=True):
            assert [-lp for lp in logprobs] == [float(v) for v in versions]  # the engine that sampled each token
            assert max(versions) <= r["version"] == max(0, step - 1)  # k = 1: the job of version step - 1
    assert max(len(set(v)) for r in steps for v in r["versions"]) >= 3  # one response, three versions
    assert any(len(t) < w.MAX_NEW for r in steps for t in r["tokens"])  # some responses stopped early
    assert any(r["metrics"]["rollout/carried_over_fraction"] > 0 for r in steps)


def test_every_rank_trains_what_one_process_trains(runs: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    one, two = runs
    for rank, got in enumerate(two):
        assert got["straight"] == one["straight"], f"rank {rank} differs from one process"


def test_a_checkpoint_after_step_2_resumes_the_same_steps_on_every_rank(
        runs: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    one, two = runs
    for rank, got in enumerate([one, *two]):
        assert got["in_pool_at_split"] == got["saved_in_pool"], rank  # each rank's tracker equals rank 0's pool
        assert got["resumed"] == one["straight"], f"rank {rank}: the resumed steps differ"
