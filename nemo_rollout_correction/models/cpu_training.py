"""CPU fast paths for Megatron-Core's training machinery (DDP gradient buffer, gradient scaling), same bits.

Without CUDA, Transformer Engine or Apex, Megatron-Core 0.16 falls back to code that is correct on CPU
but spends time on memory traffic that a GPU hides. Profiled per phase on this project's CPU machines
(docs/training.md, "Measured cost on CPU"), two spots of the Megatron path cost time that the former
hand-written path did not, and both can be removed without changing a single bit of the result:

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

Not done here, on purpose: torch's fused CPU Adam (`AdamW(fused=True)`, 8x faster than the single-tensor
loop Megatron builds without Apex: 30 ms vs 240 ms for 45M fp32 parameters). Its vectorised body and its
scalar remainder round some elements differently (1 fp32 ulp), so with bf16 parameters a ZeRO-1 shard
layout can flip a model weight by one bf16 ulp against DP = 1, which the DP=2-equals-DP=1 bf16 test of
tests/integration/test_megatron_optimizer.py rejects. See docs/training.md.

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


__all__ = ["add_cast_", "cpu_ddp_class", "install_multi_tensor_scale"]
