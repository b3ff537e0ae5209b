"""Gloo workers of `test_lora_training`: LoRA adapters (models/lora.py) on a tiny Llama through Megatron's machinery.

Every worker builds the policy with `MegatronPolicy.from_hf(lora=...)` for its TP/DP layout and updates it with
`optimizer_worker._Updater` (the trainer's loss path: Megatron's schedule on the DDP model, `finalize_model_grads`,
Megatron's optimizer). Results are gathered in Hugging Face names (PEFT adapter tensors, merged weights), which
do not depend on the layout, so the test compares layouts tensor by tensor.
"""

from __future__ import annotations

from typing import Any

import optimizer_worker
import torch

LORA = {"rank": 4, "alpha": 8.0}


def _policy(hf_dir: str, tp: int, dtype: str = "float32", **lora: Any) -> Any:
    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.models.lora import LoraConfig
    from nemo_rollout_correction.models.megatron_cpu import patch_cuda_for_cpu
    from nemo_rollout_correction.models.policy import MegatronPolicy

    patch_cuda_for_cpu()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    return MegatronPolicy.from_hf(hf_dir, params_dtype=dtype, lora=LoraConfig(**{**LORA, **lora}))


def train(rank: int, world_size: int, hf_dir: str, tp: int, distributed_optimizer: bool, steps: int,
          fused_cpu_adam: bool = True) -> dict[str, Any]:
    """`steps` LoRA updates; per update loss and grad norm; after each step the PEFT adapter tensors; at the end
    the merged Hugging Face weights, what the optimizer holds and whether the base weights moved."""
    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.models.lora import is_adapter_param
    from nemo_rollout_correction.models.optimizer import OptimizerSettings, build_policy_optimizer

    try:
        policy = _policy(hf_dir, tp)
        base = {n: p.detach().clone() for n, p in policy.model.named_parameters() if not is_adapter_param(n)}
        optim = build_policy_optimizer(policy.model, OptimizerSettings(
            lr=1e-2, total_updates=4, use_distributed_optimizer=distributed_optimizer, fused_cpu_adam=fused_cpu_adam))
        updater = optimizer_worker._Updater(policy, optim)
        updates, adapters = [], []
        for _ in range(steps):
            updates += [updater.update(mini) for mini in updater.mini_batches]
            adapters.append(policy.hf_adapter_state_dict())
        trainable = sorted(n for n, p in policy.model.named_parameters() if p.requires_grad)
        base_moved = [n for n, p in policy.model.named_parameters() if n in base and not torch.equal(p, base[n])]
        main = [tuple(p.shape) for group in optim.optimizer.param_groups for p in group["params"]]
        return {"updates": updates, "adapters": adapters, "merged": policy.hf_state_dict(), "trainable": trainable,
                "base_moved": base_moved, "main_shapes": main, "main_numel": sum(math_prod(s) for s in main)}
    finally:
        ps.destroy_model_parallel()


def math_prod(shape: tuple[int, ...]) -> int:
    out = 1
    for size in shape:
        out *= size
    return out


def dense_equivalence(rank: int, world_size: int, hf_dir: str) -> dict[str, Any]:
    """One loss on the LoRA model (random non-zero B) and on a plain model holding the merged weights W + s B A.

    Returns both logprobs, the adapters' gradients and the chain rule's (dL/dB = s G A^T, dL/dA = s B^T G with G
    the dense weight's gradient), and the adapters after one Megatron-optimizer update with the merged weights
    after it against W + s B' A' computed by hand.
    """
    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.models.lora import adapters
    from nemo_rollout_correction.models.policy import MegatronPolicy

    try:
        policy = _policy(hf_dir, 1)
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for _, adapter in adapters(policy.model):
                adapter.b.copy_(0.05 * torch.randn(adapter.b.shape, generator=gen))
        dense = MegatronPolicy.from_hf(hf_dir)
        merged = dict(policy.model.named_parameters())
        with torch.no_grad():
            for name, param in dense.model.named_parameters():
                module = name.removesuffix(".weight")
                adapter = getattr(policy.model.get_submodule(module), "lora", None) if name.endswith(".weight") \
                    else None
                if adapter is not None:
                    param.copy_(merged[name] + adapter.delta())
        ids = torch.randint(0, 500, (3, 12), generator=gen)
        weights = torch.randn(3, 11, generator=gen)
        lora_lp = policy.token_logprobs(ids)
        (lora_lp * weights).sum().backward()
        dense_lp = dense.token_logprobs(ids)
        (dense_lp * weights).sum().backward()
        dense_params = dict(dense.model.named_parameters())
        grads = {}
        for name, adapter in adapters(policy.model):
            g = dense_params[f"{name}.weight"].grad
            assert g is not None
            grads[name] = {"a": adapter.a.grad.clone(), "b": adapter.b.grad.clone(),
                           "a_chain": adapter.scale * adapter.b.detach().T @ g,
                           "b_chain": adapter.scale * g @ adapter.a.detach().T}
        return {"lora_logprobs": lora_lp.detach(), "dense_logprobs": dense_lp.detach(), "grads": grads,
                "base_grads": [n for n, p in policy.model.named_parameters()
                               if p.grad is not None and ".lora." not in n]}
    finally:
        ps.destroy_model_parallel()


