"""Gloo worker of `test_pipeline`: one training pass of a Hugging Face Llama through Megatron's schedule.

Each rank initialises Megatron's parallel state (TP x CP x PP from the arguments), builds its stage
with `MegatronPolicy.from_hf`, wraps it for training (`models.optimizer`: Megatron DDP + optimizer), scores
the microbatches without gradient (`score_microbatches`), runs one forward/backward pass with a
logprob-weighted loss (`run_microbatches` on the DDP model), after which Megatron's `finalize_model_grads`
has summed gradients over CP (each CP rank holds part of every sequence's tokens) and synced a tied
embedding's two copies; gathers the Hugging Face weights to stage 0 the way the trainer's refit does, and
takes the global gradient norm from Megatron's optimizer step.

With CP > 1 every microbatch is padded to a multiple of 2 * cp and cut in Megatron's load-balanced
layout; the next-token labels are cut from the full sequence with the same indices, and the scores
are returned with their global positions so the test can reassemble them. Gradients are returned under
global (stage-independent) names so a one-rank run is the reference.
"""

from __future__ import annotations

from typing import Any

import torch
from layout_pass import shard_microbatches, train_pass


def worker(rank: int, world_size: int, hf_dir: str, microbatches: list[torch.Tensor], tp: int,
           cp: int = 1) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.distributed.groups import ParallelGroups
    from nemo_rollout_correction.distributed.pipeline import broadcast_from_last_stage, gather_weights_to_first_stage
    from nemo_rollout_correction.models.megatron_cpu import patch_cuda_for_cpu
    from nemo_rollout_correction.models.optimizer import OptimizerSettings, build_policy_optimizer
    from nemo_rollout_correction.models.policy import MegatronPolicy

    patch_cuda_for_cpu()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                 pipeline_model_parallel_size=world_size // (tp * cp))
    try:
        groups = ParallelGroups.from_megatron()
        policy = MegatronPolicy.from_hf(hf_dir)
        optim = build_policy_optimizer(policy.model, OptimizerSettings(lr=1e-3, grad_clip=0.0))
        shards = shard_microbatches(microbatches, cp, groups.cp_rank)
        scored = policy.score_microbatches(shards.inputs, labels=shards.labels, position_ids=shards.cp_positions,
                                           temperature=0.7, top_k=50)
        assert (scored is None) != policy.is_last_stage
        grads = train_pass(policy, optim, shards)
        weights_iter = policy.hf_weights()  # every TP rank iterates (all-gathers); TP rank 0 sends its stage on
        exported: dict[str, torch.Tensor] = {}
        if groups.tp_rank == 0 and groups.cp_rank == 0:
            exported = {name: t.clone() for name, t in gather_weights_to_first_stage(weights_iter, groups)}
        else:
            for _ in weights_iter:
                pass
        norm = optim.step().grad_norm  # after the export: the exported weights are the loaded ones
        return {
            "pp_rank": groups.pp_rank, "tp_rank": groups.tp_rank, "cp_rank": groups.cp_rank,
            "last": policy.is_last_stage, "positions": shards.positions,
            "scored": broadcast_from_last_stage(scored, groups), "grads": grads, "grad_norm": norm,
            "exported": exported,
        }
    finally:
        ps.destroy_model_parallel()
