"""Trainer wiring of rollout routing replay (R3, `rollout.routing_replay=r3`; the mechanism is
`models.routing_replay`).

The rollout batch carries each sample's routing (`to_tensors()["routed_experts"]`, broadcast with the samples);
`attach_microbatch` registers each microbatch's slice (after the CP split, with the same positions) with the
policy, whose every forward of the step then replays it; `router_agreement_metrics` reduces the agreement
counts into `rollout/router_agreement`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nemo_rollout_correction.distributed.groups import ParallelGroups
from nemo_rollout_correction.distributed.tensor_gather import all_gather_list
from nemo_rollout_correction.models.policy import MegatronPolicy

ROUTER_AGREEMENT = "rollout/router_agreement"
"""Fraction of (token, MoE layer) routing decisions where the trainer's own router picks the rollout's experts."""


def begin_step(policy: MegatronPolicy) -> None:
    """Forget the previous step's microbatches and agreement counts (a no-op without replay)."""
    if policy.routing is not None:
        policy.routing.clear()


def attach_microbatch(policy: MegatronPolicy, tensors: dict[str, Tensor], rows: Tensor, input_ids: Tensor,
                      position_ids: Tensor | None) -> None:
    """Replay rows `rows` of the batch's routing in every forward of the policy on `input_ids` `[rows, width]`.

    position_ids: the CP shard's `[width]` global positions (None without context parallelism).
    """
    if policy.routing is None:
        return
    if "routed_experts" not in tensors:
        raise RuntimeError("rollout.routing_replay=r3 but the rollout batch carries no routed experts")
    policy.routing.attach(input_ids, tensors["routed_experts"][rows], position_ids)


def router_agreement_metrics(policy: MegatronPolicy, groups: ParallelGroups) -> dict[str, float]:
    """`{rollout/router_agreement: matches / decisions}` over every rank's tokens and layers; {} without replay
    or when no decision was counted. Every rank must call it (collectives over dp x cp and pp)."""
    if policy.routing is None:
        return {}
    matches, decisions = policy.routing.agreement()
    counts = torch.tensor([matches, decisions], dtype=torch.float64)
    # DP x CP ranks hold different tokens and pipeline stages different layers: sum over both. TP ranks
    # hold copies of the same counts, which cancel in the ratio.
    counts = torch.stack(all_gather_list(counts, groups.dp_cp_group)).sum(0)
    counts = torch.stack(all_gather_list(counts, groups.pp_group)).sum(0)
    if counts[1] <= 0:
        return {}
    return {ROUTER_AGREEMENT: float(counts[0] / counts[1])}


__all__ = ["ROUTER_AGREEMENT", "attach_microbatch", "begin_step", "router_agreement_metrics"]
