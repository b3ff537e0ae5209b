"""Gloo worker of `test_routing_replay_layouts`: rollout routing replay under PP and CP.

Each rank builds its stage of a tiny Qwen3-MoE with `routing_replay=True`, attaches the same synthetic
rollout routing to every microbatch (CP ranks: their token share, cut with the same positions), then runs the
no-grad scoring pass and one forward/backward through Megatron's schedule on the DDP-wrapped model. It returns
what each of its routers used (routing maps under the router's global layer), the scores, the gradients under
global names and `rollout/router_agreement` reduced over the job.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from layout_pass import shard_microbatches, train_pass


def synthetic_routing(microbatches: list[torch.Tensor], num_layers: int, num_experts: int, topk: int
                      ) -> list[torch.Tensor]:
    """Random distinct expert ids `[rows, width, layers, topk]` per microbatch; the last 2 positions of row 0 -1."""
    generator = torch.Generator().manual_seed(5)
    out = []
    for ids in microbatches:
        rows, width = ids.shape
        scores = torch.rand(rows, width, num_layers, num_experts, generator=generator)
        routing = scores.topk(topk, dim=-1).indices
        routing[0, -2:] = -1
        out.append(routing.to(torch.int16))
    return out


def worker(rank: int, world_size: int, hf_dir: str, microbatches: list[torch.Tensor], routing: list[torch.Tensor],
           cp: int = 1) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router import TopKRouter

    from nemo_rollout_correction.distributed.groups import ParallelGroups
    from nemo_rollout_correction.distributed.pipeline import broadcast_from_last_stage
    from nemo_rollout_correction.harness.routing_replay import attach_microbatch, router_agreement_metrics
    from nemo_rollout_correction.models.megatron_cpu import patch_cuda_for_cpu
    from nemo_rollout_correction.models.optimizer import OptimizerSettings, build_policy_optimizer
    from nemo_rollout_correction.models.policy import MegatronPolicy

    patch_cuda_for_cpu()
    ps.initialize_model_parallel(context_parallel_size=cp, pipeline_model_parallel_size=world_size // cp)
    try:
        groups = ParallelGroups.from_megatron()
        policy = MegatronPolicy.from_hf(hf_dir, routing_replay=True)
        maps: dict[int, list[torch.Tensor]] = {}
        for module in policy.model.modules():
            if isinstance(module, TopKRouter):
                seen = maps.setdefault(module.layer_number - 1, [])
                module.register_forward_hook(lambda _m, _a, out, seen=seen: seen.append(out[1].detach().clone()))
        optim = build_policy_optimizer(policy.model, OptimizerSettings(lr=1e-3, grad_clip=0.0))
        tensors = {"routed_experts": torch.cat([F.pad(r, (0, 0, 0, 0, 0, 32 - r.shape[1]), value=-1)
                                                for r in routing])}
        shards = shard_microbatches(microbatches, cp, groups.cp_rank)
        start = 0
        for ids, local, index in zip(microbatches, shards.inputs, shards.positions, strict=True):
            rows = ids.shape[0]
            attach_microbatch(policy, tensors, torch.arange(start, start + rows), local, index if cp > 1 else None)
            start += rows
        scored = policy.score_microbatches(shards.inputs, labels=shards.labels, position_ids=shards.cp_positions)
        agreement = router_agreement_metrics(policy, groups)
        score_maps = {layer: list(seen) for layer, seen in maps.items()}
        grads = train_pass(policy, optim, shards)
        train_maps = {layer: seen[len(score_maps[layer]):] for layer, seen in maps.items()}
        return {
            "cp_rank": groups.cp_rank, "pp_rank": groups.pp_rank, "positions": shards.positions,
            "scored": broadcast_from_last_stage(scored, groups), "score_maps": score_maps, "train_maps": train_maps,
            "agreement": agreement, "grads": grads,
        }
    finally:
        ps.destroy_model_parallel()
