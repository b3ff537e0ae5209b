"""Llama-family Hugging Face checkpoints <-> Megatron-Core `GPTModel` (TP-sharded).

Supported: `LlamaForCausalLM` (Llama 2/3, SmolLM, SmolLM2), `Qwen2ForCausalLM` and `MistralForCausalLM`
without sliding windows: RMSNorm, SwiGLU, RoPE (no rope scaling), grouped-query attention, tied or untied
embeddings, Qwen2's q/k/v biases.

Parameter layout (Megatron-Core 0.16, local or Transformer Engine spec):

| Megatron name (per layer `L`)                     | Hugging Face name(s)                          | TP split |
|---------------------------------------------------|-----------------------------------------------|----------|
| embedding.word_embeddings.weight `[V, H]`         | model.embed_tokens.weight                     | dim 0    |
| decoder.layers.L.input_layernorm.weight           | model.layers.L.input_layernorm.weight         | none     |
| decoder.layers.L.self_attention.linear_qkv.weight | q_proj, k_proj, v_proj (grouped per KV head)  | dim 0    |
| decoder.layers.L.self_attention.linear_proj.weight| o_proj                                        | dim 1    |
| decoder.layers.L.pre_mlp_layernorm.weight         | post_attention_layernorm                      | none     |
| decoder.layers.L.mlp.linear_fc1.weight            | gate_proj, up_proj (`[gate_r; up_r]` per rank) | dim 0    |
| decoder.layers.L.mlp.linear_fc2.weight            | down_proj                                     | dim 1    |
| decoder.final_layernorm.weight                    | model.norm.weight                             | none     |
| output_layer.weight (absent when tied)            | lm_head.weight                                | dim 0    |

The fused QKV weight is stored grouped by query group: for each KV head `g`, its `n_heads / n_kv`
query heads, then its key head, then its value head, each `head_dim` rows. Tensor parallelism then
splits whole groups (so `num_key_value_heads % tp == 0`, Megatron's own requirement). With the
Transformer Engine spec the two norms are fused into the following linear layers
(`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`); the same table applies under those
names. Megatron's RoPE with `rotary_interleaved=False` is Hugging Face's `rotate_half` convention, so
q/k weights are copied without permutation.

Everything Megatron is imported lazily: importing this module does not need the `megatron` extra.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from nemo_rollout_correction.distributed.tensor_gather import gather_along_dim, group_size
from nemo_rollout_correction.models.megatron_cpu import patch_cuda_for_cpu

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")

# Transformer Engine spec names of the two per-layer norms, keyed by their local-spec names.
_TE_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


@dataclass(frozen=True)
class LlamaArch:
    """The architecture hyper-parameters read from a Hugging Face `config.json`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool

    @property
    def heads_per_group(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> LlamaArch:
        """Read and validate a Hugging Face config mapping; unsupported features raise ValueError."""
        archs = config.get("architectures") or []
        arch = archs[0] if archs else str(config.get("model_type", "?"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        rope_scaling = config.get("rope_scaling")
        if rope_scaling:
            raise ValueError(f"rope_scaling={rope_scaling!r} is not supported (only plain RoPE)")
        if config.get("sliding_window") and config.get("use_sliding_window", arch == "MistralForCausalLM"):
            raise ValueError("sliding-window attention is not supported")
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported (SwiGLU with silu only)")
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        hidden = int(config["hidden_size"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        rope_theta = config.get("rope_theta")
        if rope_theta is None:  # transformers >= 5 nests it in rope_parameters
            rope_theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            architecture=arch,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bool(config.get("attention_bias", arch == "Qwen2ForCausalLM")),
        )

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise ValueError naming the dimension that `tp` does not divide."""
        for name, value in (("num_key_value_heads", self.num_key_value_heads), ("vocab_size", self.vocab_size),
                            ("intermediate_size", self.intermediate_size),
                            ("num_attention_heads", self.num_attention_heads)):
            if value % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide {name}={value}; "
                                 f"choose a divisor of {value}")

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (for logs and checkpoints)."""
        return asdict(self)


def read_arch(hf_dir: str | Path) -> LlamaArch:
    """The architecture of the Hugging Face checkpoint directory `hf_dir` (its config.json)."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: expected a Hugging Face checkpoint directory")
    return LlamaArch.from_hf_config(json.loads(path.read_text()))


def load_hf_state_dict(hf_dir: str | Path) -> dict[str, Tensor]:
    """All tensors of the safetensors checkpoint in `hf_dir` (single file or sharded with an index)."""
    from safetensors.torch import load_file

    hf_dir = Path(hf_dir)
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {hf_dir}")
    state: dict[str, Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def transformer_config(arch: LlamaArch, *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
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
    fields.update(overrides)
    return TransformerConfig(**fields)


def transformer_engine_available() -> bool:
    """Whether Transformer Engine imports (GPU containers); never true on CPU machines."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def build_gpt_model(arch: LlamaArch, config: Any, *, pre_process: bool = True, post_process: bool = True,
                    use_transformer_engine: bool | None = None, parallel_output: bool = True) -> nn.Module:
    """A Megatron-Core `GPTModel` for `arch` with random weights (load them with `load_hf_weights`).

    `megatron.core.parallel_state` must be initialised with the TP/PP sizes of `config`. The local layer
    spec runs on CPU; the Transformer Engine spec is used on GPU when TE imports (None = auto).
    With `parallel_output=True` the logits stay vocab-sharded: `[batch, seq, vocab / tp]`.
    With context parallelism (`config.context_parallel_size > 1`) the local spec's core attention is
    `models.cp_attention.AllGatherContextParallelAttention` (TE brings its own CP attention).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if not arch.rope_theta.is_integer():
        raise ValueError(f"rope_theta={arch.rope_theta} must be an integer for Megatron-Core's rotary_base")
    patch_cuda_for_cpu()
    use_te = transformer_engine_available() if use_transformer_engine is None else use_transformer_engine
    if use_te:
        layer_spec = specs.get_gpt_layer_with_transformer_engine_spec(normalization="RMSNorm")
    else:
        layer_spec = specs.get_gpt_layer_local_spec(normalization="RMSNorm")
        if config.context_parallel_size > 1:
            from nemo_rollout_correction.models.cp_attention import AllGatherContextParallelAttention

            layer_spec.submodules.self_attention.submodules.core_attention = AllGatherContextParallelAttention
    model: nn.Module = GPTModel(
        config=config, transformer_layer_spec=layer_spec, vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        parallel_output=parallel_output, share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope", rotary_base=int(arch.rope_theta),
    )
    return model


# --- name mapping ---------------------------------------------------------------------------------

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Megatron names of the parameters outside the decoder layers -> Hugging Face names.
_GLOBAL_NAMES = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
                 "decoder.final_layernorm.weight": "model.norm.weight",
                 "output_layer.weight": "lm_head.weight"}


def _global_layer_index(model: nn.Module, local_index: int) -> int:
    """Global (0-based) index of the model's `local_index`-th decoder layer (pipeline stages offset it)."""
    layer: Any = model.decoder.layers[local_index]  # type: ignore[union-attr, index]
    return int(layer.layer_number) - 1


def _split_megatron_name(name: str) -> tuple[int | None, str]:
    match = _LAYER.match(name)
    if match is None:
        return None, name
    return int(match.group(1)), match.group(2)


def _local_suffix(suffix: str) -> str:
    """Translate a Transformer Engine per-layer suffix to its local-spec equivalent."""
    for local, te in _TE_NORM_NAMES.items():
        if suffix == te:
            return local
    return suffix


def fused_qkv(q: Tensor, k: Tensor, v: Tensor, arch: LlamaArch) -> Tensor:
    """Megatron's grouped QKV `[(n_q + 2 n_kv) * head_dim, ...]` from HF's q/k/v (weights or biases)."""
    g, per, d = arch.num_key_value_heads, arch.heads_per_group, arch.head_dim
    rest = q.shape[1:]
    q = q.reshape(g, per * d, *rest)
    k = k.reshape(g, d, *rest)
    v = v.reshape(g, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(g * (per + 2) * d, *rest)


def split_qkv(qkv: Tensor, arch: LlamaArch) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `fused_qkv`: HF's (q, k, v) from Megatron's grouped QKV (full, unsharded)."""
    g, per, d = arch.num_key_value_heads, arch.heads_per_group, arch.head_dim
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return (q.reshape(g * per * d, *rest).contiguous(), k.reshape(g * d, *rest).contiguous(),
            v.reshape(g * d, *rest).contiguous())


def _hf_layer_tensor(hf: Mapping[str, Tensor], layer: int, suffix: str, arch: LlamaArch, tp_rank: int,
                     tp: int) -> Tensor:
    """This TP rank's shard of the Megatron per-layer parameter `suffix`, built from HF tensors."""
    p = f"model.layers.{layer}."
    if suffix == "input_layernorm.weight":
        return hf[p + "input_layernorm.weight"]
    if suffix == "pre_mlp_layernorm.weight":
        return hf[p + "post_attention_layernorm.weight"]
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        full = fused_qkv(hf[p + f"self_attn.q_proj.{kind}"], hf[p + f"self_attn.k_proj.{kind}"],
                         hf[p + f"self_attn.v_proj.{kind}"], arch)
        return full.chunk(tp, dim=0)[tp_rank]
    if suffix == "self_attention.linear_proj.weight":
        return hf[p + "self_attn.o_proj.weight"].chunk(tp, dim=1)[tp_rank]
    if suffix == "mlp.linear_fc1.weight":
        gate = hf[p + "mlp.gate_proj.weight"].chunk(tp, dim=0)[tp_rank]
        up = hf[p + "mlp.up_proj.weight"].chunk(tp, dim=0)[tp_rank]
        return torch.cat([gate, up], dim=0)
    if suffix == "mlp.linear_fc2.weight":
        return hf[p + "mlp.down_proj.weight"].chunk(tp, dim=1)[tp_rank]
    raise KeyError(f"no Hugging Face source for Megatron parameter suffix {suffix!r}")


def hf_to_megatron_shard(hf: Mapping[str, Tensor], name: str, arch: LlamaArch, *, global_layer: int | None,
                         tp_rank: int, tp: int) -> Tensor:
    """The value of Megatron parameter `name` (its TP shard on `tp_rank`) from the HF state dict `hf`.

    global_layer: the global decoder-layer index of `name` (None for non-layer parameters).
    """
    if global_layer is not None:
        _, suffix = _split_megatron_name(name)
        return _hf_layer_tensor(hf, global_layer, _local_suffix(suffix), arch, tp_rank, tp)
    hf_name = _GLOBAL_NAMES.get(name)
    if hf_name is None:
        raise KeyError(f"no Hugging Face source for Megatron parameter {name!r}")
    if hf_name == "lm_head.weight" and hf_name not in hf:  # tied checkpoints may omit lm_head
        hf_name = "model.embed_tokens.weight"
    if hf_name == "model.norm.weight":
        return hf[hf_name]
    return hf[hf_name].chunk(tp, dim=0)[tp_rank]  # embedding and output layer: vocab-sharded


@torch.no_grad()
def load_hf_weights(model: nn.Module, hf: Mapping[str, Tensor], arch: LlamaArch, *, tp_rank: int = 0,
                    tp: int = 1) -> None:
    """Copy the HF state dict `hf` into the (TP-sharded, possibly pipeline-staged) Megatron `model`.

    Every parameter of `model` is written; a missing HF tensor raises KeyError naming it, a shape
    mismatch raises ValueError naming the parameter and both shapes.
    """
    for name, param in model.named_parameters():
        local, _ = _split_megatron_name(name)
        layer = None if local is None else _global_layer_index(model, local)
        value = hf_to_megatron_shard(hf, name, arch, global_layer=layer, tp_rank=tp_rank, tp=tp)
        if value.shape != param.shape:
            raise ValueError(f"{name}: converted shape {tuple(value.shape)} != parameter shape {tuple(param.shape)}")
        param.copy_(value.to(param.dtype))


def _gather_full(param: Tensor, tp_group: Any) -> Tensor:
    """The unsharded value of a Megatron parameter (all-gather over TP when it is TP-sharded)."""
    if not getattr(param, "tensor_model_parallel", False) or group_size(tp_group) == 1:
        return param.detach()
    return gather_along_dim(param.detach(), int(param.partition_dim), tp_group)  # type: ignore[attr-defined]


@torch.no_grad()
def iter_hf_weights(model: nn.Module, arch: LlamaArch, *, tp_group: Any = None,
                    dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """Hugging Face (name, full tensor) pairs of this pipeline stage's parameters, TP shards gathered.

    Every TP rank must iterate (the gathers are collectives); all ranks get the same tensors. Used to
    refit the rollout engine after an optimizer step and to export a Hugging Face checkpoint. Tied
    models yield no `lm_head.weight` (vLLM and transformers tie it themselves).
    """
    tp = group_size(tp_group)
    for name, param in model.named_parameters():
        if name == "output_layer.weight" and arch.tie_word_embeddings:
            continue  # the last pipeline stage's copy of a tied embedding: the first stage exports it
        full = _gather_full(param, tp_group)
        if dtype is not None:
            full = full.to(dtype)
        local, suffix = _split_megatron_name(name)
        if local is None:
            hf_name = _GLOBAL_NAMES.get(name)
            if hf_name is None:
                raise KeyError(f"no Hugging Face name for Megatron parameter {name!r}")
            yield hf_name, full
            continue
        layer = _global_layer_index(model, local)
        p = f"model.layers.{layer}."
        suffix = _local_suffix(suffix)
        if suffix == "input_layernorm.weight":
            yield p + "input_layernorm.weight", full
        elif suffix == "pre_mlp_layernorm.weight":
            yield p + "post_attention_layernorm.weight", full
        elif suffix.startswith("self_attention.linear_qkv."):
            kind = suffix.rsplit(".", 1)[1]
            q, k, v = split_qkv(full, arch)
            yield p + f"self_attn.q_proj.{kind}", q
            yield p + f"self_attn.k_proj.{kind}", k
            yield p + f"self_attn.v_proj.{kind}", v
        elif suffix == "self_attention.linear_proj.weight":
            yield p + "self_attn.o_proj.weight", full
        elif suffix == "mlp.linear_fc1.weight":
            # gathered as [gate_0; up_0; gate_1; up_1; ...]: undo the per-rank interleave
            halves = [chunk.chunk(2, dim=0) for chunk in full.chunk(tp, dim=0)]
            yield p + "mlp.gate_proj.weight", torch.cat([h[0] for h in halves], dim=0)
            yield p + "mlp.up_proj.weight", torch.cat([h[1] for h in halves], dim=0)
        elif suffix == "mlp.linear_fc2.weight":
            yield p + "mlp.down_proj.weight", full
        else:
            raise KeyError(f"no Hugging Face name for Megatron parameter {name!r}")


def expected_hf_names(arch: LlamaArch) -> set[str]:
    """Every tensor name a full (all stages) export of `arch` yields."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not arch.tie_word_embeddings:
        names.add("lm_head.weight")
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    if arch.qkv_bias:
        per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    for layer in range(arch.num_layers):
        names.update(f"model.layers.{layer}.{suffix}" for suffix in per_layer)
    return names


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LlamaArch",
    "build_gpt_model",
    "expected_hf_names",
    "fused_qkv",
    "hf_to_megatron_shard",
    "iter_hf_weights",
    "load_hf_state_dict",
    "load_hf_weights",
    "read_arch",
    "split_qkv",
    "transformer_config",
    "transformer_engine_available",
]
