"""`policy.lora` and `rollout.lora_sync`: config checks, name mapping, and which refit path a LoRA run takes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from nemo_rollout_correction.config import ConfigError
from nemo_rollout_correction.config.loader import load_config
from nemo_rollout_correction.harness.settings import adapter_sync, engine_options
from nemo_rollout_correction.models.lora import LoraConfig
from nemo_rollout_correction.rollout.engine_processes import llm_kwargs
from nemo_rollout_correction.rollout.refit.choice import choose_refit_path
from nemo_rollout_correction.rollout.refit.lora_adapter import (
    LoraAdapterRefit,
    adapter_verify_stems,
    max_lora_rank,
    write_adapter_dir,
)
from nemo_rollout_correction.rollout.refit.shared_buffer import SharedBufferRefit


def test_off_by_default_and_hf_names_map_onto_the_fused_megatron_linears() -> None:
    assert not LoraConfig().enabled
    config = LoraConfig(rank=8, target_modules=["q_proj", "v_proj", "down_proj", "linear_proj"])
    assert config.megatron_targets() == ("linear_qkv", "linear_proj", "linear_fc2")
    assert config.scale == 2.0
    assert LoraConfig(rank=4, target_modules=["gate_proj"]).megatron_targets() == ("linear_fc1",)


@pytest.mark.parametrize(("overrides", "key"), [
    ({"rank": -1}, "policy.lora.rank"),
    ({"rank": 8, "alpha": 0.0}, "policy.lora.alpha"),
    ({"rank": 8, "dropout": 1.0}, "policy.lora.dropout"),
    ({"rank": 8, "target_modules": ["qkv_proj"]}, "policy.lora.target_modules"),
    ({"rank": 8, "target_modules": []}, "policy.lora.target_modules"),
])
def test_bad_values_name_the_key(overrides: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=re.escape(key)):
        LoraConfig(**overrides)  # type: ignore[arg-type]


def test_unknown_target_from_the_command_line_lists_the_allowed_names() -> None:
    with pytest.raises(ConfigError, match=r"q_proj.*down_proj"):
        load_config(["policy.lora.rank=8", "policy.lora.target_modules=[attn]"])


def test_a_lora_run_syncs_the_adapter_unless_merged_is_asked(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    full = load_config([])
    assert not adapter_sync(full) and engine_options(full, str(tmp_path)).lora_rank == 0
    assert isinstance(choose_refit_path(engine_options(full, str(tmp_path))), SharedBufferRefit)

    lora = load_config(["policy.lora.rank=12", "policy.lora.alpha=24"])
    options = engine_options(lora, str(tmp_path))
    assert adapter_sync(lora) and (options.lora_rank, options.lora_alpha) == (12, 24.0)
    assert isinstance(choose_refit_path(options), LoraAdapterRefit)
    kwargs = llm_kwargs(options, cuda=False)
    assert kwargs["enable_lora"] is True and kwargs["max_lora_rank"] == 16 and kwargs["max_loras"] == 1

    merged = load_config(["policy.lora.rank=12", "rollout.lora_sync=merged"])
    assert not adapter_sync(merged) and engine_options(merged, str(tmp_path)).lora_rank == 0
    assert "enable_lora" not in llm_kwargs(engine_options(merged, str(tmp_path)), cuda=False)
    with pytest.raises(ConfigError, match=r"rollout\.lora_sync"):
        load_config(["rollout.lora_sync=fused"])


def test_vllm_rank_buckets() -> None:
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 64, 512)] == [1, 8, 8, 16, 64, 512]
    with pytest.raises(ValueError, match=r"policy\.lora\.rank"):
        max_lora_rank(513)


def test_adapter_directory_is_peft_shaped(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    stem = "base_model.model.model.layers.{}.self_attn.{}"
    tensors = {f"{stem.format(layer, proj)}.lora_{ab}.weight": torch.randn(4, 3)
               for layer in range(3) for proj in ("q_proj", "o_proj") for ab in "AB"}
    out = write_adapter_dir(tmp_path / "a", tensors, rank=4, alpha=8.0, base_model="tiny-llama")
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, ["o_proj", "q_proj"])
    assert config["base_model_name_or_path"] == "tiny-llama"
    assert set(load_file(str(out / "adapter_model.safetensors"))) == set(tensors)
    # verification reads every projection of the first and the last layer
    assert adapter_verify_stems(tensors) == [stem.format(layer, proj) for layer in (0, 2)
                                             for proj in ("o_proj", "q_proj")]


def test_lora_on_a_quantized_engine_is_refused_naming_both_keys() -> None:
    with pytest.raises(ConfigError, match=r"policy\.lora\.rank=8 with rollout\.quantization=int8"):
        load_config(["policy.lora.rank=8", "rollout.quantization=int8"])
    load_config(["policy.lora.rank=8"])  # each alone is fine
    load_config(["rollout.quantization=int8"])


def test_audit_lora_b_std_must_be_a_finite_non_negative_number() -> None:
    for bad in ("-0.1", "nan", "inf"):
        with pytest.raises(ConfigError, match=r"audit\.lora_b_std=.* a finite number >= 0"):
            load_config([f"audit.lora_b_std={bad}"])
    assert load_config(["audit.lora_b_std=0"]).audit.lora_b_std == 0.0
