"""Small helpers to run a real Megatron-Core `GPTModel` on CPU (gloo), for tests and development.

Megatron-Core (the `megatron` extra, `megatron-core==0.16.1` on Python 3.11) runs its local
(non-Transformer-Engine) layer spec on CPU once a few hard-coded CUDA calls are avoided:

- `torch.cuda.current_device()` is called by several helpers (rotary embeddings, some
  tensor-parallel utilities): `patch_cuda_for_cpu` makes it return `"cpu"` when CUDA is absent.
- the default causal mask is created with `device="cuda"` when no mask is passed:
  `causal_attention_mask` builds the same mask on CPU; pass it as `attention_mask`.
- weights must be created with `use_cpu_initialization=True` (set by `tiny_gpt_config`).

Everything Megatron is imported lazily inside the functions: importing this module never imports
`megatron`, so the package works without the extra. See docs/megatron_cpu.md for what runs on CPU
and what needs a GPU (Transformer Engine spec, sequence parallel, context parallel attention, NCCL).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

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


def tiny_gpt_config(*, num_layers: int = 2, hidden_size: int = 64, num_attention_heads: int = 2,
                    tensor_model_parallel_size: int = 1, **overrides: Any) -> Any:
    """A `TransformerConfig` for a tiny fp32 GPT on CPU: no dropout, CPU initialisation, non-gated GELU MLP.

    head_dim = hidden_size / num_attention_heads (keep it >= 32 to match vLLM's CPU attention).
    `overrides` go to `TransformerConfig` unchanged.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields: dict[str, Any] = {
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_attention_heads": num_attention_heads,
        "tensor_model_parallel_size": tensor_model_parallel_size,
        "use_cpu_initialization": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "params_dtype": torch.float32,
    }
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_tiny_gpt(config: Any, *, vocab_size: int, max_sequence_length: int, parallel_output: bool = True,
                   position_embedding_type: str = "rope") -> nn.Module:
    """A Megatron-Core `GPTModel` with the local layer spec (`get_gpt_layer_local_spec`: no Transformer Engine).

    `megatron.core.parallel_state` must be initialised first (TP size = `config.tensor_model_parallel_size`).
    With `parallel_output=True` the logits stay TP-sharded: `[batch, seq, vocab_size / tp]`, the
    slice of global ids `[tp_rank * vocab_size / tp, (tp_rank + 1) * vocab_size / tp)`.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    patch_cuda_for_cpu()
    tp = config.tensor_model_parallel_size
    if vocab_size % tp:
        raise ValueError(f"vocab_size {vocab_size} must be divisible by the tensor-parallel size {tp} "
                         "(Megatron shards the vocabulary evenly; pad it first)")
    model: nn.Module = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab_size,
                                max_sequence_length=max_sequence_length, parallel_output=parallel_output,
                                position_embedding_type=position_embedding_type)
    return model


def causal_attention_mask(seq_len: int, device: torch.device | str = "cpu") -> Tensor:
    """Megatron's causal mask `[1, 1, seq, seq]` (True = masked out), built on `device`.

    Pass it as `attention_mask`: without one, Megatron's torch softmax path creates the default
    causal mask with a hard-coded `device="cuda"`.
    """
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def tp_partition(param: Tensor) -> int | None:
    """The dimension along which Megatron shards `param` over TP, or None if it is replicated."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    stride = getattr(param, "partition_stride", 1)
    if stride != 1:
        raise NotImplementedError(f"partition_stride {stride} (strided TP layout) is not supported")
    return int(param.partition_dim)  # type: ignore[attr-defined]


def shard_for_rank(full: Tensor, param: Tensor, tp_rank: int, tp_size: int) -> Tensor:
    """This TP rank's slice of the unsharded tensor `full` for the parameter `param`.

    Megatron's layout: contiguous equal chunks along `partition_dim`. This is exact for embeddings,
    the output layer, row-parallel weights, non-gated MLPs and attention QKV (which Megatron stores
    grouped per query group, so heads split contiguously); a gated (SwiGLU) `linear_fc1` stores
    `[gate; up]` and needs a per-half split, which is not handled here.
    """
    dim = tp_partition(param)
    if dim is None:
        return full
    return full.chunk(tp_size, dim=dim)[tp_rank].contiguous()


def load_unsharded_parameters(model: nn.Module, full: dict[str, Tensor], tp_rank: int, tp_size: int) -> None:
    """Copy unsharded (TP=1) parameter values `full` (name -> tensor) into a TP-sharded `model`."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(full))
    unexpected = sorted(set(full) - set(params))
    if missing or unexpected:
        raise KeyError(f"parameter names differ: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, param in params.items():
            shard = shard_for_rank(full[name], param, tp_rank, tp_size)
            if shard.shape != param.shape:
                raise ValueError(f"{name}: shard shape {tuple(shard.shape)} != parameter shape {tuple(param.shape)}")
            param.copy_(shard)


__all__ = [
    "build_tiny_gpt",
    "causal_attention_mask",
    "load_unsharded_parameters",
    "patch_cuda_for_cpu",
    "seed_model_parallel",
    "shard_for_rank",
    "tiny_gpt_config",
    "tp_partition",
]
