"""Gloo worker of `test_cpu_training`: Megatron's DDP vs `models.cpu_training.cpu_ddp_class()` on the same batch."""

from __future__ import annotations

from typing import Any

import torch


def ddp_gradients(rank: int, world_size: int, hf_dir: str, dtype: str) -> dict[str, Any]:
    """Per-parameter `main_grad` after two microbatches (backward + `finalize_model_grads`) through Megatron's
    `DistributedDataParallel` and through the CPU subclass, from the same weights; plus how often the fast
    accumulation ran."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from nemo_rollout_correction.distributed.cpu_compat import cuda_to_cpu
    from nemo_rollout_correction.models import cpu_training
    from nemo_rollout_correction.models.megatron_cpu import patch_cuda_for_cpu
    from nemo_rollout_correction.models.policy import MegatronPolicy
    from nemo_rollout_correction.models.schedule import run_microbatches

    calls = {"add_cast_": 0}
    original = cpu_training.add_cast_

    def counting_add_cast_(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["add_cast_"] += 1
        return original(*args, **kwargs)

    cpu_training.add_cast_ = counting_add_cast_  # type: ignore[assignment]
    patch_cuda_for_cpu()
    ps.initialize_model_parallel()
    try:
        gen = torch.Generator().manual_seed(100 + rank)
        batch = [torch.randint(0, 500, (2, 12), generator=gen) for _ in range(2)]
        grads = {}
        for name, ddp_class in (("megatron", DistributedDataParallel), ("cpu", cpu_training.cpu_ddp_class())):
            policy = MegatronPolicy.from_hf(hf_dir, params_dtype=dtype)
            config: Any = policy.model.config
            config.calculate_per_token_loss = True
            ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
            with cuda_to_cpu():
                ddp = ddp_class(config=config, ddp_config=ddp_config, module=policy.model)
            config.finalize_model_grads_func = finalize_model_grads

            def loss(index: int, logits: torch.Tensor, policy: Any = policy) -> torch.Tensor:
                return -policy.logprobs_from_logits(logits, batch[index]).sum() / 100.0

            ddp.zero_grad_buffer()
            run_microbatches(ddp, batch, loss, forward_only=False)
            grads[name] = {n: p.main_grad.detach().clone() for n, p in policy.model.named_parameters()}
        low_precision = sum(p.dtype != torch.float32 for p in policy.model.parameters() if p.requires_grad)
        return {"grads": grads, "calls": calls["add_cast_"], "low_precision_params": low_precision}
    finally:
        cpu_training.add_cast_ = original  # type: ignore[assignment]
        ps.destroy_model_parallel()
