"""Gloo worker of `test_hf_export`: a perturbed ("trained") policy at a TP/PP layout, scored and exported.

Each rank initialises Megatron's parallel state (TP from the arguments, PP = world size / TP), builds its
stage with `MegatronPolicy.from_hf`, moves every weight by seeded noise (so an export that copied the source
checkpoint would fail the comparison), scores `input_ids` through Megatron's schedule (the live policy's
logprobs, on the last stage) and runs `export_hf` once per requested (directory, dtype, shard size).
"""

from __future__ import annotations

import re
import zlib
from typing import Any

import torch


def _canonical_name(model: Any, name: str, tied: bool) -> str:
    """A layout-independent name: global layer index; a tied output layer is the embedding it copies."""
    if tied and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    match = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
    if match is None:
        return name
    return f"decoder.layers.{model.decoder.layers[int(match.group(1))].layer_number - 1}.{match.group(2)}"


def worker(rank: int, world_size: int, hf_dir: str, input_ids: torch.Tensor, tp: int,
           exports: list[tuple[str, str, str]]) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.distributed.groups import ParallelGroups
    from nemo_rollout_correction.models.hf_export import export_hf
    from nemo_rollout_correction.models.megatron_cpu import patch_cuda_for_cpu
    from nemo_rollout_correction.models.policy import MegatronPolicy

    patch_cuda_for_cpu()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=world_size // tp)
    try:
        policy = MegatronPolicy.from_hf(hf_dir)
        with torch.no_grad():
            for name, param in policy.model.named_parameters():
                canonical = _canonical_name(policy.model, name, policy.arch.tie_word_embeddings)
                gen = torch.Generator().manual_seed(zlib.crc32(canonical.encode()))
                param.add_(0.05 * torch.randn(param.shape, generator=gen))
        scored = policy.score_microbatches([input_ids])
        groups = ParallelGroups.from_megatron()
        written = [export_hf(policy, out, groups, dtype=dtype, max_shard_size=size) for out, dtype, size in exports]
        return {"logprobs": None if scored is None else scored[0], "written": [str(w) if w else None for w in written]}
    finally:
        ps.destroy_model_parallel()
