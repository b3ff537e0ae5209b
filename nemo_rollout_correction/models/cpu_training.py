"""CPU fast paths for Megatron-Core's training machinery (DDP gradient buffer, gradient scaling, Adam).

Without CUDA, Transformer Engine or Apex, Megatron-Core 0.16 falls back to code that is correct on CPU
but spends time on memory traffic that a GPU hides. Profiled per phase on this project's CPU machines
(docs/training.md, "Measured cost on CPU"), three spots of the Megatron path cost time that the former
hand-written path did not. The first two are removed without changing a single bit of the result; the
third (Adam) rounds some elements about 1 fp32 ulp differently and is used only where that cannot make the
result depend on the data-parallel size:

1. **Gradient accumulation into the fp32 buffer.** Megatron's DDP backward hook runs
   `param.main_grad.add_(param.grad)` for every parameter and microbatch. With bf16/fp16 parameters and
   the fp32 buffer (`grad_reduce_in_fp32=True`) that is a mixed-dtype in-place add, which PyTorch's CPU
   kernels run without a vectorised cast: 67 ms for a 28M-element bf16 gradient (SmolLM2's tied
   embedding). Casting through a small reused fp32 chunk and adding fp32 to fp32 gives the same sum (the
   promoted add is computed in fp32 either way) in 13 ms (`add_cast_`). `cpu_ddp_class()` does that
   before Megatron's own hook, which then finds the gradient consumed.
2. **`multi_tensor_scale`.** Megatron's no-Apex fallback computes `dst.copy_(src * scale)` for every
   tensor: a parameter-sized temporary even for scale 1.0 (the fp32 main -> bf16 model parameter copy
   after every update) and for the in-place gradient clipping (`[grads, grads]`).
   `install_multi_tensor_scale` replaces that fallback with one that copies, or multiplies in place, where
   the result is the same, and hands every other case to Megatron's function.
3. **Adam.** Without Apex or Transformer Engine Megatron builds torch's `AdamW` with its default
   single-tensor loop: about eight passes over the fp32 main weights and moments per update (240 ms for 45M
   fp32 parameters). `use_fused_cpu_adam` switches that optimizer to torch's fused CPU kernel (one pass, 30 ms;
   Megatron's own CPU-offload optimizer uses it too). Not bit-identical to the loop: the two compute the same
   formula in a different order, about 1 fp32 ulp apart on some elements. So it is used only where the result
   stays independent of DP: with the regular optimizer every rank updates whole parameters, so the fused
   kernel sees the same tensors at any DP. (TP and PP change the tensors themselves, and with them the
   forward's sums: those layouts were only ever equal to tolerance.) With the distributed
   optimizer each rank updates a DP-dependent slice of a flat buffer, and the fused kernel's vectorised body
   and scalar remainder (which round some elements 1 fp32 ulp apart) would then fall on different elements
   at different DP: after two updates of a bf16 model that flipped an embedding weight by one bf16 ulp
   between DP = 2 and DP = 1. The distributed optimizer keeps the single-tensor loop.

With CUDA nothing here is installed: Megatron's GPU paths are untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

_CHUNK = 1 << 18
"""Elements per cast chunk of `add_cast_`: a 1 MiB fp32 scratch stays in cache; measured 2-5x faster than
the mixed-dtype add from 1.7M to 28M elements, and no slower below."""


def add_cast_(dst: Tensor, src: Tensor, scratch: Tensor | None = None) -> Tensor:
    """`dst += src` for a float32 `dst` and a lower-precision `src` of the same shape, bit-identical to
    `dst.add_(src)` (the promoted sum is computed in float32 either way), through a reused float32 chunk.

    scratch: a float32 buffer to reuse (any size >= 1); one of `_CHUNK` elements is allocated when None.
    Returns `dst`.
    """
    if dst.shape != src.shape or dst.dtype != torch.float32 or not dst.is_contiguous():
        raise ValueError(f"add_cast_ needs a contiguous float32 dst and a src of the same shape, got "
                         f"{dst.dtype} {tuple(dst.shape)} and {src.dtype} {tuple(src.shape)}")
    flat_dst, flat_src = dst.view(-1), src.reshape(-1)
    if scratch is None:
        scratch = torch.empty(min(_CHUNK, flat_dst.numel()), dtype=torch.float32, device=dst.device)
    step = scratch.numel()
    for start in range(0, flat_dst.numel(), step):
        stop = min(start + step, flat_dst.numel())
        chunk = scratch[: stop - start]
        chunk.copy_(flat_src[start:stop])
        flat_dst[start:stop].add_(chunk)
    return dst


def cpu_ddp_class() -> type:
    """Megatron's `DistributedDataParallel` with a CPU fast path for mixed-dtype gradient accumulation.

    The subclass only wraps each parameter's backward post-hook: when the gradient's dtype differs from
    the fp32 buffer's (bf16/fp16 parameters), it adds the gradient with `add_cast_` and clears
    `param.grad`; Megatron's hook then runs as usual (it adds nothing more, clears `grad` again and does its
    bucket bookkeeping). fp32 parameters and everything else go through Megatron's hook unchanged.
    """
    from megatron.core.distributed import DistributedDataParallel

    class CpuDistributedDataParallel(DistributedDataParallel):  # type: ignore[misc]
        """Megatron DDP whose backward hooks accumulate bf16/fp16 gradients into the fp32 buffer fast."""

        def _make_backward_post_hook(self, param: torch.nn.Parameter) -> Callable[..., None]:
            megatron_hook: Callable[..., None] = super()._make_backward_post_hook(param)
            scratch: list[Tensor] = []  # allocated at the first mixed-dtype gradient, reused after

            def hook(*unused: Any) -> None:
                grad = param.grad
                main_grad = getattr(param, "main_grad", None)
                if (grad is not None and main_grad is not None and grad.dtype != main_grad.dtype
                        and main_grad.dtype == torch.float32 and grad.device.type == "cpu"
                        and not self.ddp_config.overlap_grad_reduce
                        and param in self.param_to_bucket_group
                        and not getattr(param, "grad_added_to_main_grad", False)):
                    if not scratch:
                        scratch.append(torch.empty(min(_CHUNK, main_grad.numel()), dtype=torch.float32))
                    add_cast_(main_grad, grad.data, scratch[0])
                    param.grad = None  # consumed: Megatron's hook skips its own add
                megatron_hook(*unused)

            return hook

    return CpuDistributedDataParallel


def _multi_tensor_scale(fallback: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron's `local_multi_tensor_scale` contract (`dst = src * scale` per tensor pair) without the
    temporary where the result is the same: scale 1.0 is a (casting) copy, `src is dst` an in-place
    multiply; anything else goes to Megatron's `fallback`."""

    def multi_tensor_scale(chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]],
                           scale: float) -> None:
        rest_src, rest_dst = [], []
        for src, dst in zip(tensor_lists[0], tensor_lists[1], strict=True):
            if scale == 1.0:
                dst.copy_(src)
            elif src is dst:
                dst.mul_(scale)
            else:
                rest_src.append(src)
                rest_dst.append(dst)
        if rest_src:
            fallback(chunk_size, noop_flag, [rest_src, rest_dst], scale)

    multi_tensor_scale._nrc_fast = True  # type: ignore[attr-defined]
    return multi_tensor_scale


