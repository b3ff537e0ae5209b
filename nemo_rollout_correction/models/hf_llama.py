"""Hugging Face decoder-only checkpoints -> Megatron-Core `GPTModel` (TP-sharded, pipeline-staged).

Supported families (`models.hf_config.FAMILIES`): `LlamaForCausalLM` (Llama 2, Llama 3.0-3.3 with `llama3`
RoPE scaling, SmolLM/SmolLM2), `MistralForCausalLM` (no binding sliding window), `Qwen2ForCausalLM` (q/k/v
biases), `Qwen3ForCausalLM` (q/k RMSNorm: Megatron's `qk_layernorm`), `Qwen3MoeForCausalLM` and
`MixtralForCausalLM` (Megatron's MoE layer, TP = EP = 1). All are RMSNorm + SwiGLU + RoPE + grouped-query
attention, tied or untied embeddings. `models.hf_config` reads and validates `config.json` (refusing, by
name, every key it does not build exactly); `models.hf_mapping` holds the declarative parameter table from
which loading, export and the expected-name check derive. This module builds the Megatron-Core model and
re-exports the converter's names.

Everything Megatron is imported lazily: importing this module does not need the `megatron` extra.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from nemo_rollout_correction.models.hf_config import SUPPORTED_ARCHITECTURES, ModelArch, read_arch
from nemo_rollout_correction.models.hf_mapping import (
    SafetensorsCheckpoint,
    expected_hf_names,
    fused_qkv,
    iter_hf_weights,
    load_hf_weights,
    split_qkv,
)
from nemo_rollout_correction.models.megatron_cpu import patch_cuda_for_cpu

_log = logging.getLogger("nemo_rollout_correction.models")

LlamaArch = ModelArch
"""The former name of `ModelArch` (it covers every supported family now)."""


def transformer_config(arch: ModelArch, *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                       context_parallel_size: int = 1, params_dtype: torch.dtype = torch.float32,
                       **overrides: Any) -> Any:
    """A Megatron-Core `TransformerConfig` equivalent to `arch` (no dropout, fp32 softmax and residuals)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch.check_tensor_parallel(tensor_parallel_size)
    if arch.num_layers % pipeline_parallel_size:
        raise ValueError(f"pipeline_parallel_size={pipeline_parallel_size} does not divide "
                         f"num_layers={arch.num_layers}")
    fields: dict[str, Any] = {
        "num_layers": arch.num_layers,
        "hidden_size": arch.hidden_size,
        "ffn_hidden_size": arch.intermediate_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_query_groups": arch.num_key_value_heads,
        "kv_channels": arch.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": arch.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": arch.qkv_bias,
        "qk_layernorm": arch.qk_norm,
        "tensor_model_parallel_size": tensor_parallel_size,
        "pipeline_model_parallel_size": pipeline_parallel_size,
        "context_parallel_size": context_parallel_size,
        "params_dtype": params_dtype,
        "pipeline_dtype": params_dtype,  # dtype of the activations sent between pipeline stages (required for PP > 1)
        "bf16": params_dtype == torch.bfloat16,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "use_cpu_initialization": not torch.cuda.is_available(),
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
        "gradient_accumulation_fusion": False,
        "attention_softmax_in_fp32": True,
        "fp32_residual_connection": False,
    }
    if arch.is_moe:
        if tensor_parallel_size != 1:
            # Megatron-Core's MoE layer refuses TP > 1 without sequence parallelism in training, and sequence
            # parallelism needs the Apex/TE norms (not on CPU); the package does not enable it yet.
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} is not supported for the MoE model "
                             f"{arch.architecture} yet (Megatron-Core's MoE layer needs sequence parallelism with "
                             "TP > 1); use tensor_parallel_size=1")
        fields.update(moe_fields(arch))
    fields.update(overrides)
    return TransformerConfig(**fields)


