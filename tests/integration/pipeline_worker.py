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

import re
from typing import Any

import torch
import torch.nn.functional as F


def _global_name(model: Any, name: str) -> str:
    match = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
    if match is None:
        return name
    layer = model.decoder.layers[int(match.group(1))].layer_number - 1
    return f"decoder.layers.{layer}.{match.group(2)}"


def worker(rank: int, world_size: int, hf_dir: str, microbatches: list[torch.Tensor], tp: int,
           cp: int = 1) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.distributed.context_parallel import cp_token_indices
    from nemo_rollout_correction.distributed.groups import ParallelGroups
    from nemo_rollout_correction.distributed.pipeline import broadcast_from_last_stage, gather_weights_to_first_stage
    from nemo_rollout_correction.models.megatron_cpu import patch_cuda_for_cpu
    from nemo_rollout_correction.models.optimizer import OptimizerSettings, build_policy_optimizer
    from nemo_rollout_correction.models.policy import MegatronPolicy
    from nemo_rollout_correction.models.schedule import run_microbatches

    patch_cuda_for_cpu()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                 pipeline_model_parallel_size=world_size // (tp * cp))
    try:
        groups = ParallelGroups.from_megatron()
        policy = MegatronPolicy.from_hf(hf_dir)
        optim = build_policy_optimizer(policy.model, OptimizerSettings(lr=1e-3, grad_clip=0.0))
        # Per microbatch: inputs, labels (CP only), positions, and the loss weight of each label position.
        inputs, labels, positions, weights = [], [], [], []
        for ids in microbatches:
            width = ids.shape[1]
            weight = torch.linspace(-1.0, 1.0, width - 1)  # a loss whose gradient is not trivial
            if cp == 1:
                inputs.append(ids)
                positions.append(torch.arange(width))
                weights.append(weight)
                continue
            padded = -(-width // (2 * cp)) * 2 * cp
            full = F.pad(ids, (0, padded - width))
            next_ids = F.pad(ids[:, 1:], (0, padded - width + 1))
            index = cp_token_indices(padded, cp, groups.cp_rank)
            inputs.append(full[:, index])
            labels.append(next_ids[:, index])
            positions.append(index)
            weights.append(F.pad(weight, (0, padded - width + 1))[index])  # padding: weight 0
        label_list = labels if cp > 1 else None
        scored = policy.score_microbatches(inputs, labels=label_list, position_ids=positions if cp > 1 else None,
                                           temperature=0.7, top_k=50)
        assert (scored is None) != policy.is_last_stage

        def loss(index: int, logits: torch.Tensor) -> torch.Tensor:
            if label_list is None:
                logprobs = policy.logprobs_from_logits(logits, inputs[index])
            else:
                logprobs = policy.label_logprobs(logits, label_list[index])
            return (logprobs * weights[index]).sum() / 100.0

        optim.zero_grad()
        run_microbatches(optim.module, inputs, loss, forward_only=False, position_ids=positions if cp > 1 else None)
        # DDP's fp32 gradient buffer, finalised (CP sum, tied-embedding sync) at the end of the schedule.
        grads = {_global_name(policy.model, name): param.main_grad.detach().clone()
                 for name, param in policy.model.named_parameters() if param.requires_grad}
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
            "last": policy.is_last_stage, "positions": positions,
            "scored": broadcast_from_last_stage(scored, groups), "grads": grads, "grad_norm": norm,
            "exported": exported,
        }
    finally:
        ps.destroy_model_parallel()
