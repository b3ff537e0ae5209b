"""Small helpers to run a real Megatron-Core `GPTModel` on CPU (gloo); the policy and the tests use them.

Megatron-Core (the `megatron` extra, `megatron-core==0.16.1` on Python 3.11) runs its local
(non-Transformer-Engine) layer spec on CPU once a few hard-coded CUDA calls are avoided:

- `torch.cuda.current_device()` is called by several helpers (rotary embeddings, some
  tensor-parallel utilities): `patch_cuda_for_cpu` makes it return `"cpu"` when CUDA is absent.
- the default causal mask is created with `device="cuda"` when no mask is passed:
  `causal_attention_mask` builds the same mask on CPU; pass it as `attention_mask`.
- weights must be created with `use_cpu_initialization=True` (set by the tests' `tiny_gpt_config`,
  tests/integration/megatron_tiny.py, and by `models/hf_llama.py`).

Everything Megatron is imported lazily inside the functions: importing this module never imports
`megatron`, so the package works without the extra. See docs/megatron_cpu.md for what runs on CPU
and what needs a GPU (Transformer Engine spec, sequence parallel, context parallel attention, NCCL).
"""

from __future__ import annotations

import torch
from torch import Tensor

from nemo_rollout_correction.distributed.cpu_compat import patch_cuda_for_cpu


def seed_model_parallel(seed: int) -> None:
    """Seed torch and Megatron's model-parallel RNG tracker the same way on every rank.

    Uses `tensor_parallel.model_parallel_cuda_manual_seed(..., force_reset_rng=True)`, which on CPU
    needs `patch_cuda_for_cpu` (called here).
    """
    from megatron.core import tensor_parallel

    patch_cuda_for_cpu()
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


def causal_attention_mask(seq_len: int, device: torch.device | str = "cpu") -> Tensor:
    """Megatron's causal mask `[1, 1, seq, seq]` (True = masked out), built on `device`.

    Pass it as `attention_mask`: without one, Megatron's torch softmax path creates the default
    causal mask with a hard-coded `device="cuda"`.
    """
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


__all__ = ["causal_attention_mask", "patch_cuda_for_cpu", "seed_model_parallel"]
