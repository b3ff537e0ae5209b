"""`models.hf_config`: every Hugging Face config key is interpreted, known inert, or refused by name.

The walk over `AutoConfig.for_model(<model_type>)` of every supported family is the guard against a new
transformers release (or a family variant) adding a key that changes the math: such a key is neither in the
family's interpreted keys nor in `INERT_KEYS`, so this test fails and someone has to decide.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from default_lane import require

from nemo_rollout_correction.models.hf_config import (
    FAMILIES,
    INERT_KEYS,
    RopeSpec,
    parse_hf_config,
    unknown_keys,
)

transformers = require("transformers", "megatron")

TINY = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 128}


def _config(model_type: str, **overrides: Any) -> dict[str, Any]:
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **overrides})
    out: dict[str, Any] = config.to_dict()
    if not out.get("architectures"):
        out["architectures"] = [FAMILIES[model_type].architectures[0]]
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_default_config_key_is_interpreted_or_inert(family: str) -> None:
    spec = FAMILIES[family]
    for model_type in spec.model_types:
        config = transformers.AutoConfig.for_model(model_type).to_dict()
        assert unknown_keys(config, spec) == [], (
            f"{model_type}: transformers {transformers.__version__} config keys not interpreted by the converter "
            "and not listed as inert; decide whether they change the math")
        assert not spec.keys & INERT_KEYS  # a key is either interpreted or inert, never both


def test_inert_patterns() -> None:
    # what a GGUF-converted SmolLM2 config carries besides the usual keys
    assert parse_hf_config({**_config("llama"), "_model_name_or_path": "x", "unk_token_id": 0}).family == "llama"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_tiny_configs_parse(family: str) -> None:
    arch = parse_hf_config(_config(family))
    assert arch.family == family and arch.head_dim == 32 and arch.num_key_value_heads == 1
    assert arch.qk_norm == family.startswith("qwen3") and arch.qkv_bias == (family == "qwen2")
    assert arch.is_moe == (family == "qwen3_moe")


def test_mixtral_fields() -> None:
    arch = parse_hf_config(_config("mixtral", num_local_experts=8, num_experts_per_tok=2, sliding_window=None))
    assert (arch.num_experts, arch.moe_intermediate_size, arch.norm_topk_prob, arch.qk_norm) == (8, 128, True, False)


def test_qwen3_moe_fields() -> None:
    arch = parse_hf_config(_config("qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                   norm_topk_prob=True))
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size, arch.norm_topk_prob) == (
        8, 2, 32, True)


def test_mistral_window_is_refused_unless_it_cannot_bind() -> None:
    with pytest.raises(ValueError, match="sliding_window=64 is not supported"):
        parse_hf_config(_config("mistral", sliding_window=64))
    assert parse_hf_config(_config("mistral", sliding_window=128)).family == "mistral"  # == max positions
    assert parse_hf_config(_config("mistral", sliding_window=None)).family == "mistral"


@pytest.mark.parametrize(("family", "overrides", "message"), [
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0},
     "layer_types=.*sliding_attention"),
    ("llama", {"attention_bias": True}, "attention_bias=True is not supported .*o_proj"),
    ("qwen3", {"attention_bias": True}, "attention_bias=True"),
    ("llama", {"mlp_bias": True}, "mlp_bias=True"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("llama", {"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "rope_parameters.rope_type='yarn' is not supported; supported: default, linear, llama3"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}},
     "rope_type='dynamic'"),
    ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ("qwen3_moe", {"mlp_only_layers": [0]}, r"mlp_only_layers=\[0\] is not supported"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2 is not supported"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported"),
    ("mixtral", {"sliding_window": 64}, "sliding_window=64 is not supported"),
])
def test_math_changing_values_are_refused_by_name(family: str, overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_hf_config(_config(family, **overrides))


def test_unknown_and_special_keys_are_refused() -> None:
    base = _config("llama")
    with pytest.raises(ValueError, match=r"config keys \['final_logit_softcapping'\] are not known"):
        parse_hf_config({**base, "final_logit_softcapping": 30.0})
    with pytest.raises(ValueError, match="quantization_config"):
        parse_hf_config({**base, "quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(ValueError, match="auto_map"):
        parse_hf_config({**base, "auto_map": {"AutoModelForCausalLM": "x.Y"}})
    with pytest.raises(ValueError, match="unsupported architecture 'GemmaForCausalLM'"):
        parse_hf_config({**base, "architectures": ["GemmaForCausalLM"]})


LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


def test_llama3_rope_in_both_layouts() -> None:
    v5 = parse_hf_config(_config("llama", rope_parameters={**LLAMA31, "rope_theta": 500000.0}))
    # a config.json written by transformers 4 (e.g. Meta-Llama-3.1-8B's): rope_theta + rope_scaling at the top
    v4 = {k: v for k, v in _config("llama").items() if k != "rope_parameters"}
    v4 |= {"rope_theta": 500000.0, "rope_scaling": dict(LLAMA31)}
    assert parse_hf_config(v4).rope == v5.rope == RopeSpec("llama3", 500000.0, 8.0, 1.0, 4.0, 8192)
    split = {**v4, "rope_scaling": None, "rope_parameters": dict(LLAMA31)}  # theta only at the top level
    assert parse_hf_config(split).rope == v5.rope
    with pytest.raises(ValueError, match=r"rope_theta=10000\.0 and rope_parameters\.rope_theta=500000\.0 disagree"):
        parse_hf_config({**split, "rope_theta": 10000.0, "rope_parameters": {**LLAMA31, "rope_theta": 500000.0}})
    with pytest.raises(ValueError, match="disagree"):
        parse_hf_config({**v4, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    incomplete = {k: v for k, v in LLAMA31.items() if k != "low_freq_factor"}
    with pytest.raises(ValueError, match=r"missing \['low_freq_factor'\]"):
        parse_hf_config({**v4, "rope_scaling": incomplete})
    with pytest.raises(ValueError, match=r"fields \['beta_fast'\] are not supported"):
        parse_hf_config({**v4, "rope_scaling": {**LLAMA31, "beta_fast": 32}})


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3"])
def test_rope_frequencies_equal_transformers(rope_type: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params: dict[str, Any] = {"rope_type": rope_type, "rope_theta": 500000.0}
    if rope_type != "default":
        params["factor"] = 8.0
    if rope_type == "llama3":
        params |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = transformers.AutoConfig.for_model("llama", **TINY, rope_parameters=params)
    reference = (ROPE_INIT_FUNCTIONS[rope_type](config, "cpu") if rope_type != "default" else
                 (1.0 / 500000.0 ** (torch.arange(0, 32, 2).float() / 32), 1.0))[0]
    arch = parse_hf_config(_config("llama", rope_parameters=params))
    assert torch.equal(arch.rope.inv_freq(arch.head_dim), reference)
