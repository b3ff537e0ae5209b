"""rollout/partial.py: the bookkeeping of partial rollouts (budgets, continuation, versions, schedule, state).

The engine here is a deterministic token generator over plain lists, because these tests check the pool's
arithmetic; the real engine and trainer run in tests/integration/test_partial_rollouts.py.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from nemo_rollout_correction.rollout.partial import (
    PartialPool,
    is_finished,
    merge_continuation,
    num_stages,
    staleness_metrics_from_sums,
    staleness_mismatch_sums,
    token_staleness,
    token_version_tensor,
    version_metrics,
)
from nemo_rollout_correction.rollout.samples import RolloutBatch, RolloutSample
from nemo_rollout_correction.trainer.checkpoint_door import load_data_file

EOS = 99


def _generate(prompt: list[int], max_tokens: int, stop_at: int | None) -> RolloutSample:
    """`max_tokens` tokens counting on from the prompt's length; EOS once the response would reach `stop_at`."""
    tokens: list[int] = []
    reason = "length"
    for _ in range(max_tokens):
        if stop_at is not None and len(prompt) + len(tokens) >= stop_at:
            tokens.append(EOS)
            reason = "stop"
            break
        tokens.append(len(prompt) + len(tokens))
    logprobs = [-0.01 * (len(prompt) + i) for i in range(len(tokens))]
    return RolloutSample(0, list(prompt), tokens, logprobs, reason, text="".join(f"<{t}>" for t in tokens))


def test_stages_and_finished() -> None:
    assert num_stages(16, 6) == 3 and num_stages(16, 8) == 2 and num_stages(16, 15) == 2
    sample = _generate([1, 2], 6, None)
    assert not is_finished(sample, 16)  # stopped by the budget
    assert is_finished(dataclasses.replace(sample, finish_reason="stop"), 16)
    assert is_finished(_generate([1, 2], 16, None), 16)  # the whole max_new_tokens
    with pytest.raises(ValueError, match="partial_max_tokens_per_step=16 must lie in"):
        PartialPool(16, 16)


def test_continuation_appends_tokens_logprobs_and_versions() -> None:
    pool = PartialPool(budget=6, max_new_tokens=16)
    first = _generate([1, 2, 3], 6, None)
    pool.add(["r"], RolloutBatch([first, _generate([1, 2, 3], 6, 7)], n=2, seconds=0.0), version=4)
    requests = pool.continuations()
    assert [(r.group, r.sample, r.max_tokens) for r in requests] == [(0, 0, 6)]  # sample 1 stopped (EOS)
    assert requests[0].prompt_token_ids == [1, 2, 3, *first.token_ids]
    piece = dataclasses.replace(_generate(requests[0].prompt_token_ids, 6, None), prompt_index=0)
    pool.apply(requests, [piece], version=5)
    merged = pool.groups[0].samples[0]
    assert merged.token_ids == first.token_ids + piece.token_ids
    assert merged.logprobs == first.logprobs + piece.logprobs
    assert merged.token_versions == [4] * 6 + [5] * 6 and merged.policy_version == 4
    assert merged.text == first.text + piece.text
    last = pool.continuations()
    assert [r.max_tokens for r in last] == [4]  # 16 - 12 remain, below the budget
    assert [r.max_tokens for r in pool.continuations(budgeted=False)] == [4]
    with pytest.raises(ValueError, match="not the sample's prompt"):
        merge_continuation(merged, first, 6)


def _run(pool: PartialPool, steps: int, prompts_per_step: int, n: int, stop_at: int | None) -> list[list[int]]:
    """Drive the step schedule of rollout/partial.py with `_generate`; returns each step's trained versions."""
    trained = []
    next_prompt = 0

    def serve(requests: list, version: int) -> None:
        pool.apply(requests, [_generate(r.prompt_token_ids, r.max_tokens, stop_at) for r in requests], version)

    for step in range(steps):
        serve(pool.continuations(), step)
        last = None
        for _ in range(pool.stages):
            if not pool.wants_new_batch(prompts_per_step, last):
                break
            records = list(range(next_prompt, next_prompt + prompts_per_step))
            next_prompt += prompts_per_step
            samples = [dataclasses.replace(_generate([r, r], pool.budget, stop_at), prompt_index=i)
                       for i, r in enumerate(records) for _ in range(n)]
            last = pool.add(records, RolloutBatch(samples, n=n, seconds=0.0), step)
        serve(pool.force_requests(prompts_per_step), step)
        groups = pool.take_complete(prompts_per_step)
        assert len(groups) == prompts_per_step
        assert all(len(s.token_versions) == len(s.token_ids) for g in groups for s in g.samples)
        trained.append(sorted({v for g in groups for s in g.samples for v in s.token_versions}))
    return trained


