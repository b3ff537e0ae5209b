"""`rollout.placement`: the prompt sharding and request-seed arithmetic of one engine per DP group, the config."""

from __future__ import annotations

import pytest
import torch

from nemo_rollout_correction.config import ConfigError, load_config
from nemo_rollout_correction.rollout.placement import (
    STEP_SEED_STRIDE,
    check_seed_budget,
    prompt_shard,
    request_seed,
    resolve_placement,
    shard_request_seed,
)


@pytest.mark.parametrize("num_prompts", [0, 1, 3, 4, 7, 16])
@pytest.mark.parametrize("num_engines", [1, 2, 3, 8])
def test_prompt_shards_are_tensor_split_chunks(num_prompts: int, num_engines: int) -> None:
    expected = torch.tensor_split(torch.arange(num_prompts), num_engines)
    shards = [prompt_shard(num_prompts, num_engines, e) for e in range(num_engines)]
    assert [list(s) for s in shards] == [c.tolist() for c in expected]
    assert [i for s in shards for i in s] == list(range(num_prompts))  # contiguous, in order, each prompt once


@pytest.mark.parametrize(("num_prompts", "num_engines", "n"), [(4, 2, 4), (5, 2, 3), (7, 3, 1), (3, 4, 2)])
def test_every_sample_gets_the_seed_of_one_engine(num_prompts: int, num_engines: int, n: int) -> None:
    call_seed = 1234
    # one engine: prompt i's request has seed call_seed + i * n, and vLLM samples j of it from seed + j
    one_engine = [call_seed + i * n + j for i in range(num_prompts) for j in range(n)]
    sharded = []
    for engine in range(num_engines):
        shard = prompt_shard(num_prompts, num_engines, engine)
        seed = shard_request_seed(call_seed, shard.start, n)
        sharded += [seed + local * n + j for local in range(len(shard)) for j in range(n)]
    assert sharded == one_engine


def test_request_seeds_of_steps_and_refills_never_overlap() -> None:
    # 3 prompts x 2 samples per call: a refill (attempt k) starts where the seeds of attempt k - 1 end, the next
    # step STEP_SEED_STRIDE later; every sample seed of a step's calls is distinct from every other step's.
    prompts, n = 3, 2
    assert request_seed(7, 0, 0, prompts, n) == 7
    assert request_seed(7, 0, 1, prompts, n) == 7 + prompts * n
    assert request_seed(7, 2, 0, prompts, n) == 7 + 2 * STEP_SEED_STRIDE
    seeds = [request_seed(0, step, attempt, prompts, n) + i for step in range(3) for attempt in range(4)
             for i in range(prompts * n)]
    assert len(set(seeds)) == len(seeds)
    check_seed_budget(STEP_SEED_STRIDE - 1)
    with pytest.raises(ValueError, match=r"grpo\.max_refill_batches"):
        check_seed_budget(STEP_SEED_STRIDE)


def test_auto_is_per_dp_group_only_with_data_parallelism() -> None:
    assert resolve_placement("auto", 1) == "rank0"
    assert resolve_placement("auto", 2) == "per_dp_group"
    assert resolve_placement("rank0", 4) == "rank0"
    assert resolve_placement("per_dp_group", 1) == "per_dp_group"


def test_auto_is_rank0_for_a_job_of_one_engine() -> None:
    """Async partial rollouts keep their pool in one engine's worker: `auto` gives them rank0 at any DP size."""
    assert resolve_placement("auto", 2, one_engine=True) == "rank0"
    assert resolve_placement("auto", 1, one_engine=True) == "rank0"


def test_bad_placement_is_named() -> None:
    with pytest.raises(ValueError, match=r"rollout.placement='everywhere'.*auto, per_dp_group, rank0"):
        resolve_placement("everywhere", 2)
    with pytest.raises(ConfigError, match=r"rollout.placement.*'auto', 'per_dp_group', 'rank0'"):
        load_config(["rollout.placement=everywhere"])
    assert load_config(["rollout.placement=per_dp_group"]).rollout.placement == "per_dp_group"
    assert load_config([]).rollout.placement == "auto"


def test_shard_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="engine must lie in"):
        prompt_shard(4, 2, 2)
    with pytest.raises(ValueError, match="num_engines"):
        prompt_shard(4, 0, 0)


def test_rows_shared_without_logprobs_and_routing_are_zero_and_unrouted() -> None:
    from nemo_rollout_correction.rollout.samples import RolloutBatch, RolloutSample

    routing = torch.arange(4 * 2 * 1, dtype=torch.int16).reshape(4, 2, 1)  # [prompt + response - 1, layers, topk]
    here = RolloutSample(0, [5, 6], [7, 8, 9], [-0.5, -1.0, -1.5], "length", routed_experts=routing)
    elsewhere = RolloutSample(0, [5, 6], [3, 4], [], "stop", origin=(1, 0, 0, 1))  # another group trains it
    tensors = RolloutBatch([here, elsewhere], n=2, seconds=0.0).to_tensors()
    assert tensors["rollout_logprobs"][0, 1:4].tolist() == [-0.5, -1.0, -1.5]
    assert tensors["rollout_logprobs"][1].abs().sum() == 0
    assert tensors["loss_mask"][1].sum() == 2  # the row's tokens are still laid out
    assert tensors["input_ids"][1, :4].tolist() == [5, 6, 3, 4]
    assert torch.equal(tensors["routed_experts"][0, :4], routing)
    assert (tensors["routed_experts"][1] == -1).all()