def moe_fields(arch: ModelArch) -> dict[str, Any]:
    """`TransformerConfig` fields of a Qwen3-MoE-style layer: softmax router, top-k, no auxiliary loss.

    transformers' router takes a softmax over all experts, then the top k, and renormalises them when
    `norm_topk_prob`. Renormalised top-k of a softmax equals a softmax over the top-k logits, which is Megatron's
    `moe_router_pre_softmax=False`; without renormalisation it is `moe_router_pre_softmax=True`. Experts are
    local (`SequentialMLP`, no grouped GEMM) and the token dispatcher is `allgather` (no expert parallelism).
    """
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    if ep != 1:
        raise ValueError(f"expert_model_parallel_size={ep} is not supported yet for {arch.architecture} (use 1)")
    return {
        "num_moe_experts": arch.num_experts,
        "moe_router_topk": arch.num_experts_per_tok,
        "moe_ffn_hidden_size": arch.moe_intermediate_size,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not arch.norm_topk_prob,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": False,
    }


def _define_te_general_gemm() -> None:
    """megatron-core 0.16.1's `router_gating_linear` tests `te_general_gemm is not None`, a name its module
    defines only when Transformer Engine imports: without TE the router raises NameError. Defining it as None
    selects the module's own torch path (what it intends without TE)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


LayerSpecName = Literal["local", "transformer_engine"]


@dataclass(frozen=True)
class LayerSpecChoice:
    """Which Megatron-Core layer spec `build_gpt_model` builds, and why (the trainer logs both)."""

    name: LayerSpecName
    reason: str

    @property
    def transformer_engine(self) -> bool:
        """Whether the Transformer Engine spec is chosen."""
        return self.name == "transformer_engine"


def choose_layer_spec(use_transformer_engine: bool | None = None) -> LayerSpecChoice:
    """The layer spec for this machine: `use_transformer_engine` when given, else TE exactly when CUDA is available
    and `transformer_engine.pytorch` imports (GPU containers); never TE on CPU machines.

    An installed TE that fails to import for another reason than being absent (a CUDA/driver mismatch raises
    OSError or RuntimeError) is not hidden: the reason names the error, and `build_gpt_model` logs it as a warning.
    """
    if use_transformer_engine is not None:
        name: LayerSpecName = "transformer_engine" if use_transformer_engine else "local"
        return LayerSpecChoice(name, f"requested (use_transformer_engine={use_transformer_engine})")
    if not torch.cuda.is_available():
        return LayerSpecChoice("local", "CUDA is not available (the local spec is the one that runs on CPU)")
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as exc:
        return LayerSpecChoice("local", f"Transformer Engine is not installed ({exc})")
    except Exception as exc:  # installed but broken: say so instead of silently building the local spec
        return LayerSpecChoice("local", f"Transformer Engine is installed but failed to import: "
                                        f"{type(exc).__name__}: {exc}")
    return LayerSpecChoice("transformer_engine", "CUDA is available and Transformer Engine imports (UNVERIFIED: "
                                                 "this spec never ran in this project's tests; docs/deployment.md, "
                                                 "\"GPU status\")")


def transformer_engine_available() -> bool:
    """Whether the automatic choice is the Transformer Engine spec (`choose_layer_spec().reason` says why not)."""
    return choose_layer_spec().transformer_engine


def layer_spec_kwargs(arch: ModelArch, transformer_engine: bool) -> dict[str, Any]:
    """The keyword arguments of Megatron-Core's `get_gpt_layer_with_transformer_engine_spec` (TE) or
    `get_gpt_layer_local_spec` for `arch`.

    Only the local spec takes `normalization`: the TE spec's `TENorm` picks RMSNorm from
    `TransformerConfig.normalization` (megatron-core 0.16.1 and 0.19.2 alike; tests bind these arguments against
    both releases' signatures).
    """
    kwargs: dict[str, Any] = {"num_experts": arch.num_experts or None, "moe_grouped_gemm": False,
                              "qk_layernorm": arch.qk_norm}
    if not transformer_engine:
        kwargs["normalization"] = "RMSNorm"
    return kwargs


def build_gpt_model(arch: ModelArch, config: Any, *, pre_process: bool = True, post_process: bool = True,
                    use_transformer_engine: bool | None = None, parallel_output: bool = True) -> nn.Module:
    """A Megatron-Core `GPTModel` for `arch` with random weights (load them with `load_hf_weights`).

    `megatron.core.parallel_state` must be initialised with the TP/PP sizes of `config`. The local layer
    spec runs on CPU; the Transformer Engine spec is used on GPU when TE imports (None = auto,
    `choose_layer_spec`). The choice and its reason are logged and kept on the model as `nrc_layer_spec`
    (a `LayerSpecChoice`): checkpoints record it, since the two specs name their parameters differently.
    With `parallel_output=True` the logits stay vocab-sharded: `[batch, seq, vocab / tp]`.
    The local spec's core attention is `models.sdpa_attention.SdpaDotProductAttention` (Megatron's unfused
    `DotProductAttention` math on torch's fused `scaled_dot_product_attention`); with context parallelism
    (`config.context_parallel_size > 1`) it is `models.cp_attention.AllGatherContextParallelAttention`, which
    runs the same fused module on the gathered keys and values (TE brings its own attention, CP included).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs

    patch_cuda_for_cpu()
    choice = choose_layer_spec(use_transformer_engine)
    broken_te = "failed to import" in choice.reason
    _log.log(logging.WARNING if broken_te or choice.transformer_engine else logging.INFO,
             "Megatron-Core layer spec: %s (%s)", choice.name, choice.reason)
    if choice.transformer_engine:
        layer_spec = specs.get_gpt_layer_with_transformer_engine_spec(**layer_spec_kwargs(arch, True))
    else:
        layer_spec = specs.get_gpt_layer_local_spec(**layer_spec_kwargs(arch, False))
        if arch.is_moe:
            _define_te_general_gemm()
        attention = layer_spec.submodules.self_attention.submodules
        if config.context_parallel_size > 1:
            from nemo_rollout_correction.models.cp_attention import AllGatherContextParallelAttention

            attention.core_attention = AllGatherContextParallelAttention
        else:
            from nemo_rollout_correction.models.sdpa_attention import SdpaDotProductAttention

            attention.core_attention = SdpaDotProductAttention
    model: nn.Module = GPTModel(
        config=config, transformer_layer_spec=layer_spec, vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        parallel_output=parallel_output, share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope", rotary_base=round(arch.rope.theta),
    )
    if torch.cuda.is_available():
        # As Megatron-LM's get_model: layers built without a device (the local spec's torch norms) start on
        # the CPU; without this the plain (non-distributed) optimizer gets CPU parameters on a GPU.
        model.cuda(torch.cuda.current_device())
    set_rope_frequencies(model, arch)
    setattr(model, "nrc_layer_spec", choice)  # noqa: B010 (nn.Module's __setattr__ is typed for tensors/modules)
    return model


def set_rope_frequencies(model: nn.Module, arch: ModelArch) -> None:
    """Give the model's rotary embedding the checkpoint's exact inverse frequencies (`RopeSpec.inv_freq`).

    Megatron-Core 0.16.1's `RotaryEmbedding` covers llama3 scaling only with hard-coded low/high frequency
    factors and original context (1, 4, 8192) and an integer `rotary_base`; the frequencies of the
    checkpoint's own RoPE parameters are set here instead, before the first forward (the embedding caches
    its cos/sin per sequence length from `inv_freq`; `inv_freq` is a plain attribute, not a buffer, so no
    checkpoint carries it).
    """
    rotary: Any = getattr(model, "rotary_pos_emb", None)
    if rotary is None:
        raise ValueError("the model has no rotary_pos_emb: position_embedding_type must be 'rope'")
    current = rotary.inv_freq
    if current.shape != (arch.head_dim // 2,):
        raise ValueError(f"rotary inv_freq shape {tuple(current.shape)} != ({arch.head_dim // 2},)")
    rotary.inv_freq = arch.rope.inv_freq(arch.head_dim).to(device=current.device, dtype=current.dtype)


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LayerSpecChoice",
    "LayerSpecName",
    "LlamaArch",
    "ModelArch",
    "SafetensorsCheckpoint",
    "build_gpt_model",
    "choose_layer_spec",
    "expected_hf_names",
    "fused_qkv",
    "iter_hf_weights",
    "layer_spec_kwargs",
    "load_hf_weights",
    "moe_fields",
    "read_arch",
    "set_rope_frequencies",
    "split_qkv",
    "transformer_config",
    "transformer_engine_available",
]
