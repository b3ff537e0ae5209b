"""What the gloo ranks of tests/distributed/test_token_staleness_gloo.py run: the trainer's per-token staleness path.

A batch of samples whose tokens come from several policy versions (`RolloutSample.token_versions`, as partial
rollouts under async rollouts make them) goes through `RolloutBatch.to_tensors()["token_versions"]`, the trainer's
`token_staleness`, its row split (DP) and `shard_tokens` (the trainer's CP cut, Megatron's load-balanced chunks),
`staleness_mismatch_sums` on each rank's shard and `all_reduce_sums` over dp x cp (the step's sums), then
`staleness_metrics_from_sums`: the metrics `nrc train` reports.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nemo_rollout_correction.distributed import ParallelGroups, build_parallel_groups
from nemo_rollout_correction.distributed.runtime import all_reduce_sums
from nemo_rollout_correction.rollout.partial import (
    staleness_metrics_from_sums,
    staleness_mismatch_sums,
    token_staleness,
)
from nemo_rollout_correction.rollout.samples import RolloutBatch, RolloutSample

TRAINER_VERSION, NUM_LAGS = 6, 4


def batch(seed: int = 0) -> dict[str, Tensor]:
    """8 samples, prompts of 2-4 tokens, responses of 3-11 tokens sampled by versions 2..6 in order (a carried
    response spans several); `reference` the trainer's logprobs, off from the engine's by more on older tokens."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for row in range(8):
        prompt = [1] * int(torch.randint(2, 5, (1,), generator=gen))
        length = int(torch.randint(3, 12, (1,), generator=gen))
        first = int(torch.randint(2, 7, (1,), generator=gen))
        versions = sorted(min(first + int(torch.randint(0, 3, (1,), generator=gen)), TRAINER_VERSION)
                          for _ in range(length))
        logprobs = (-torch.rand(length, generator=gen) * 2).tolist()
        samples.append(RolloutSample(row, prompt, [3] * length, logprobs, "stop", token_versions=versions,
                                     policy_version=versions[0]))
    tensors = RolloutBatch(samples, n=1, seconds=0.0).to_tensors()
    staleness = token_staleness(tensors["token_versions"], TRAINER_VERSION)
    noise = torch.randn(staleness.shape, generator=gen)
    reference = tensors["rollout_logprobs"] + 0.05 * (1 + staleness.clamp(min=0)) * noise
    return {**tensors, "token_staleness": staleness, "reference": reference}


def metrics(groups: ParallelGroups, rows: Tensor) -> dict[str, float]:
    """This rank's rows, cut as `PolicyUpdate._microbatches` cuts them (to the longest row, then `shard_tokens`),
    summed per staleness and reduced over dp x cp."""
    from nemo_rollout_correction.harness.scoring import shard_tokens

    data = batch()
    lengths = data["prompt_lengths"][rows] + data["response_lengths"][rows]
    width = int(lengths.max())
    tokens = {k: data[k][rows, : width - 1] for k in ("reference", "rollout_logprobs", "loss_mask", "token_staleness")}
    shard = shard_tokens(data["input_ids"][rows, :width], tokens, groups, pad_id=0).tokens
    sums = staleness_mismatch_sums(shard["reference"], shard["rollout_logprobs"], shard["loss_mask"],
                                   shard["token_staleness"], NUM_LAGS)
    return staleness_metrics_from_sums(all_reduce_sums(sums, groups))


def worker(rank: int, world_size: int) -> dict[str, Any]:
    """CP2 (every row split over both ranks) and DP2 (rows 0-4 and 5-7)."""
    out: dict[str, Any] = {}
    for name, (cp, dp) in {"cp2": (2, 1), "dp2": (1, 2)}.items():
        groups = build_parallel_groups(cp=cp, dp=dp)
        assert groups is not None
        rows = torch.arange(8) if dp == 1 else torch.tensor_split(torch.arange(8), 2)[groups.dp_rank]
        out[name] = metrics(groups, rows)
    return out


def reference() -> dict[str, float]:
    """One process, every row."""
    return metrics(ParallelGroups.single(), torch.arange(8))