def adam_step_equals_dense(rank: int, world_size: int, hf_dir: str) -> dict[str, Any]:
    """One Megatron-optimizer update of the adapters (the trainer's path) against torch Adam applied by hand to
    (A, B) with the chain-rule gradients of the dense merged weight, and the merged export after it."""
    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.models.lora import adapters
    from nemo_rollout_correction.models.optimizer import OptimizerSettings, build_policy_optimizer
    from nemo_rollout_correction.models.policy import MegatronPolicy

    try:
        policy = _policy(hf_dir, 1)
        gen = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for _, adapter in adapters(policy.model):
                adapter.b.copy_(0.05 * torch.randn(adapter.b.shape, generator=gen))
        before = {name: (ad.a.detach().clone(), ad.b.detach().clone()) for name, ad in adapters(policy.model)}
        # The dense side: W + s B A in a plain model; the same loss (the trainer's update, from the same batch).
        dense = MegatronPolicy.from_hf(hf_dir)
        with torch.no_grad():
            params = dict(dense.model.named_parameters())
            for name, adapter in adapters(policy.model):
                params[f"{name}.weight"].add_(adapter.delta())
        lr = 1e-2
        settings = OptimizerSettings(lr=lr, total_updates=2, grad_clip=0.0, fused_cpu_adam=False)
        optim = build_policy_optimizer(policy.model, settings)
        dense_optim = build_policy_optimizer(dense.model, settings)  # only to get the same loss path's gradients
        lora_update = optimizer_worker._Updater(policy, optim)
        dense_update = optimizer_worker._Updater(dense, dense_optim)
        (mini,) = lora_update.mini_batches
        lora_stats = lora_update.update(mini)
        # Dense gradients of the merged weights, same batch and loss (no step applied to compare with).
        (dense_mini,) = dense_update.mini_batches
        dense_optim.zero_grad()
        from nemo_rollout_correction.losses.step_plan import StepStats, microbatch_loss, plan_step
        from nemo_rollout_correction.models.schedule import run_microbatches

        plan = plan_step(dense_update.loss_fn, "decoupled", [mb["rollout_logprobs"] for mb in dense_mini],
                         [mb["loss_mask"] for mb in dense_mini], dense_update.groups,
                         reference_logprobs=[mb["old_logprobs"] for mb in dense_mini])

        def hook(i: int, logits: torch.Tensor) -> Any:
            mb = dense_mini[i]
            logprobs = dense.logprobs_from_logits(logits, mb["input_ids"])
            return microbatch_loss(plan, dense_update.loss_fn, i, logprobs, mb["rollout_logprobs"], mb["advantages"],
                                   mb["loss_mask"], dense_update.groups, StepStats(), old_logprobs=mb["old_logprobs"])

        run_microbatches(dense_optim.module, [mb["input_ids"] for mb in dense_mini], hook, forward_only=False)
        expected, after = {}, {}
        dense_params = dict(dense.model.named_parameters())
        for name, adapter in adapters(policy.model):
            a0, b0 = before[name]
            g = dense_params[f"{name}.weight"].main_grad.float()
            ga, gb = adapter.scale * b0.T @ g, adapter.scale * g @ a0.T
            a1, b1 = a0.clone().requires_grad_(), b0.clone().requires_grad_()
            adam = torch.optim.Adam([a1, b1], lr=lr, betas=(0.9, 0.999), eps=1e-8)
            a1.grad, b1.grad = ga, gb
            adam.step()
            expected[name] = (a1.detach(), b1.detach())
            after[name] = (adapter.a.detach().clone(), adapter.b.detach().clone())
        merged = policy.hf_state_dict()
        by_hand = {}
        with torch.no_grad():
            base = MegatronPolicy.from_hf(hf_dir)
            base_params = dict(base.model.named_parameters())
            for name, adapter in adapters(policy.model):
                base_params[f"{name}.weight"].add_(adapter.scale * adapter.b @ adapter.a)
            by_hand = base.hf_state_dict()
        return {"expected": expected, "after": after, "merged": merged, "by_hand": by_hand, "stats": lora_stats}
    finally:
        ps.destroy_model_parallel()


