"""Multi-turn with the trainer's other machinery, without an engine (the default lane's checks; the real-engine runs
are tests/integration/test_multi_turn_async.py and tests/integration/test_multi_turn_layouts.py):

- turn seeds do not depend on the number of engines: one engine generating every prompt draws the same
  trajectories as two engines each generating a contiguous share from its shard seed (`rollout.placement`),
  also when trajectories end at different turns;
- several engines with rewritten histories: `trajectory_train_rows` gives each data-parallel rank the
  trajectories owning the segment rows it trains, so after `localize` and the split every trained row has its
  behaviour logprobs;
- DAPO on multi-turn samples: dynamic sampling keeps whole trajectories by group, the overlong filter drops a
  trajectory whose last turn was cut, and the loss mask still excludes the observation tokens;
- the reward workers score multi-turn records (the environment reward travels in the pickled records) exactly as
  the in-process reward does;
- async checkpoints: in-flight multi-turn samples (turn ids, rewritten segments) survive `RolloutPipeline.state`,
  `torch.save` and `load_pending` (weights_only).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nemo_rollout_correction.rollout.multi_turn import OBSERVATION, EnvState, EnvStep, split_segments
from nemo_rollout_correction.rollout.multi_turn_loop import run_multi_turn
from nemo_rollout_correction.rollout.options import SamplingOptions
from nemo_rollout_correction.rollout.placement import prompt_shard, shard_request_seed
from nemo_rollout_correction.rollout.samples import RolloutBatch, RolloutSample
from nemo_rollout_correction.tasks.builtin import build_task
from nemo_rollout_correction.tasks.environments import (
    ENV_REWARD_KEY,
    environment_reward,
    trajectory_train_rows,
)
from nemo_rollout_correction.tasks.prompts import PromptRecord
from nemo_rollout_correction.tasks.reward_pool import RewardPool
from nemo_rollout_correction.tasks.rewards import score
from nemo_rollout_correction.trainer.async_rollouts import (
    PendingBatch,
    RolloutPipeline,
    load_pending,
    pending_file,
    restored_batches,
)
from nemo_rollout_correction.trainer.checkpoint_door import VerifiedCheckpoint
from nemo_rollout_correction.trainer.dynamic_sampling import (
    DapoOptions,
    apply_overlong_filter,
    collect_step_rollouts,
)
from nemo_rollout_correction.trainer.policy_update import train_rows


class SeededEngine:
    """Tokens drawn from the request seed alone (vLLM's contract: prompt i of a call gets `seed + i * n`, its n
    samples consecutive seeds), so a test sees exactly which seed each sample got. Counts its calls."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingOptions,
                 seed: int | None = None) -> RolloutBatch:
        assert seed is not None
        self.calls.append(len(prompt_token_ids))
        samples = []
        for i, prompt in enumerate(prompt_token_ids):
            for j in range(sampling.n):
                digest = hashlib.sha256(f"{seed + i * sampling.n + j}".encode()).digest()
                tokens = [10 + b % 50 for b in digest[:sampling.max_tokens]]
                samples.append(RolloutSample(prompt_index=i, prompt_token_ids=list(prompt), token_ids=tokens,
                                             logprobs=[-b / 100 for b in digest[:sampling.max_tokens]],
                                             finish_reason="length", text=" ".join(map(str, tokens))))
        return RolloutBatch(samples, n=sampling.n, seconds=0.0)


def _some_end_early(state: EnvState, turn: list[int]) -> EnvStep:
    """Ends a trajectory whose turn starts with an even token (about half of them, at every turn)."""
    if turn[0] % 2 == 0:
        return EnvStep(done=True, reward=1.0)
    return EnvStep(observation=[3, 4], reward=0.5)


def _run(engine: SeededEngine, prompts: list[list[int]], records: list[PromptRecord], seed: int,
         env: Any = _some_end_early) -> list[RolloutSample]:
    return run_multi_turn(engine, prompts, records, SamplingOptions(n=2, max_tokens=4), env,
                          encode=lambda text, turn: [1], decode=lambda ids: "", max_turns=4, max_model_len=512,
                          seed=seed).batch.samples


