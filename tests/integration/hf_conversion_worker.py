"""Gloo worker of `test_hf_conversion`: a Hugging Face Llama loaded into Megatron-Core at TP=2.

Each rank initialises Megatron's parallel state with TP=2, builds the policy from the HF directory
(`MegatronPolicy.from_hf`: sharded conversion), scores `input_ids` through the vocab-parallel logprobs,
backpropagates a simple loss, and exports the weights back to HF names (TP shards all-gathered).
"""

from __future__ import annotations

from typing import Any

import torch


def worker(rank: int, world_size: int, hf_dir: str, input_ids: torch.Tensor) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.models.megatron_cpu import patch_cuda_for_cpu
    from nemo_rollout_correction.models.policy import MegatronPolicy

    patch_cuda_for_cpu()
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        policy = MegatronPolicy.from_hf(hf_dir)
        logits = policy.logits(input_ids)
        logprobs = policy.logprobs_from_logits(logits, input_ids)
        logprobs.sum().backward()
        grad_norm_sq = sum(float(p.grad.double().pow(2).sum()) for p in policy.model.parameters()
                           if p.grad is not None and getattr(p, "tensor_model_parallel", False))
        exported = policy.hf_state_dict()
        return {"logprobs": logprobs.detach(), "logits_shard_shape": tuple(logits.shape), "exported": exported,
                "sharded_grad_norm_sq": grad_norm_sq}
    finally:
        ps.destroy_model_parallel()