def _trained(hf_dir: str, tp: int, b_seed: int, rank: int = 8, alpha: float = 16.0) -> Any:
    """A LoRA policy whose B is seeded noise (a "trained" adapter: the base model is visibly changed)."""
    from nemo_rollout_correction.models.lora import adapters

    policy = _policy(hf_dir, tp, rank=rank, alpha=alpha)
    with torch.no_grad():
        for name, adapter in adapters(policy.model):
            gen = torch.Generator().manual_seed(b_seed * 1000 + sum(map(ord, name)))
            adapter.b.copy_(0.02 * torch.randn(adapter.b.shape, generator=gen))
    return policy


def adapter_versions(rank: int, world_size: int, hf_dir: str, b_seeds: list[int], export_dir: str) -> list[Any]:
    """Per B seed, the PEFT adapter tensors (the refit payload); the last seed's adapter exported as a PEFT
    directory (`export_dir/adapter`) and as merged Hugging Face weights (`export_dir/merged`)."""
    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.models.lora import LoraConfig
    from nemo_rollout_correction.models.lora_export import write_peft_adapter

    try:
        versions, policy = [], None
        for seed in b_seeds:
            ps.destroy_model_parallel()
            policy = _trained(hf_dir, 1, seed)
            versions.append(policy.hf_adapter_state_dict())
        assert policy is not None
        write_peft_adapter(f"{export_dir}/adapter", versions[-1], LoraConfig(rank=8, alpha=16.0), hf_dir)
        policy.save_hf(f"{export_dir}/merged")
        return versions
    finally:
        ps.destroy_model_parallel()


def score(rank: int, world_size: int, hf_dir: str, jobs: list[tuple[int | None, torch.Tensor]]) -> list[torch.Tensor]:
    """Per (B seed, sequences `[rows, width]`): the trainer's logprobs `[rows, width - 1]` under that seed's adapter
    (None: the base model)."""
    from megatron.core import parallel_state as ps

    out = []
    try:
        for b_seed, sequences in jobs:
            ps.destroy_model_parallel()
            policy = _trained(hf_dir, 1, b_seed) if b_seed is not None else _policy(hf_dir, 1, rank=0)
            with torch.no_grad():
                out.append(policy.token_logprobs(sequences).detach())
        return out
    finally:
        ps.destroy_model_parallel()


def save_at_tp(rank: int, world_size: int, hf_dir: str, tp: int, step_dir: str) -> dict[str, torch.Tensor]:
    """A "trained" LoRA policy at TP = `tp` saved as a checkpoint (model only); returns its PEFT adapter tensors."""
    from pathlib import Path

    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.distributed.runtime import barrier
    from nemo_rollout_correction.trainer import checkpoint as ckpt

    try:
        policy = _trained(hf_dir, tp, 5)
        ckpt.save_checkpoint(Path(step_dir), policy.model, None, rank=rank, save_optimizer=False)
        if rank == 0:
            ckpt.write_meta(Path(step_dir), {"step": 1, "has_optimizer": False,
                                             "layout": ckpt.current_layout(use_distributed_optimizer=False)})
        barrier()
        return policy.hf_adapter_state_dict()
    finally:
        ps.destroy_model_parallel()


def load_at_tp(rank: int, world_size: int, hf_dir: str, tp: int, step_dir: str) -> dict[str, torch.Tensor]:
    """A fresh LoRA policy (B = 0) at TP = `tp` with the checkpoint's weights loaded; its PEFT adapter tensors."""
    from pathlib import Path

    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.trainer import checkpoint as ckpt

    try:
        policy = _policy(hf_dir, tp, rank=8, alpha=16.0)
        ckpt.load_model_weights(Path(step_dir), policy.model)
        return policy.hf_adapter_state_dict()
    finally:
        ps.destroy_model_parallel()
