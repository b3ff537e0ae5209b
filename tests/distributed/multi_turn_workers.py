"""A recorded-shape multi-turn batch and what the gloo ranks of tests/distributed/test_multi_turn_gloo.py run.

The batch is built the way the trainer builds one: `RolloutSample`s with `turn_ids` (turns separated by
observation tokens) through `RolloutBatch.to_tensors`, so `loss_mask` excludes the observations and
`turn_index` names the turn of every sampled token. Observation positions carry wild logprobs on both sides:
any leak into the weights, the masks or the statistics would show.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.policy_loss import PolicyLossConfig
from nemo_rollout_correction.core.segments import Segments
from nemo_rollout_correction.distributed import ParallelGroups, build_parallel_groups, shard_sequence
from nemo_rollout_correction.losses import RolloutCorrectedPolicyLoss, StepDenominators
from nemo_rollout_correction.rollout.samples import RolloutBatch, RolloutSample

MAX_TURNS = 3
WIDTH = 32  # padded sequence length (divisible by 2 * cp)


def _cfg(**fields: Any) -> RolloutCorrectionConfig:
    return RolloutCorrectionConfig.from_dict({"rollout_token_veto_threshold": None, **fields})


CONFIGS: dict[str, RolloutCorrectionConfig] = {
    "seq_tis_turn": _cfg(rollout_is="sequence", rollout_is_threshold=1.5, sequence_unit="turn"),
    "seq_tis_trajectory": _cfg(rollout_is="sequence", rollout_is_threshold=1.5),
    "geo_mis_turn": _cfg(rollout_is="geometric", rollout_is_mode="mask", rollout_is_threshold=1.05,
                         sequence_unit="turn"),
    "seq_rs_veto_turn": _cfg(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.004, rollout_token_veto_threshold=1e-3,
                             sequence_unit="turn"),
}


def multi_turn_batch(seed: int = 0) -> dict[str, Tensor]:
    """8 trajectories of 1-3 turns with observations between turns; tensors `[8, WIDTH]` (next-token positions)
    plus `old` (the trainer's logprobs), `advantages` `[8]`."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for row in range(8):
        prompt = [1] * int(torch.randint(2, 5, (1,), generator=gen))
        turns = 1 + row % MAX_TURNS
        ids: list[int] = []
        turn_ids: list[int] = []
        for turn in range(turns):
            if turn:
                obs = int(torch.randint(1, 4, (1,), generator=gen))
                ids += [7] * obs
                turn_ids += [-1] * obs
            length = int(torch.randint(1, 6, (1,), generator=gen))
            ids += [3] * length
            turn_ids += [turn] * length
        logprobs = (-torch.rand(len(ids), generator=gen) * 2).tolist()
        samples.append(RolloutSample(prompt_index=row, prompt_token_ids=prompt, token_ids=ids, logprobs=logprobs,
                                     finish_reason="stop", turn_ids=turn_ids))
    tensors = RolloutBatch(samples, n=1, seconds=0.0).to_tensors()
    width = tensors["loss_mask"].shape[1]
    assert width <= WIDTH
    pad = WIDTH - width
    out = {k: torch.nn.functional.pad(tensors[k], (0, pad), value=v)
           for k, v in (("rollout_logprobs", 0.0), ("loss_mask", False), ("turn_index", -1),
                        ("observation_mask", False))}
    # the trainer's logprobs: near the engine's on sampled tokens (the mismatch grows with the turn), wild on
    # observations and everywhere else
    drift = 0.02 * (1 + out["turn_index"].clamp(min=0)) * torch.randn(8, WIDTH, generator=gen)
    old = torch.where(out["loss_mask"], out["rollout_logprobs"] + drift, -30.0 + 5 * torch.randn(8, WIDTH,
                                                                                                   generator=gen))
    out["rollout_logprobs"] = torch.where(out["observation_mask"], torch.full_like(old, 3.0), out["rollout_logprobs"])
    out["old"] = old
    out["advantages"] = torch.randn(8, generator=gen)
    return out


def correct_and_loss(cfg: RolloutCorrectionConfig, data: dict[str, Tensor], groups: ParallelGroups,
                     rows: list[tuple[int, int]], cp_rank: int, cp: int) -> dict[str, Any]:
    """The pre-pass over this rank's microbatches (`rows`), the step reduction, and each microbatch's loss and its
    gradient with respect to the current logprobs (the shards)."""
    module = RolloutCorrectedPolicyLoss(cfg, PolicyLossConfig(loss_agg_mode="token-mean"))

    def shard(x: Tensor, start: int, stop: int) -> Tensor:
        return shard_sequence(x[start:stop], cp, cp_rank, "load_balanced", dim=1)

    corrections, shards = [], []
    for start, stop in rows:
        batch = {k: shard(data[k], start, stop) for k in ("old", "rollout_logprobs", "loss_mask", "turn_index")}
        segments = Segments(batch["turn_index"], MAX_TURNS)
        corrections.append(module.correct(batch["old"], batch["rollout_logprobs"], batch["loss_mask"], groups,
                                          advantages=data["advantages"][start:stop], segments=segments))
        shards.append((start, stop, batch, segments))
    step = module.prepare_step(corrections, groups)
    den = StepDenominators.from_step(step)
    out: dict[str, Any] = {"metrics": step.metrics, "microbatches": []}
    for (start, stop, batch, segments), corr in zip(shards, corrections, strict=True):
        current = (batch["old"] + 0.01).clone().requires_grad_(True)
        res = module(current, batch["rollout_logprobs"], data["advantages"][start:stop], batch["loss_mask"], groups,
                     den, old_logprobs=batch["old"], correction=corr, segments=segments)
        (grad,) = torch.autograd.grad(res.loss, current)
        out["microbatches"].append({"rows": (start, stop), "loss": float(res.loss.detach()), "grad": grad,
                                    "keep": corr.keep_mask, "weights": corr.is_weights})
    return out


LAYOUTS = {"cp2": (2, 1, [[(0, 3), (3, 8)]]), "dp2": (1, 2, [[(0, 5)], [(5, 8)]])}


def worker(rank: int, world_size: int) -> dict[str, Any]:
    """Each layout on the 2 ranks: CP2 (every row split over both ranks) and DP2 (rows split)."""
    data = multi_turn_batch()
    out: dict[str, Any] = {}
    for name, (cp, dp, rows) in LAYOUTS.items():
        groups = build_parallel_groups(cp=cp, dp=dp)
        assert groups is not None
        for cfg_name, cfg in CONFIGS.items():
            out[(name, cfg_name)] = correct_and_loss(cfg, data, groups, rows[groups.dp_rank], groups.cp_rank, cp)
    return out


def reference(cfg: RolloutCorrectionConfig) -> dict[str, Any]:
    """One process, every row in one microbatch."""
    return correct_and_loss(cfg, multi_turn_batch(), ParallelGroups.single(), [(0, 8)], 0, 1)
