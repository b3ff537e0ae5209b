"""Gloo worker of `test_pipeline`: one training pass of a Hugging Face Llama through Megatron's schedule.

Each rank initialises Megatron's parallel state (TP x PP from the arguments), builds its stage with
`MegatronPolicy.from_hf`, scores the microbatches without gradient (`score_microbatches`), runs one
forward/backward pass with a logprob-weighted loss (`run_microbatches`), syncs a tied embedding's two
copies, measures the global gradient norm, and gathers the Hugging Face weights to stage 0 the way the
trainer's refit does. Gradients are returned under global (stage-independent) names so a PP = 1 run
is the reference.
"""

from __future__ import annotations

import re
from typing import Any

import torch


def _global_name(model: Any, name: str) -> str:
    match = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
    if match is None:
        return name
    layer = model.decoder.layers[int(match.group(1))].layer_number - 1
    return f"decoder.layers.{layer}.{match.group(2)}"


def worker(rank: int, world_size: int, hf_dir: str, microbatches: list[torch.Tensor], tp: int) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.distributed.groups import ParallelGroups
    from nemo_rollout_correction.distributed.pipeline import (
        broadcast_from_last_stage,
        gather_weights_to_first_stage,
        sync_tied_embedding_grads,
    )
    from nemo_rollout_correction.distributed.runtime import clip_grad_norm
    from nemo_rollout_correction.models.megatron_cpu import patch_cuda_for_cpu
    from nemo_rollout_correction.models.policy import MegatronPolicy
    from nemo_rollout_correction.models.schedule import run_microbatches

    patch_cuda_for_cpu()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=world_size // tp)
    try:
        groups = ParallelGroups.from_megatron()
        policy = MegatronPolicy.from_hf(hf_dir)
        scored = policy.score_microbatches(microbatches, temperature=0.7, top_k=50)
        assert (scored is None) != policy.is_last_stage

        def loss(index: int, logits: torch.Tensor) -> torch.Tensor:
            logprobs = policy.logprobs_from_logits(logits, microbatches[index])
            weights = torch.linspace(-1.0, 1.0, logprobs.shape[-1])  # a loss whose gradient is not trivial
            return (logprobs * weights).sum() / 100.0

        run_microbatches(policy.model, microbatches, loss, forward_only=False)
        sync_tied_embedding_grads(policy.model, groups)
        grads = {_global_name(policy.model, name): param.grad.detach().clone()
                 for name, param in policy.model.named_parameters() if param.grad is not None}
        norm = clip_grad_norm(list(policy.model.parameters()), 0.0, groups)
        weights = policy.hf_weights()  # every TP rank iterates (all-gathers); TP rank 0 sends its stage on
        if groups.tp_rank == 0:
            exported = {name: tensor.clone() for name, tensor in gather_weights_to_first_stage(weights, groups)}
        else:
            exported = {}
            for _ in weights:
                pass
        return {
            "pp_rank": groups.pp_rank, "tp_rank": groups.tp_rank, "last": policy.is_last_stage,
            "scored": broadcast_from_last_stage(scored, groups), "grads": grads, "grad_norm": norm,
            "exported": exported,
        }
    finally:
        ps.destroy_model_parallel()
