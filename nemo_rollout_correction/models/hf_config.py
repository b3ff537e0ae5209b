"""Hugging Face `config.json` -> the architecture the Megatron converter builds, refusing anything it cannot.

Every key of a config is in exactly one of three places, so nothing that changes the math is accepted
by accident:

- a key the converter **interprets** (`FamilySpec.keys` of the checkpoint's family): its value is used, or
  refused with a `ValueError` naming the key when the value asks for math the converter does not build
  (a RoPE type other than default/linear/llama3, a sliding window that can bind, o_proj or MLP biases,
  an activation other than SiLU, dropout in attention, partial rotary, ...);
- a key in `INERT_KEYS`: metadata that cannot change a forward pass (token ids, dtype, output flags,
  initializer range, ...);
- anything else: refused, naming the key. A checkpoint written by a newer transformers, or a family
  variant with an extra switch, fails loudly instead of training a different model than vLLM serves.

RoPE settings are read wherever they are stored: transformers >= 5 writes `rope_parameters` (with
`rope_theta` inside), older versions `rope_theta` plus `rope_scaling`. Both layouts give the same `RopeSpec`;
when both are present they must agree.

Pure Python: importing this module needs neither Megatron nor transformers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

# Config keys that cannot change a forward pass of the causal LM (metadata, generation/tokenizer ids,
# output/caching flags, initialisation of NEW weights, dtype hints: the converter loads the stored tensors in
# the dtype the trainer asks for). Kept explicit: a key missing here and from the family's interpreted keys
# is refused, so review each addition.
INERT_KEYS = frozenset({
    "_name_or_path", "_attn_implementation_autoset", "_commit_hash", "add_cross_attention", "architectures",
    "bad_words_ids", "begin_suppress_tokens", "bos_token_id", "chunk_size_feed_forward",
    "cross_attention_hidden_size", "decoder_start_token_id", "diversity_penalty", "do_sample", "dtype",
    "early_stopping", "encoder_no_repeat_ngram_size",
    "eos_token_id", "exponential_decay_length_penalty", "finetuning_task", "forced_bos_token_id",
    "forced_eos_token_id", "id2label", "initializer_range", "is_decoder", "is_encoder_decoder", "label2id",
    "length_penalty", "max_length", "min_length", "model_type", "no_repeat_ngram_size", "num_beam_groups",
    "num_beams", "num_return_sequences", "output_attentions", "output_hidden_states", "output_scores",
    "pad_token_id", "prefix", "pretraining_tp", "problem_type", "pruned_heads", "remove_invalid_values",
    "repetition_penalty", "return_dict", "return_dict_in_generate", "sep_token_id", "suppress_tokens",
    "task_specific_params", "temperature", "tf_legacy_loss", "tie_encoder_decoder", "tokenizer_class", "top_k",
    "top_p", "torch_dtype", "torchscript", "transformers_version", "typical_p", "use_bfloat16", "use_cache",
})
# Besides the names above, keys starting with "_" (private metadata such as `_model_name_or_path`) and
# special-token ids (`*_token_id`, `*_token_ids`: `unk_token_id`, ...) are inert by pattern.
# Why some of these are inert: `chunk_size_feed_forward` chunks the MLP over the sequence (same result);
# `pretraining_tp` is ignored by transformers 5's Llama (it split the linear layers into equal slices in 4.x: the
# same product); the sampling keys (`temperature`, `top_k`, ...) are generation defaults, never read by a forward.

ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_KEYS = {"default": {"rope_type", "type", "rope_theta"},
              "linear": {"rope_type", "type", "rope_theta", "factor"},
              "llama3": {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"}}


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters: `rope_type` in `ROPE_TYPES` and the fields that type uses."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_dim: int) -> Tensor:
        """`[head_dim / 2]` float32 inverse frequencies, as transformers computes them for this rope type.

        Written here rather than taken from Megatron-Core: 0.16.1's `RotaryEmbedding(rope_scaling=True)` takes
        only the llama3 `factor` and hard-codes low_freq_factor=1, high_freq_factor=4 and
        original_max_position_embeddings=8192, and its `rotary_base` is an int. Computing the frequencies
        from the checkpoint's own values (and setting the model's `inv_freq`) is exact for any of them.
        """
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        inv_freq = 1.0 / (self.theta ** exponents)
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type != "llama3":
            return inv_freq
        old_len = self.original_max_position_embeddings
        low_wavelen, high_wavelen = old_len / self.low_freq_factor, old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are divided by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        blended = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, blended, scaled)


@dataclass(frozen=True)
class ModelArch:
    """The architecture hyper-parameters read from a Hugging Face `config.json` (see `from_hf_config`)."""

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
    family: str = "llama"
    qk_norm: bool = False
    rope: RopeSpec = field(default_factory=RopeSpec)
    num_experts: int = 0
    """Routed experts per MoE layer (0: dense MLPs)."""
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    """Renormalise the top-k router probabilities to sum to 1 (else softmax over all experts, then top-k)."""

    @property
    def is_moe(self) -> bool:
        """Whether every decoder layer's MLP is a mixture of experts."""
        return self.num_experts > 0

    @property
    def heads_per_group(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelArch:
        """Read and validate a Hugging Face config mapping; anything not built exactly raises ValueError."""
        return parse_hf_config(config)

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise ValueError naming the dimension that `tp` does not divide."""
        sizes = [("num_key_value_heads", self.num_key_value_heads), ("vocab_size", self.vocab_size),
                 ("intermediate_size", self.intermediate_size), ("num_attention_heads", self.num_attention_heads)]
        if self.is_moe:  # experts are tensor-parallel over the same ranks (expert TP = TP)
            sizes[2] = ("moe_intermediate_size", self.moe_intermediate_size)
        for name, value in sizes:
            if value % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide {name}={value}; "
                                 f"choose a divisor of {value}")



# --- families ---------------------------------------------------------------------------------------

_Check = Callable[[Mapping[str, Any], str], None]


def _refuse_true(key: str, what: str) -> _Check:
    def check(config: Mapping[str, Any], arch: str) -> None:
        if config.get(key):
            raise ValueError(f"{arch}: {key}={config[key]!r} is not supported ({what})")
    return check


def _refuse_nonzero(key: str, what: str) -> _Check:
    def check(config: Mapping[str, Any], arch: str) -> None:
        if float(config.get(key) or 0.0) != 0.0:
            raise ValueError(f"{arch}: {key}={config[key]!r} is not supported ({what})")
    return check


def _check_activation(config: Mapping[str, Any], arch: str) -> None:
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{arch}: hidden_act={act!r} is not supported (SwiGLU with silu only)")


def _check_sliding_window(config: Mapping[str, Any], arch: str) -> None:
    """A sliding window is accepted only where it cannot bind (disabled, or >= max_position_embeddings)."""
    layer_types = config.get("layer_types")
    if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
        kinds = sorted(set(layer_types))
        raise ValueError(f"{arch}: layer_types={kinds} is not supported (full_attention layers only)")
    enabled = config.get("use_sliding_window", True)  # Mistral has no switch: a window is always on
    window = config.get("sliding_window")
    if enabled and window is not None:
        max_pos = int(config.get("max_position_embeddings", 2048))
        if int(window) < max_pos:
            raise ValueError(f"{arch}: sliding_window={window} is not supported (sliding-window attention); only "
                             f"windows >= max_position_embeddings={max_pos}, which never bind, are accepted")


@dataclass(frozen=True)
class FamilySpec:
    """One architecture family: its HF class names, the config keys it interprets, and how."""

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    keys: frozenset[str]
    """Config keys this family interprets (each one used or checked below); the rest must be `INERT_KEYS`."""
    checks: tuple[_Check, ...]
    qkv_bias: Callable[[Mapping[str, Any]], bool]
    qk_norm: bool = False
    moe: bool = False


_CORE_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
    "hidden_act", "attention_dropout", "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
})
_SLIDING_KEYS = frozenset({"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"})
_COMMON_CHECKS: tuple[_Check, ...] = (
    _check_activation,
    _refuse_nonzero("attention_dropout", "dropout inside attention; the trainer runs none"),
)
def _check_moe_layers(config: Mapping[str, Any], arch: str) -> None:
    """Only models whose every layer is a MoE layer (no interleaved dense MLPs)."""
    if config.get("mlp_only_layers"):
        raise ValueError(f"{arch}: mlp_only_layers={config['mlp_only_layers']!r} is not supported (every layer "
                         "must be a MoE layer)")
    if int(config.get("decoder_sparse_step", 1)) != 1:
        raise ValueError(f"{arch}: decoder_sparse_step={config['decoder_sparse_step']!r} is not supported (every "
                         "layer must be a MoE layer)")


# Keys of Qwen3-MoE. `router_aux_loss_coef` and `output_router_logits` only concern transformers' own
# load-balancing loss, never the logits; the trainer adds no auxiliary loss (RL fine-tuning keeps the router's
# balance as it is), so they are read and deliberately unused.
_MOE_KEYS = frozenset({"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                       "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
                       "output_router_logits"})
# Keys of Mixtral: experts are `intermediate_size` wide and the top k always renormalised. Router jitter is
# multiplicative noise on the router input in training mode, which the trainer does not add: refused unless 0.
_MIXTRAL_KEYS = frozenset({"num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits",
                           "router_jitter_noise"})
_O_PROJ_BIAS = _refuse_true("attention_bias", "it also adds an o_proj bias, which the converter does not map")

FAMILIES: dict[str, FamilySpec] = {spec.name: spec for spec in (
    FamilySpec("llama", ("LlamaForCausalLM",), ("llama",), _CORE_KEYS | {"attention_bias", "mlp_bias"},
               (*_COMMON_CHECKS, _O_PROJ_BIAS, _refuse_true("mlp_bias", "MLP biases")), lambda c: False),
    FamilySpec("mistral", ("MistralForCausalLM",), ("mistral",), _CORE_KEYS | {"sliding_window"},
               (*_COMMON_CHECKS, _check_sliding_window), lambda c: False),
    FamilySpec("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), _CORE_KEYS | _SLIDING_KEYS,
               (*_COMMON_CHECKS, _check_sliding_window), lambda c: True),
    FamilySpec("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), _CORE_KEYS | _SLIDING_KEYS | {"attention_bias"},
               (*_COMMON_CHECKS, _check_sliding_window, _O_PROJ_BIAS), lambda c: False, qk_norm=True),
    FamilySpec("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",),
               _CORE_KEYS | _SLIDING_KEYS | _MOE_KEYS | {"attention_bias"},
               (*_COMMON_CHECKS, _check_sliding_window, _O_PROJ_BIAS, _check_moe_layers), lambda c: False,
               qk_norm=True, moe=True),
    FamilySpec("mixtral", ("MixtralForCausalLM",), ("mixtral",), _CORE_KEYS | {"sliding_window"} | _MIXTRAL_KEYS,
               (*_COMMON_CHECKS, _check_sliding_window,
                _refuse_nonzero("router_jitter_noise", "router input noise; the trainer adds none")),
               lambda c: False, moe=True),
)}
SUPPORTED_ARCHITECTURES = tuple(arch for spec in FAMILIES.values() for arch in spec.architectures)


def family_of(config: Mapping[str, Any]) -> tuple[FamilySpec, str]:
    """The family of a config (by `architectures[0]`, else `model_type`) and the architecture name."""
    archs = config.get("architectures") or []
    arch = archs[0] if archs else str(config.get("model_type", "?"))
    for spec in FAMILIES.values():
        if arch in spec.architectures or (not archs and arch in spec.model_types):
            return spec, spec.architectures[0] if not archs else arch
    raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def parse_rope(config: Mapping[str, Any], arch: str) -> RopeSpec:
    """The RoPE settings of `config`, from `rope_parameters` (transformers >= 5) or `rope_theta`/`rope_scaling`."""
    if float(config.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ValueError(f"{arch}: partial_rotary_factor={config['partial_rotary_factor']!r} is not supported "
                         "(rotary embedding over the whole head only)")
    sources = []
    params = config.get("rope_parameters")
    if params:
        if not isinstance(params, Mapping) or ("rope_type" not in params and "type" not in params):
            raise ValueError(f"{arch}: rope_parameters={params!r} is not supported (per-layer-type RoPE or no "
                             "rope_type)")
        merged = dict(params)
        top_theta = config.get("rope_theta")  # theta kept at the top level too
        if top_theta is not None and float(merged.setdefault("rope_theta", top_theta)) != float(top_theta):
            raise ValueError(f"{arch}: rope_theta={top_theta!r} and rope_parameters.rope_theta="
                             f"{merged['rope_theta']!r} disagree")
        sources.append(("rope_parameters", merged))
    if config.get("rope_scaling") or ("rope_theta" in config and not sources):
        legacy = dict(config.get("rope_scaling") or {"rope_type": "default"})
        if "rope_theta" in config:
            legacy["rope_theta"] = config["rope_theta"]
        sources.append(("rope_scaling", legacy))
    if not sources:
        return RopeSpec()
    specs = [(key, _rope_from_dict(key, values, arch)) for key, values in sources]
    if len(specs) == 2 and specs[0][1] != specs[1][1]:
        raise ValueError(f"{arch}: rope_parameters={params!r} and rope_scaling/rope_theta="
                         f"{config.get('rope_scaling')!r}/{config.get('rope_theta')!r} disagree")
    return specs[0][1]


def _rope_from_dict(key: str, values: Mapping[str, Any], arch: str) -> RopeSpec:
    rope_type = str(values.get("rope_type", values.get("type", "default")))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{arch}: {key}.rope_type={rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    unknown = sorted(set(values) - _ROPE_KEYS[rope_type])
    if unknown:
        raise ValueError(f"{arch}: {key} fields {unknown} are not supported for rope_type={rope_type!r} "
                         f"(supported fields: {sorted(_ROPE_KEYS[rope_type])})")
    theta = float(values.get("rope_theta", 10000.0))
    if rope_type == "default":
        return RopeSpec("default", theta)
    if "factor" not in values:
        raise ValueError(f"{arch}: {key}.factor is required for rope_type={rope_type!r}")
    if rope_type == "linear":
        return RopeSpec("linear", theta, factor=float(values["factor"]))
    missing = sorted(_ROPE_KEYS["llama3"] - {"type", "rope_type", "rope_theta"} - set(values))
    if missing:
        raise ValueError(f"{arch}: {key} is missing {missing} for rope_type='llama3'")
    return RopeSpec("llama3", theta, factor=float(values["factor"]), low_freq_factor=float(values["low_freq_factor"]),
                    high_freq_factor=float(values["high_freq_factor"]),
                    original_max_position_embeddings=int(values["original_max_position_embeddings"]))


def is_inert_key(key: str) -> bool:
    """Whether config key `key` cannot change a forward pass (`INERT_KEYS` or an inert pattern)."""
    return key in INERT_KEYS or key.startswith("_") or key.endswith(("_token_id", "_token_ids"))


def unknown_keys(config: Mapping[str, Any], spec: FamilySpec) -> list[str]:
    """Config keys neither interpreted by `spec` nor known to be inert (sorted)."""
    handled = spec.keys | {"quantization_config", "auto_map"}
    return sorted(key for key in config if key not in handled and not is_inert_key(key))


def parse_hf_config(config: Mapping[str, Any]) -> ModelArch:
    """Validate a Hugging Face config mapping and return its `ModelArch`; ValueError names any refused key."""
    spec, arch = family_of(config)
    if config.get("quantization_config"):
        raise ValueError(f"{arch}: quantization_config is not supported (dequantize the checkpoint first)")
    if config.get("auto_map"):
        raise ValueError(f"{arch}: auto_map (custom modelling code) is not supported")
    unknown = unknown_keys(config, spec)
    if unknown:
        raise ValueError(f"{arch}: config keys {unknown} are not known to the converter; they may change the "
                         "model's math, so they are refused (nemo_rollout_correction.models.hf_config lists what "
                         "each family interprets and which keys are known to be inert)")
    for check in spec.checks:
        check(config, arch)
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    rope = parse_rope(config, arch)
    moe: dict[str, Any] = {}
    if spec.moe:
        mixtral = spec.name == "mixtral"  # experts as wide as `intermediate_size`, top k always renormalised
        experts = config.get("num_local_experts", config.get("num_experts"))
        width = config.get("intermediate_size" if mixtral else "moe_intermediate_size")
        if not experts or not config.get("num_experts_per_tok") or not width:
            raise ValueError(f"{arch}: num_local_experts (or num_experts), num_experts_per_tok and "
                             f"{'intermediate_size' if mixtral else 'moe_intermediate_size'} are required")
        moe = {"num_experts": int(experts), "num_experts_per_tok": int(config["num_experts_per_tok"]),
               "moe_intermediate_size": int(width),
               "norm_topk_prob": True if mixtral else bool(config.get("norm_topk_prob", False))}
    return ModelArch(
        architecture=arch,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope.theta,
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=spec.qkv_bias(config),
        family=spec.name,
        qk_norm=spec.qk_norm,
        rope=rope,
        **moe,
    )


def read_arch(hf_dir: str | Path) -> ModelArch:
    """The architecture of the Hugging Face checkpoint directory `hf_dir` (its config.json)."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: expected a Hugging Face checkpoint directory")
    return parse_hf_config(json.loads(path.read_text()))


__all__ = [
    "FAMILIES",
    "INERT_KEYS",
    "ROPE_TYPES",
    "SUPPORTED_ARCHITECTURES",
    "FamilySpec",
    "ModelArch",
    "RopeSpec",
    "family_of",
    "is_inert_key",
    "parse_hf_config",
    "parse_rope",
    "read_arch",
    "unknown_keys",
]