def install_multi_tensor_scale() -> bool:
    """Replace Megatron's no-Apex `local_multi_tensor_scale` in its optimizer and clipping modules (see the
    module doc, item 3). Idempotent; a no-op with CUDA or when Apex/TE provide the real kernel. Returns
    whether the fast version is installed."""
    if torch.cuda.is_available():
        return False
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    installed = False
    for module in (megatron_optimizer, clip_grads):
        current = getattr(module, "multi_tensor_scale_impl", None)
        if current is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = _multi_tensor_scale(current)
            installed = True
        elif getattr(current, "_nrc_fast", False):
            installed = True
    return installed


def use_fused_cpu_adam(optimizer: Any) -> int:
    """Switch the torch Adam/AdamW inside a Megatron optimizer (or `ChainedOptimizer`) to torch's fused CPU
    kernel (see the module doc, item 3). Call it only for the regular (not distributed) optimizer on CPU.

    Megatron 0.16 builds `torch.optim.AdamW(...)` without Apex/TE and offers no way to pass `fused=True`;
    the flag is a per-group setting that torch reads at every step (and validates, CPU float tensors only,
    when a parameter's state is created), so setting it before the first step is what the constructor
    argument would do. A no-op with CUDA. Returns how many parameter groups now run fused.
    """
    if torch.cuda.is_available():
        return 0
    switched = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        if any(group.get("foreach") or group.get("differentiable") for group in inner.param_groups):
            continue  # torch refuses fused together with foreach or differentiable
        inner.defaults["fused"] = True
        for group in inner.param_groups:
            group["fused"] = True
            switched += 1
    return switched


__all__ = ["add_cast_", "cpu_ddp_class", "install_multi_tensor_scale", "use_fused_cpu_adam"]