def test_turn_seeds_do_not_depend_on_the_number_of_engines() -> None:
    prompts = [[100 + p, 7] for p in range(5)]
    records = [PromptRecord(f"q{p}") for p in range(5)]
    n, call_seed = 2, 1234
    one = _run(SeededEngine(), prompts, records, call_seed)
    assert len({len(s.token_ids) for s in one}) > 2, "trajectories end at different turns"
    for engines in (2, 3):
        shared: list[RolloutSample] = []
        for e in range(engines):
            shard = prompt_shard(len(prompts), engines, e)
            seed = shard_request_seed(call_seed, shard.start, n)  # as RolloutFleet.generate_local seeds its engine
            got = _run(SeededEngine(), [prompts[i] for i in shard], [records[i] for i in shard], seed)
            shared += [dataclasses.replace(s, prompt_index=s.prompt_index + shard.start) for s in got]
        assert [(s.prompt_index, s.token_ids, s.logprobs, s.turn_ids) for s in shared] == \
            [(s.prompt_index, s.token_ids, s.logprobs, s.turn_ids) for s in one], engines


def test_a_turn_is_one_call_while_every_trajectory_is_live() -> None:
    engine = SeededEngine()
    samples = _run(engine, [[1, 2], [3, 4]], [PromptRecord("a"), PromptRecord("b")], 5,
                   env=lambda state, turn: EnvStep(observation=[9]))
    assert engine.calls == [2, 4, 4, 4]  # turn 0 (2 prompts x n=2), then one call of the 4 live trajectories
    assert all(max(s.turn_ids) == 3 for s in samples)


def _sample(prompt: int, tokens: int, *, segments: list[tuple[int, list[int]]] | None = None) -> RolloutSample:
    turn_ids = [0] * tokens
    return RolloutSample(prompt_index=prompt, prompt_token_ids=[1, 2], token_ids=list(range(20, 20 + tokens)),
                         logprobs=[-0.1 * (k + 1) for k in range(tokens)], finish_reason="stop", turn_ids=turn_ids,
                         segments=segments)


def test_trajectory_train_rows_give_each_rank_the_owners_of_its_segment_rows() -> None:
    plain = RolloutBatch([_sample(0, 3), _sample(0, 3)], n=2, seconds=0.0)

    def rows(num: int, dp: int) -> torch.Tensor:
        return train_rows(num, 1, 2, dp)

    assert trajectory_train_rows(plain, rows) is rows
    rewritten = RolloutBatch([_sample(0, 4), _sample(0, 6, segments=[(2, [5, 6]), (4, [7])]), _sample(1, 4),
                              _sample(1, 4)], n=2, seconds=0.0)
    split, owner = split_segments(rewritten.samples)
    assert owner == [0, 1, 1, 1, 2, 3]
    per_trajectory = trajectory_train_rows(rewritten, rows)
    assert per_trajectory(4, 0).tolist() == [0, 1] and per_trajectory(4, 1).tolist() == [1, 2, 3]
    for dp in range(2):  # what localize leaves on rank dp, then the step's split: every trained row has logprobs
        kept = set(per_trajectory(4, dp).tolist())
        local = [s if i in kept else dataclasses.replace(s, logprobs=[]) for i, s in enumerate(rewritten.samples)]
        local_rows, _ = split_segments(local)
        for row in rows(len(split), dp).tolist():
            assert local_rows[row].logprobs == split[row].logprobs and split[row].logprobs


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
    # the task's pool, with a start-up bound for a loaded machine (a worker imports tasks/environments.py)
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
    # only the rollouts file of a checkpoint here (the door's full check: tests/unit/test_checkpoint_data_only.py);
    # `read` loads it with weights_only=True all the same
    loaded = load_pending(VerifiedCheckpoint(step_dir=tmp_path, meta={}, tensor_names=()), 0)
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
