"""Gloo workers of `test_megatron_optimizer`: GRPO-style updates of a tiny Llama on Megatron's machinery.

Every worker builds the policy with `MegatronPolicy.from_hf`, wraps it with `models.optimizer`
(Megatron DDP + `get_megatron_optimizer` + `OptimizerParamScheduler`) and runs updates the way the trainer
does: `old_logprobs` scored before the first update, a decoupled `losses.step_plan` plan per mini-batch
(global denominators over dp), the loss pass through Megatron's schedule on the DDP model (which ends in
`finalize_model_grads`), then the optimizer step. The batch is seeded and identical on every rank; each dp
rank takes its contiguous share of every mini-batch, as `PolicyUpdate.cut` (trainer/policy_update.py) does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ROWS, WIDTH, PROMPT = 8, 14, 5  # 8 sequences of 14 tokens; the first 5 are the prompt


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 500, (ROWS, WIDTH), generator=gen)
    mask = torch.zeros(ROWS, WIDTH - 1, dtype=torch.bool)
    mask[:, PROMPT - 1:] = True
    return {"input_ids": ids, "loss_mask": mask, "advantages": torch.randn(ROWS, generator=gen),
            "noise": 0.05 * torch.randn(ROWS, WIDTH - 1, generator=gen)}


def _setup(hf_dir: str, dtype: str, **settings: Any) -> tuple[Any, Any]:
    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.models.megatron_cpu import patch_cuda_for_cpu
    from nemo_rollout_correction.models.optimizer import OptimizerSettings, build_policy_optimizer
    from nemo_rollout_correction.models.policy import MegatronPolicy

    patch_cuda_for_cpu()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel()
    policy = MegatronPolicy.from_hf(hf_dir, params_dtype=dtype)
    options = {"lr": 1e-3, "total_updates": 4, **settings}
    return policy, build_policy_optimizer(policy.model, OptimizerSettings(**options))


def _weights(policy: Any) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().clone() for name, p in policy.model.named_parameters()}


class _Updater:
    """The trainer's update loop on a fixed batch (decoupled token-TIS, PPO clip, token-mean)."""

    def __init__(self, policy: Any, optim: Any, *, num_mini_batches: int = 1, micro_batch_size: int = 2) -> None:
        from nemo_rollout_correction import RolloutCorrectionConfig
        from nemo_rollout_correction.core.policy_loss import PolicyLossConfig
        from nemo_rollout_correction.distributed.groups import ParallelGroups
        from nemo_rollout_correction.losses.rollout_corrected_pg import RolloutCorrectedPolicyLoss

        self.policy, self.optim = policy, optim
        self.groups = ParallelGroups.from_megatron()
        self.rc_cfg = RolloutCorrectionConfig.from_preset("token_tis")
        self.loss_fn = RolloutCorrectedPolicyLoss(self.rc_cfg, PolicyLossConfig())
        batch = _batch()
        self.mini_batches = []
        for part in torch.tensor_split(torch.arange(ROWS), num_mini_batches):
            rows = torch.tensor_split(part, self.groups.dp_size)[self.groups.dp_rank]
            self.mini_batches.append([{key: value[rows[i:i + micro_batch_size]] for key, value in batch.items()}
                                      for i in range(0, len(rows), micro_batch_size)])
        # old_logprobs: the policy before the first update; rollout_logprobs: them plus a seeded mismatch.
        for mini in self.mini_batches:
            scored = policy.score_microbatches([mb["input_ids"] for mb in mini])
            for mb, old in zip(mini, scored, strict=True):
                mb["old_logprobs"] = old
                mb["rollout_logprobs"] = old + mb["noise"]

    def update(self, mini: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        from nemo_rollout_correction.losses.step_plan import StepStats, finish_step, microbatch_loss, plan_step
        from nemo_rollout_correction.models.schedule import run_microbatches

        plan = plan_step(self.loss_fn, "decoupled", [mb["rollout_logprobs"] for mb in mini],
                         [mb["loss_mask"] for mb in mini], self.groups,
                         reference_logprobs=[mb["old_logprobs"] for mb in mini])
        stats = StepStats()

        def hook(i: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            mb = mini[i]
            logprobs = self.policy.logprobs_from_logits(logits, mb["input_ids"])
            return microbatch_loss(plan, self.loss_fn, i, logprobs, mb["rollout_logprobs"], mb["advantages"],
                                   mb["loss_mask"], self.groups, stats, old_logprobs=mb["old_logprobs"])

        self.optim.zero_grad()
        run_microbatches(self.optim.module, [mb["input_ids"] for mb in mini], hook, forward_only=False)
        applied = self.optim.step()
        sums = finish_step(plan, stats, self.rc_cfg, self.groups, agg_mode="token-mean").sums
        return {"loss": sums["loss"], "grad_norm": applied.grad_norm, "lr": applied.lr,
                "loss_scale": applied.loss_scale, "skipped": float(applied.skipped),
                "clipfrac": sums["pg_clipfrac_sum"] / max(sums["num_tokens"], 1.0)}


def train(rank: int, world_size: int, hf_dir: str, dtype: str, distributed_optimizer: bool, steps: int,
          num_mini_batches: int = 1, fused_cpu_adam: bool = True) -> dict[str, Any]:
    """`steps` steps of `num_mini_batches` updates; per update: loss, grad norm; weights after each step."""
    from megatron.core import parallel_state as ps

    try:
        policy, optim = _setup(hf_dir, dtype, use_distributed_optimizer=distributed_optimizer,
                               fused_cpu_adam=fused_cpu_adam)
        updater = _Updater(policy, optim, num_mini_batches=num_mini_batches)
        updates, weights = [], []
        for _ in range(steps):
            updates += [updater.update(mini) for mini in updater.mini_batches]
            weights.append(_weights(policy))
        model_dtypes = {name: p.dtype for name, p in policy.model.named_parameters()}
        return {"updates": updates, "weights": weights, "main_dtypes": optim.main_param_dtypes(),
                "model_dtypes": model_dtypes, "fused_adam": optim.fused_adam}
    finally:
        ps.destroy_model_parallel()


def versus_torch_adamw(rank: int, world_size: int, hf_dir: str, steps: int, fused: bool) -> dict[str, Any]:
    """The same updates through Megatron's optimizer and through the trainer's former optimizer
    (torch AdamW on the bare model, `fused` or its single-tensor loop, torch's global-norm clipping), from
    the same weights."""
    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.models.policy import MegatronPolicy
    from nemo_rollout_correction.models.schedule import run_microbatches

    try:
        policy, optim = _setup(hf_dir, "float32", grad_clip=0.5, adam_beta2=0.99)
        updater = _Updater(policy, optim)
        bare = MegatronPolicy.from_hf(hf_dir)
        params = [p for p in bare.model.parameters() if p.requires_grad]
        adamw = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0, fused=fused)
        megatron_runs, torch_runs = [], []
        for _ in range(steps):
            (mini,) = updater.mini_batches
            megatron_runs.append({**updater.update(mini), "weights": _weights(policy)})
            # The former path: the same loss on the bare model (.grad), torch's global-norm clip, AdamW.
            from nemo_rollout_correction.losses.step_plan import StepStats, microbatch_loss, plan_step

            plan = plan_step(updater.loss_fn, "decoupled", [mb["rollout_logprobs"] for mb in mini],
                             [mb["loss_mask"] for mb in mini], updater.groups,
                             reference_logprobs=[mb["old_logprobs"] for mb in mini])
            adamw.zero_grad(set_to_none=True)

            def hook(i: int, logits: torch.Tensor, mini: list[dict[str, torch.Tensor]] = mini,
                     plan: Any = plan) -> Any:
                mb = mini[i]
                logprobs = bare.logprobs_from_logits(logits, mb["input_ids"])
                return microbatch_loss(plan, updater.loss_fn, i, logprobs, mb["rollout_logprobs"],
                                       mb["advantages"], mb["loss_mask"], updater.groups, StepStats(),
                                       old_logprobs=mb["old_logprobs"])

            run_microbatches(bare.model, [mb["input_ids"] for mb in mini], hook, forward_only=False)
            norm = float(torch.nn.utils.clip_grad_norm_(params, 0.5))
            adamw.step()
            torch_runs.append({"grad_norm": norm, "weights": _weights(bare)})
        return {"megatron": megatron_runs, "torch": torch_runs, "fused_adam": optim.fused_adam}
    finally:
        ps.destroy_model_parallel()


def ppo_epochs(rank: int, world_size: int, hf_dir: str, epochs: int, lr: float) -> list[dict[str, float]]:
    """`epochs` passes over one seeded mini-batch; old_logprobs stay those before the first update."""
    from megatron.core import parallel_state as ps

    try:
        policy, optim = _setup(hf_dir, "float32", lr=lr)
        updater = _Updater(policy, optim)
        return [updater.update(updater.mini_batches[0]) for _ in range(epochs)]
    finally:
        ps.destroy_model_parallel()


def lr_schedule(rank: int, world_size: int, hf_dir: str, style: str, warmup: int, total: int) -> list[float]:
    """The LR each of `total` updates used (gradients zero: only the schedule matters)."""
    from megatron.core import parallel_state as ps

    try:
        _, optim = _setup(hf_dir, "float32", lr=1e-3, min_lr=1e-4, lr_warmup_steps=warmup,
                          lr_decay_style=style, total_updates=total)
        used = []
        for _ in range(total):
            optim.zero_grad()
            used.append(optim.step().lr)
        return used
    finally:
        ps.destroy_model_parallel()


def resume(rank: int, world_size: int, hf_dir: str, dtype: str, distributed_optimizer: bool,
           ckpt_dir: str) -> dict[str, Any]:
    """Two updates straight vs one update, checkpoint (trainer.checkpoint), fresh build, load, one update."""
    from megatron.core import parallel_state as ps

    from nemo_rollout_correction.distributed.runtime import barrier
    from nemo_rollout_correction.trainer import checkpoint as ckpt

    try:
        options = {"use_distributed_optimizer": distributed_optimizer}
        policy, optim = _setup(hf_dir, dtype, **options)
        updater = _Updater(policy, optim)
        straight = [updater.update(updater.mini_batches[0]) for _ in range(2)]
        straight_weights = _weights(policy)

        policy, optim = _setup(hf_dir, dtype, **options)
        updater = _Updater(policy, optim)
        first = updater.update(updater.mini_batches[0])
        step_dir = Path(ckpt_dir) / "step_1"
        ckpt.save_checkpoint(step_dir, policy.model, optim, rank=rank)  # collective, ends in a barrier
        if rank == 0:
            ckpt.write_meta(step_dir, {"step": 1, "has_optimizer": True, "layout": ckpt.current_layout(
                use_distributed_optimizer=distributed_optimizer)})
        barrier()  # meta.json written before any rank reads it

        fresh, fresh_optim = _setup(hf_dir, dtype, **options)
        ckpt.load_checkpoint(step_dir, fresh.model, fresh_optim, rank=rank, world_size=world_size)
        updater.policy, updater.optim = fresh, fresh_optim  # same batch and old_logprobs, restored state
        second = updater.update(updater.mini_batches[0])
        return {"straight": straight, "resumed": [first, second], "straight_weights": straight_weights,
                "resumed_weights": _weights(fresh)}
    finally:
        ps.destroy_model_parallel()
