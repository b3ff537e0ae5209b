"""CUDA smoke of the training machinery: Megatron DDP + optimizer, fp32/bf16/fp16, NCCL, world size 1.

Skipped without CUDA. On a GPU machine (in the repository root, with megatron-core installed):

    python -m pytest tests/gpu/test_megatron_optimizer_cuda.py -m gpu -q

It builds the tiny random Llama as a Megatron `GPTModel` on the GPU (`MegatronPolicy.from_hf`), wraps it
with `models.optimizer` (with and without the distributed optimizer), runs two updates of a logprob-weighted
loss through Megatron's schedule (which ends in `finalize_model_grads` on NCCL), and checks: every parameter
on the GPU, a finite loss and grad norm, fp32 main params, model weights of the policy dtype that moved, and an
LR that followed the warmup.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize(("dtype", "distributed"), [("bfloat16", True), ("bfloat16", False), ("float32", False),
                                                    ("float16", False)])
def test_optimizer_on_nccl(tmp_path: Path, dtype: str, distributed: bool) -> None:
    from nemo_rollout_correction.distributed.runtime import init_runtime, shutdown_runtime
    from nemo_rollout_correction.models.optimizer import OptimizerSettings, build_policy_optimizer
    from nemo_rollout_correction.models.policy import MegatronPolicy
    from nemo_rollout_correction.models.schedule import run_microbatches
    from nemo_rollout_correction.models.sources import TINY_LLAMA_BUILTIN, tiny_llama_dir

    runtime = init_runtime()  # NCCL when CUDA is available
    try:
        assert torch.distributed.get_backend() == "nccl"
        hf_dir = tiny_llama_dir(tmp_path / "tiny", **TINY_LLAMA_BUILTIN)
        policy = MegatronPolicy.from_hf(hf_dir, params_dtype=dtype)
        assert all(p.is_cuda for p in policy.model.parameters()), "every parameter on the GPU (norms included)"
        optim = build_policy_optimizer(policy.model, OptimizerSettings(
            lr=1e-3, use_distributed_optimizer=distributed, lr_warmup_steps=1, total_updates=2))
        gen = torch.Generator().manual_seed(0)
        batch = [torch.randint(0, 500, (4, 16), generator=gen) for _ in range(2)]
        before = policy.model.decoder.layers[0].mlp.linear_fc1.weight.detach().clone()
        losses: list[float] = []

        def loss(index: int, logits: torch.Tensor) -> torch.Tensor:
            value = -policy.logprobs_from_logits(logits, batch[index].cuda()).mean() / len(batch)
            losses.append(float(value))
            return value

        results = []
        for _ in range(2):
            optim.zero_grad()
            run_microbatches(optim.module, batch, loss, forward_only=False)
            results.append(optim.step())
        assert all(math.isfinite(x) for x in losses)
        assert all(math.isfinite(r.grad_norm) and r.grad_norm > 0 for r in results)
        assert [r.lr for r in results] == [0.0, 1e-3]  # warmup: update k uses lr * k / warmup
        assert optim.main_param_dtypes() == {torch.float32}
        after = policy.model.decoder.layers[0].mlp.linear_fc1.weight
        assert after.dtype == getattr(torch, dtype) and not torch.equal(after, before)
        del runtime
    finally:
        shutdown_runtime()
