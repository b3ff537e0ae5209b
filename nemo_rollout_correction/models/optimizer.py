"""The policy's training machinery, all Megatron-Core: DDP, the (distributed) optimizer, the LR schedule.

`build_policy_optimizer(model, settings)` wraps a policy stage the way Megatron-LM does:

- `megatron.core.distributed.DistributedDataParallel` owns the gradients: one contiguous fp32 buffer
  (`param.main_grad`, `grad_reduce_in_fp32=True` whatever the parameter dtype) that backward accumulates
  into; Megatron's `finalize_model_grads` (set as the schedule's `finalize_model_grads_func`) then sums it
  over data x context parallelism (an all-reduce, or a reduce-scatter with the distributed optimizer),
  syncs the two copies of a tied embedding across pipeline stages and, when the loss pass returned token
  counts, divides by their global sum (Megatron's `calculate_per_token_loss`). With
  `calculate_per_token_loss=True` DDP SUMS over DP (no 1/dp): the trainer's microbatch losses are already
  divided by the step's global denominator, so the sum is the full-batch gradient.
- `megatron.core.optimizer.get_megatron_optimizer`: Adam (decoupled weight decay, none on biases and norm
  weights: Megatron's grouping), global-norm clipping (`clip_grad`), and for bf16/fp16 parameters fp32
  main weights inside the optimizer (fp16 adds Megatron's dynamic loss scaler, installed as the schedule's
  `grad_scale_func`). `use_distributed_optimizer=True` shards the main weights and Adam moments over DP
  (ZeRO-1): a reduce-scatter of gradients and an all-gather of updated weights replace the all-reduce.
- `megatron.core.optimizer_param_scheduler.OptimizerParamScheduler`: linear warmup, then constant, linear
  or cosine decay to `min_lr` over the run's optimizer updates; stepped after every update (as in
  Megatron-LM: update k, counted from 0, uses lr(k)).

The bare model stays the policy's `model` (weight export, scoring); the DDP wrapper is what the loss pass
runs through (its backward hooks fill the gradient buffer). On CPU all of it runs inside
`distributed.cpu_compat.cuda_to_cpu()`, with the fast paths of `models.cpu_training`: a vectorised
bf16/fp16 -> fp32 gradient accumulation and no temporaries in Megatron's no-Apex `multi_tensor_scale`
(both bit-identical), and torch's fused CPU Adam for the regular (not distributed) optimizer (about 1 fp32
ulp from Megatron's single-tensor Adam on some elements; the distributed optimizer keeps that loop: with
the fused kernel on its DP-dependent shards, bf16 DP = 2 moved one weight a bf16 ulp away from DP = 1). On
GPU these are the plain library calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

import torch
from torch import nn

from nemo_rollout_correction.distributed.cpu_compat import cuda_to_cpu
from nemo_rollout_correction.models.cpu_training import (
    cpu_ddp_class,
    install_multi_tensor_scale,
    use_fused_cpu_adam,
)

LrDecayStyle = Literal["constant", "linear", "cosine"]
"""`policy.lr_decay_style`: the LR after warmup (Megatron's `OptimizerParamScheduler` styles we expose)."""
LR_DECAY_STYLES: tuple[str, ...] = get_args(LrDecayStyle)


# ruff: noqa: RUF009  (`_key` returns dataclasses.field(...); ruff cannot see that and flags Literal-typed defaults)
def _key(default: Any, help: str) -> Any:
    """A field with its default and its one-line help (docs/configuration.md is generated from it)."""
    return field(default=default, metadata={"help": help})


def _refuse(key: str, value: object, allowed: str) -> None:
    raise ValueError(f"policy.{key}={value!r} is not allowed: {allowed}")


@dataclass(frozen=True)
class PolicyOptimizerConfig:
    """The optimizer and LR schedule keys of `policy.*`: each written once, here; the config schema's
    `PolicyConfig` extends this class (Megatron's pattern: a component owns its config, the top config
    composes them). Checked on construction; an error names the `policy.<key>`."""

    lr: float = _key(3e-5, "Adam learning rate.")
    weight_decay: float = _key(0.0, "Decoupled Adam weight decay (Megatron: not on biases and norm weights).")
    adam_beta1: float = _key(0.9, "Adam beta1.")
    adam_beta2: float = _key(0.999, "Adam beta2.")
    adam_eps: float = _key(1e-8, "Adam epsilon.")
    grad_clip: float = _key(1.0, "Clip the global gradient norm to this value; 0 disables clipping.")
    use_distributed_optimizer: bool = _key(False, "Shard fp32 main weights and Adam state over data parallelism "
                                           "(Megatron's distributed optimizer, ZeRO-1).")
    lr_warmup_steps: int = _key(0, "Optimizer updates of linear LR warmup from 0 to policy.lr.")
    lr_decay_style: LrDecayStyle = _key("constant", "LR after warmup: constant, or linear/cosine decay to "
                                        "policy.min_lr over the run's optimizer updates.")
    min_lr: float = _key(0.0, "Learning rate at the end of a linear or cosine decay.")

    def __post_init__(self) -> None:
        if not self.lr_warmup_steps >= 0:
            _refuse("lr_warmup_steps", self.lr_warmup_steps, "must be >= 0")
        if not 0.0 <= self.min_lr <= self.lr:
            _refuse("min_lr", self.min_lr, f"must be in [0, policy.lr={self.lr:g}]")
        if not (math.isfinite(self.lr) and self.lr > 0):
            _refuse("lr", self.lr, "must be a finite number > 0")
        if not self.weight_decay >= 0.0:
            _refuse("weight_decay", self.weight_decay, "must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                _refuse(name, getattr(self, name), "must be in [0, 1)")
        if not (math.isfinite(self.adam_eps) and self.adam_eps > 0):
            _refuse("adam_eps", self.adam_eps, "must be a finite number > 0")
        if not self.grad_clip >= 0.0:
            _refuse("grad_clip", self.grad_clip, "must be >= 0")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            _refuse("lr_decay_style", self.lr_decay_style, f"allowed: {', '.join(LR_DECAY_STYLES)}")


@dataclass(frozen=True)
class OptimizerSettings(PolicyOptimizerConfig):
    """What the policy optimizer needs: the `policy.*` optimizer keys (`PolicyOptimizerConfig`) and what the run adds.

    total_updates: optimizer updates of the whole run (run.num_steps x num_mini_batches x ppo_epochs):
    the LR decays over them.
    """

    total_updates: int = 1
    initial_loss_scale: float = 2.0**16
    fused_cpu_adam: bool = True
    """On CPU with the regular optimizer, Adam runs torch's fused kernel (`models.cpu_training`, item 3); False
    keeps Megatron's single-tensor loop, the one the distributed optimizer always uses (tests compare the two
    optimizers with the same Adam arithmetic). Ignored with CUDA and with the distributed optimizer."""

    @classmethod
    def from_config(cls, config: PolicyOptimizerConfig, **run: Any) -> OptimizerSettings:
        """The settings of `config` (the run's `policy` section) with what the run adds (`total_updates=...`)."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(PolicyOptimizerConfig)}, **run)


@dataclass(frozen=True)
class UpdateResult:
    """One optimizer update: the pre-clip global gradient norm, the LR it used, the fp16 loss scale."""

    grad_norm: float
    lr: float
    loss_scale: float
    skipped: bool
    """fp16: the dynamic loss scaler found inf/NaN gradients and skipped the update (and lowered the scale)."""


def _param_dtype(model: nn.Module) -> torch.dtype:
    """The model's working dtype: bf16/fp16 if any parameter has it. The norm weights stay fp32 in a bf16
    model (torch norm fallback), and a later pipeline stage's FIRST parameter is such a norm weight: taking
    the first parameter's dtype built an fp32 optimizer there, Adam updating the bf16 weights directly with
    no fp32 main weights (found by the PP=2 checkpoint test)."""
    dtypes = {p.dtype for p in model.parameters()}
    for half in (torch.bfloat16, torch.float16):
        if half in dtypes:
            return half
    return next(iter(dtypes)) if dtypes else torch.float32


class PolicyOptimizer:
    """Megatron DDP + optimizer + LR scheduler for one policy stage (see the module doc)."""

    def __init__(self, model: nn.Module, settings: OptimizerSettings) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.settings = settings  # checked on construction (PolicyOptimizerConfig.__post_init__)
        dtype = _param_dtype(model)
        config: Any = model.config
        # Read by DDP at construction (sum over DP instead of averaging) and by the schedule; the loss
        # hooks return per-microbatch token counts only when the gradients must be divided afterwards.
        config.calculate_per_token_loss = True
        config.fp16 = dtype == torch.float16
        config.bf16 = dtype == torch.bfloat16
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=settings.use_distributed_optimizer,
        )
        # Megatron clips only when clip_grad > 0 and reports no norm otherwise; an infinite bound measures
        # the norm without ever scaling (clip coefficient = inf / norm > 1).
        clip = settings.grad_clip if settings.grad_clip > 0 else float("inf")
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=settings.lr,
            min_lr=settings.min_lr,
            weight_decay=settings.weight_decay,
            adam_beta1=settings.adam_beta1,
            adam_beta2=settings.adam_beta2,
            adam_eps=settings.adam_eps,
            clip_grad=clip,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            params_dtype=dtype,
            initial_loss_scale=settings.initial_loss_scale,
            use_distributed_optimizer=settings.use_distributed_optimizer,
        )
        # On CPU: Megatron's machinery with the fast paths of `models.cpu_training` (a vectorised bf16/fp16 ->
        # fp32 gradient accumulation, no temporaries in the no-Apex `multi_tensor_scale`: both bit-identical;
        # torch's fused Adam with the regular optimizer).
        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            install_multi_tensor_scale()
        ddp_class = cpu_ddp_class() if on_cpu else DistributedDataParallel
        with cuda_to_cpu():
            self.ddp = ddp_class(config=config, ddp_config=ddp_config, module=model)
            self.optimizer = get_megatron_optimizer(opt_config, [self.ddp])
        if on_cpu and settings.fused_cpu_adam and not settings.use_distributed_optimizer:
            # torch's fused CPU Adam: whole parameters on every rank, so results stay independent of DP;
            # the distributed optimizer's DP-dependent shards keep Megatron's single-tensor loop (see
            # models.cpu_training, item 3).
            use_fused_cpu_adam(self.optimizer)
        config.finalize_model_grads_func = finalize_model_grads
        # fp16: the schedule multiplies each microbatch loss by the current loss scale before backward;
        # the optimizer unscales the main gradients (and skips the update on inf/NaN).
        config.grad_scale_func = self.optimizer.scale_loss if config.fp16 else None
        # Megatron asserts warmup < decay steps; a one-update run still gets a valid (trivial) schedule.
        decay_steps = max(settings.total_updates, settings.lr_warmup_steps + 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=settings.lr,
            min_lr=settings.min_lr,
            lr_warmup_steps=settings.lr_warmup_steps,
            lr_decay_steps=decay_steps,
            lr_decay_style=settings.lr_decay_style,
            start_wd=settings.weight_decay,
            end_wd=settings.weight_decay,
            wd_incr_steps=decay_steps,
            wd_incr_style="constant",
        )

    @property
    def module(self) -> nn.Module:
        """The DDP-wrapped model: run the loss pass through it (its hooks fill the gradient buffer)."""
        module: nn.Module = self.ddp
        return module

    @property
    def lr(self) -> float:
        """The learning rate the next update will use."""
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 unless fp16)."""
        return float(self.optimizer.get_loss_scale())

    def zero_grad(self) -> None:
        """Zero the DDP gradient buffers (and the optimizer's main gradients) before a loss pass."""
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> UpdateResult:
        """Apply one update from the finalised gradients, then advance the LR schedule.

        The gradients must have been finalised (`finalize_model_grads` runs at the end of the schedule's
        backward pass). Every rank of the job calls it (the norm and the distributed optimizer's
        all-gather are collectives).
        """
        lr, scale = self.lr, self.loss_scale
        with cuda_to_cpu():
            success, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        return UpdateResult(grad_norm=float(grad_norm) if grad_norm is not None else float("nan"), lr=lr,
                            loss_scale=scale, skipped=not success)

    @property
    def fused_adam(self) -> bool:
        """Whether Adam runs torch's fused CPU kernel (CPU, regular optimizer; see `models.cpu_training`)."""
        return any(group.get("fused") is True for opt in _chained(self.optimizer)
                   for group in getattr(getattr(opt, "optimizer", None), "param_groups", []))

    def main_param_dtypes(self) -> set[torch.dtype]:
        """Dtypes of the parameters the optimizer updates (fp32 main params for bf16/fp16 models)."""
        return {p.dtype for group in self.optimizer.param_groups for p in group["params"]}

    def state_dict(self) -> dict[str, Any]:
        """Everything an exact resume at the same layout needs: optimizer (main params, moments, loss
        scaler) and scheduler. With the distributed optimizer each rank saves its own shard of the
        parameter state (`get_parameter_state_dp_reshardable`: per-rank, no gather)."""
        state: dict[str, Any] = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.settings.use_distributed_optimizer:
            state["param_state"] = [_mark_unpadded(opt.get_parameter_state_dp_reshardable())
                                    for opt in _chained(self.optimizer)]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` (same layout: same TP/PP/CP/DP sizes and distributed-optimizer setting)."""
        with cuda_to_cpu(), torch.no_grad():  # in-place copies into the main params (leaf tensors)
            self.optimizer.load_state_dict(state["optimizer"])
            if self.settings.use_distributed_optimizer:
                for opt, shard in zip(_chained(self.optimizer), state["param_state"], strict=True):
                    opt.load_parameter_state_from_dp_reshardable(shard)
            untie_adam_steps(self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])


def _mark_unpadded(state: dict[Any, Any]) -> dict[Any, Any]:
    """Megatron 0.16.1's `load_parameter_state_from_dp_reshardable` filters entries on a `padding` flag that
    its `get_parameter_state_dp_reshardable` never writes (only the sharded-checkpoint path adds it); every
    entry of that per-rank state is a real parameter range, so mark each one as not padding."""
    for key, per_dtype in state.items():
        if isinstance(key, int):
            for buckets in per_dtype.values():
                for bucket in buckets:
                    for entry in bucket:
                        entry.setdefault("padding", False)
    return state


def untie_adam_steps(optimizer: Any) -> None:
    """Give every parameter's Adam state its own `step` tensor after a load.

    Megatron 0.16.1's `DistributedOptimizer.load_state_dict`, on its path for torch's own Adam (no Apex or
    Transformer Engine: the CPU case), stores ONE step tensor object in the state of every parameter. torch's
    Adam increments `state["step"]` in place once per parameter, so after a reload the shared step advanced
    by the number of parameters at each update and the bias corrections were wrong: the next update
    differed from an uninterrupted run (by ~3e-4 on the tiny model) although everything compared equal
    right after the load. (With FusedAdam the step lives in the param group and the issue does not arise.)
    """
    for opt in _chained(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for state in inner.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                state["step"] = step.detach().clone()


def _chained(optimizer: Any) -> list[Any]:
    """The optimizers inside a Megatron `ChainedOptimizer` (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def build_policy_optimizer(model: nn.Module, settings: OptimizerSettings) -> PolicyOptimizer:
    """Wrap `model` (this rank's policy stage) in Megatron DDP and build its optimizer and LR schedule.

    `megatron.core.parallel_state` must be initialised. The model's `TransformerConfig` is updated in place
    (per-token loss, finalize/grad-scale functions), so build one optimizer per model.
    """
    return PolicyOptimizer(model, settings)


__all__ = ["LR_DECAY_STYLES", "LrDecayStyle", "OptimizerSettings", "PolicyOptimizer", "PolicyOptimizerConfig",
           "UpdateResult", "build_policy_optimizer"]
