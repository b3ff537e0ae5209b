"""Multi-turn with the trainer's other machinery, without an engine (the default lane's checks; the real-engine runs
are tests/integration/test_multi_turn_async.py):

- DAPO on multi-turn samples: dynamic sampling keeps whole trajectories by group, the overlong filter drops a
  trajectory whose last turn was cut, and the loss mask still excludes the observation tokens;
- the reward workers score multi-turn records (the environment reward travels in the pickled records) exactly as
  the in-process reward does;
- async checkpoints: in-flight multi-turn samples (turn ids, rewritten segments) survive `RolloutPipeline.state`,
  `torch.save` and `load_pending` (weights_only).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from nemo_rollout_correction.rollout.multi_turn import OBSERVATION, split_segments
from nemo_rollout_correction.rollout.vllm_engine import RolloutBatch, RolloutSample
from nemo_rollout_correction.trainer.async_rollouts import (
    PendingBatch,
    RolloutPipeline,
    load_pending,
    pending_file,
    restored_batches,
)
from nemo_rollout_correction.trainer.data import PromptRecord
from nemo_rollout_correction.trainer.dynamic_sampling import (
    DapoOptions,
    apply_overlong_filter,
    collect_step_rollouts,
)
from nemo_rollout_correction.trainer.environments import (
    ENV_REWARD_KEY,
    environment_reward,
)
from nemo_rollout_correction.trainer.reward_pool import RewardPool
from nemo_rollout_correction.trainer.rewards import score
from nemo_rollout_correction.trainer.tasks import build_task


def _multi_turn(prompt: int, index: int, finish: str) -> RolloutSample:
    """Turn 0 (2 tokens), an observation (2 tokens), turn 1 (2 tokens)."""
    return RolloutSample(prompt_index=prompt, prompt_token_ids=[1, 2, 3], token_ids=[10 + index, 11, 5, 6, 12, 13],
                         logprobs=[-0.5, -0.6, 0.0, 0.0, -0.7, -0.8], finish_reason=finish, text=f"t{index}",
                         turn_ids=[0, 0, OBSERVATION, OBSERVATION, 1, 1])


def test_dapo_keeps_whole_trajectories_and_the_overlong_filter_drops_cut_ones() -> None:
    class Sampler:
        def __init__(self) -> None:
            self.drawn = 0

        def next_batch(self) -> list[PromptRecord]:
            self.drawn += 1
            return [PromptRecord(f"refill{self.drawn}-{i}") for i in range(2)]

    def generate_and_score(records: list[PromptRecord], attempt: int) -> tuple[RolloutBatch, list[float]]:
        samples = [_multi_turn(p, 2 * p + j, "length" if (attempt, p, j) == (1, 0, 1) else "stop")
                   for p in range(len(records)) for j in range(2)]
        # attempt 0: group 0 has no variance; the refill's groups both have it
        rewards = [0.0, 0.0, 0.0, 1.0] if attempt == 0 else [1.0, 0.0, 0.5, 0.0]
        return RolloutBatch(samples, n=2, seconds=0.0), rewards

    options = DapoOptions(dynamic_sampling=True, max_refill_batches=2, overlong_filter=True)
    records = [PromptRecord("a"), PromptRecord("b")]
    result = collect_step_rollouts(records, Sampler(), generate_and_score, options)
    assert [r.prompt for r in result.records] == ["b", "refill1-0"]
    assert result.rewards == [0.0, 1.0, 1.0, 0.0] and result.metrics["grpo/refill_batches"] == 1.0
    assert all(s.turn_ids == [0, 0, OBSERVATION, OBSERVATION, 1, 1] for s in result.batch.samples)
    tensors = result.batch.to_tensors(pad_token_id=0)
    # positions 2..7 score the response; the observation (response 2, 3) is never in the loss
    assert tensors["loss_mask"][:, 2:].tolist() == [[True, True, False, False, True, True]] * 4
    mask, metrics = apply_overlong_filter(tensors["loss_mask"], result.batch, options)
    assert metrics["grpo/overlong_filtered_fraction"] == 0.25
    assert mask.any(dim=1).tolist() == [True, True, True, False]  # the trajectory whose last turn was cut
    assert not (mask & tensors["observation_mask"]).any()


def test_reward_workers_score_multi_turn_records_like_the_process() -> None:
    task = build_task("arithmetic_feedback", num_prompts=4, seed=2, reward_workers=1, reward_timeout_s=60.0)
    assert isinstance(task.reward_fn, RewardPool) and task.reward_fn.reward_fn is environment_reward
    records = [dataclasses.replace(r, metadata={**r.metadata, ENV_REWARD_KEY: reward})
               for r, reward in zip(task.records, [0.0, 1.0, 0.5, 1.0 / 3], strict=True)]
    args = ([r.prompt for r in records], ["a", "b", "c", "d"], records, [3, 4, 5, 6])
    # the task's pool, with a start-up bound for a loaded machine (a worker imports trainer/environments.py)
    pool = RewardPool(environment_reward, 1, 60.0, startup_timeout_s=900.0)
    try:
        pooled = score(pool, *args, sample_ids=[(0, 0), (0, 1), (1, 0), (1, 1)])
        assert pool.worker_pids, "scored in a worker process"
    finally:
        pool.close()
    assert pooled == score(environment_reward, *args) == [0.0, 1.0, 0.5, 1.0 / 3]


def test_async_checkpoint_keeps_multi_turn_samples(tmp_path: Path) -> None:
    rewritten = dataclasses.replace(_multi_turn(0, 1, "stop"), segments=[(4, [1, 8, 9])], policy_version=1)
    local = (RolloutBatch([_multi_turn(0, 0, "length"), rewritten], n=2, seconds=1.5), [0.25, 1.0])

    class NoJobs:
        def generate_local(self, records: list[PromptRecord], step: int, attempt: int = 0) -> None:
            raise AssertionError("not called")

        def push_weights(self, weights: dict[str, torch.Tensor]) -> float:
            raise AssertionError("not called")

    pipeline = RolloutPipeline(NoJobs(), lambda: [], max_staleness=1, stale_policy="wait", samples_per_prompt=2,
                               has_engine=False)
    pipeline.pending = [PendingBatch(step=3, records=[PromptRecord("q", "4", {"k": 1})], version=2, local=local)]
    path = pending_file(tmp_path, 0)
    path.parent.mkdir(parents=True)
    torch.save(pipeline.state(num_engines=1), path)
    pipeline.close()
    loaded = load_pending(tmp_path, 0)
    assert loaded is not None
    (restored,) = restored_batches(loaded, loaded)
    assert restored.records == [PromptRecord("q", "4", {"k": 1})] and restored.local is not None
    batch, rewards = restored.local
    assert rewards == [0.25, 1.0] and batch.n == 2
    for got, want in zip(batch.samples, local[0].samples, strict=True):
        assert got.turn_ids == want.turn_ids and got.token_ids == want.token_ids and got.logprobs == want.logprobs
        assert got.finish_reason == want.finish_reason and got.policy_version == want.policy_version
        assert [(int(s), list(c)) for s, c in got.segments or []] == [(s, c) for s, c in want.segments or []]
    # the split of the restored sample equals the split of the live one
    assert [(r.prompt_token_ids, r.token_ids) for r in split_segments(batch.samples)[0]] == \
        [(r.prompt_token_ids, r.token_ids) for r in split_segments(local[0].samples)[0]]
