"""Run Megatron-Core's CPU-capable code paths on machines without CUDA.

Megatron-Core calls `torch.cuda.current_device()` in several helpers (rotary embeddings, some
tensor-parallel utilities, parallel-state set-up) and uses the result as a `device=`; on CPU
`patch_cuda_for_cpu` makes it return `"cpu"`. Lives in the distributed layer because process-group
set-up (`runtime.init_runtime`) needs it before any model exists; `models.megatron_cpu` re-exports it.
"""

from __future__ import annotations

import torch


def patch_cuda_for_cpu() -> bool:
    """Make `torch.cuda.current_device()` return `"cpu"` when CUDA is unavailable (idempotent).

    Megatron-Core uses the result as a `device=` argument, which `"cpu"` satisfies. Returns whether
    the patch is (now) active; with CUDA available nothing is changed and False is returned.
    """
    if torch.cuda.is_available():
        return False
    if not getattr(torch.cuda.current_device, "_nrc_cpu_patch", False):

        def current_device() -> str:
            return "cpu"

        current_device._nrc_cpu_patch = True  # type: ignore[attr-defined]
        torch.cuda.current_device = current_device  # type: ignore[assignment]
    return True


__all__ = ["patch_cuda_for_cpu"]