def test_schedule_reaches_a_steady_state_where_responses_span_three_versions() -> None:
    pool = PartialPool(budget=6, max_new_tokens=16)
    trained = _run(pool, steps=6, prompts_per_step=2, n=2, stop_at=None)
    # warm-up: step 0 finishes its oldest batch under version 0, step 1 under 0 and 1; then one batch completes
    # per step without forcing, its tokens from three consecutive versions
    assert trained[0] == [0]
    for step in range(2, 6):
        assert trained[step] == [step - 2, step - 1, step], trained
    assert len(pool.groups) == 2 * 2  # two batches in flight: prompts_per_step x (stages - 1)
    assert not any(g.forced for g in pool.groups)


def test_short_responses_finish_within_the_budget_and_are_never_carried() -> None:
    pool = PartialPool(budget=6, max_new_tokens=16)
    trained = _run(pool, steps=3, prompts_per_step=2, n=2, stop_at=5)  # EOS after 3 tokens
    assert trained == [[0], [1], [2]]


def test_state_is_plain_data(tmp_path: Path) -> None:
    pool = PartialPool(budget=6, max_new_tokens=16)
    _run(pool, steps=3, prompts_per_step=2, n=2, stop_at=None)
    path = tmp_path / "partial_rollouts.pt"
    torch.save(pool.state(lambda r: {"id": r}), path)
    back = PartialPool.from_state(load_data_file(path), lambda d: d["id"], budget=6, max_new_tokens=16)
    assert [g.record for g in back.groups] == [g.record for g in pool.groups]
    assert [g.samples for g in back.groups] == [g.samples for g in pool.groups]
    assert [g.first_version for g in back.groups] == [g.first_version for g in pool.groups]


def test_token_version_tensor_and_metrics() -> None:
    a = RolloutSample(0, [1, 2], [5, 6, 7], [-1.0, -2.0, -3.0], "stop", token_versions=[3, 3, 4])
    b = RolloutSample(0, [1, 2, 3], [8], [-1.0], "stop", policy_version=4)  # not from the pool: one version
    versions = token_version_tensor([a, b], width=5)
    assert versions.tolist() == [[-1, 3, 3, 4], [-1, -1, 4, -1]]
    layout = RolloutBatch([a, b], n=1, seconds=0.0).to_tensors()
    assert torch.equal(versions >= 0, layout["loss_mask"])  # the rollout_logprobs positions exactly
    metrics = version_metrics(versions, step=4)
    assert metrics == {"rollout/mixed_version_fraction": 0.5, "rollout/token_staleness_mean": 0.5,
                       "rollout/token_staleness_max": 1.0}


def test_token_versions_in_the_step_tensors_and_the_trainer_staleness_sums() -> None:
    """`to_tensors()["token_versions"]` is `token_version_tensor`; the trainer's per-staleness sums add over any
    split of the rows or the positions (what DP and CP do), and give the staleness metrics and the mismatch by lag."""
    a = RolloutSample(0, [1, 2], [5, 6, 7], [-1.0, -2.0, -3.0], "stop", token_versions=[3, 3, 4])
    b = RolloutSample(0, [1, 2, 3], [8], [-1.0], "stop", policy_version=4)
    c = RolloutSample(0, [1], [9, 9], [-0.5, -0.5], "stop", token_versions=[1, 2])  # staleness 3 and 2
    tensors = RolloutBatch([a, b, c], n=1, seconds=0.0).to_tensors()
    assert torch.equal(tensors["token_versions"], token_version_tensor([a, b, c], width=5))
    staleness = token_staleness(tensors["token_versions"], 4)
    assert staleness.tolist() == [[-1, 1, 1, 0], [-1, -1, 0, -1], [3, 2, -1, -1]]
    reference = tensors["rollout_logprobs"] + 0.1 * staleness.clamp(min=0)  # the mismatch grows with staleness
    whole = staleness_mismatch_sums(reference, tensors["rollout_logprobs"], tensors["loss_mask"], staleness, 3)
    assert whole["lag_2/num_tokens"] == 2.0  # staleness 3 counts in the last bucket (num_lags = 3)
    parts = [staleness_mismatch_sums(reference[rows][:, cols], tensors["rollout_logprobs"][rows][:, cols],
                                     tensors["loss_mask"][rows][:, cols], staleness[rows][:, cols], 3)
             for rows in (slice(0, 1), slice(1, 3)) for cols in (slice(0, 2), slice(2, 4))]
    for key, value in whole.items():
        assert sum(p[key] for p in parts) == pytest.approx(value)
    metrics = staleness_metrics_from_sums(whole)
    assert metrics["rollout/token_staleness_max"] == 2.0 and metrics["rollout_corr/lag_0/k3_kl"] == 0.0
    assert metrics["rollout/token_staleness_mean"] == pytest.approx((2 * 1 + 2 * 2) / 6)
    k3 = math.expm1(0.1) - 0.1
    assert metrics["rollout_corr/lag_1/k3_kl"] == pytest.approx(k3)
    assert metrics["rollout_corr/lag_2/log_ratio_abs_mean"] == pytest.approx(0.25)
    assert staleness_metrics_from_sums({}) == {}
