"""Test helpers: a tiny Megatron-Core GPT on CPU and TP=1 weights loaded into a TP-sharded copy.

Used by `megatron_tp_worker` (tests/integration/test_megatron_tp.py); they live with the tests, not in
the package, because nothing in `nemo_rollout_correction` builds a model this way (the trainer builds its
policy from a Hugging Face config, models/hf_llama.py). Megatron is imported inside the functions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from nemo_rollout_correction.models.megatron_cpu import patch_cuda_for_cpu


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
