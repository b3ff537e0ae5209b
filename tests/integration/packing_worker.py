"""Gloo worker of `test_sequence_packing`: one step of the trainer's `PolicyUpdate` on a fixed batch.

Each rank initialises Megatron's parallel state (TP x PP from the arguments, DP the rest), builds the tiny Llama
with `MegatronPolicy.from_hf` (and the frozen reference when the config has a KL penalty), cuts the batch with
`PolicyUpdate.cut` (so `policy.sequence_packing` and `policy.max_tokens_per_microbatch` decide the microbatches)
and runs the step's no-grad passes and updates (`PolicyUpdate.run`). It returns what the layouts must agree on:
each update's reduced sums and correction metrics and gradient norm, every row's logprobs of the first loss pass
and its pi_old (by sample index, so data-parallel ranks' rows can be put together), the gradient of the last
update (DDP's finalised buffer, TP = 1 only) and the final weights gathered under Hugging Face names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def _no_timer(_phase: str) -> Iterator[None]:
    yield


def worker(rank: int, world_size: int, hf_dir: str, tp: int, pp: int, configs: list[dict[str, Any]],
           tensors: dict[str, torch.Tensor], advantages: torch.Tensor) -> list[dict[str, Any]]:
    """One step per config (a fresh policy each), in one process start."""
    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.models.megatron_cpu import patch_cuda_for_cpu

    patch_cuda_for_cpu()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    try:
        return [_step(hf_dir, tp, pp, config, tensors, advantages) for config in configs]
    finally:
        ps.destroy_model_parallel()


def _step(hf_dir: str, tp: int, pp: int, config: dict[str, Any], tensors: dict[str, torch.Tensor],
          advantages: torch.Tensor) -> dict[str, Any]:
    from nemo_rollout_correction.config.loader import from_dict
    from nemo_rollout_correction.distributed.groups import ParallelGroups
    from nemo_rollout_correction.distributed.pipeline import broadcast_from_last_stage
    from nemo_rollout_correction.models.policy import MegatronPolicy
    from nemo_rollout_correction.trainer.policy_update import PolicyUpdate

    groups = ParallelGroups.from_megatron()
    cfg = from_dict(config)
    policy = MegatronPolicy.from_hf(hf_dir)
    reference = None
    if cfg.grpo.kl_coef > 0:
        reference = MegatronPolicy.from_hf(hf_dir)
        reference.model.eval()
        for param in reference.model.parameters():
            param.requires_grad_(False)
    update = PolicyUpdate(cfg, groups, policy, reference, pad_id=0)
    mini_batches = update.cut(tensors, advantages)
    scored, updates = update.run(mini_batches, 0, _no_timer)
    microbatches = [mb for mini in mini_batches for mb in mini]
    rows, logprobs, old = [], [], []
    if policy.is_last_stage:
        first = [p for u in updates[:len(mini_batches)] for p in u.passes]
        for mb, p, s in zip(microbatches, first, scored, strict=True):
            rows.append(mb.rows)
            logprobs.append(torch.where(mb.loss_mask, p.logprobs, 0.0).cpu())
            old.append(None if s.old_logprobs is None else torch.where(mb.loss_mask, s.old_logprobs, 0.0).cpu())
    grads = {}
    if tp == 1 and pp == 1:
        grads = {n: p.main_grad.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    weights = policy.hf_state_dict()  # every TP rank gathers
    return {
        "dp_rank": groups.dp_rank, "tp_rank": groups.tp_rank, "last": policy.is_last_stage,
        "num_microbatches": [len(mini) for mini in mini_batches],
        "widths": [[int(mb.input_ids.shape[1]) for mb in mini] for mini in mini_batches],
        "packed_tokens": [[None if mb.packed is None else mb.packed.total for mb in mini] for mini in mini_batches],
        "shares_prefixes": update.shares_prefixes,
        "results": [broadcast_from_last_stage((u.result.sums, u.result.rc_metrics), groups) for u in updates],
        "grad_norms": [u.applied.grad_norm for u in updates],
        "rows": rows, "logprobs": logprobs, "old_logprobs": old, "grads": grads, "weights": weights,
    }
