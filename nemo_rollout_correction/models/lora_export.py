"""LoRA adapters (models/lora.py) in Hugging Face PEFT form: the adapter-only weight sync and `nrc export`.

`hf_adapter_tensors(model, arch, tp_group)` gathers every adapter over TP and converts it to PEFT's names on the
Hugging Face projections (`base_model.model.model.layers.L.self_attn.q_proj.lora_A.weight` `[r, in]`,
`….lora_B.weight` `[out, r]`), through the same table rows as the full weights (`hf_mapping.hf_tensors_of`):

- a fused column-parallel linear shares one A: `linear_qkv`'s A is the `lora_A` of q_proj, k_proj and v_proj
  alike, and its B (`[groups * (per + 2) * head_dim, r]`, Megatron's per-query-group layout) splits into the q, k
  and v rows exactly as the weight does; `linear_fc1`'s B (each rank's `[gate_r; up_r]`) into gate and up;
- a row-parallel linear (`linear_proj` -> o_proj, `linear_fc2` -> down_proj) gathers A along its input dim.

Since `W_q x + s B_q A x` is what PEFT computes per projection, the converted adapter on the Hugging Face model
equals the trainer's adapter on the fused linear. `write_peft_adapter` writes `adapter_config.json` and
`adapter_model.safetensors`, which PEFT (`PeftModel.from_pretrained`) and vLLM (`LoRARequest`) load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from nemo_rollout_correction.distributed.tensor_gather import gather_along_dim, group_size
from nemo_rollout_correction.models.hf_config import ModelArch
from nemo_rollout_correction.models.hf_mapping import hf_tensors_of
from nemo_rollout_correction.models.lora import LoraConfig, adapters

PEFT_PREFIX = "base_model.model."


@torch.no_grad()
def hf_adapter_tensors(model: nn.Module, arch: ModelArch, *, tp_group: Any = None,
                       dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """PEFT name -> full adapter tensor of this pipeline stage (module docstring); every TP rank must call it."""
    tp = group_size(tp_group)
    out: dict[str, Tensor] = {}
    for linear_name, adapter in adapters(model):
        a, b = adapter.a.detach(), adapter.b.detach()
        if adapter.kind == "column":
            b = gather_along_dim(b, 0, tp_group) if tp > 1 else b
        else:
            a = gather_along_dim(a, 1, tp_group) if tp > 1 else a
        for hf_name, b_part in hf_tensors_of(model, arch, f"{linear_name}.weight", b, tp):
            stem = PEFT_PREFIX + hf_name.removesuffix(".weight")
            out[f"{stem}.lora_A.weight"] = a.to(dtype or a.dtype).to("cpu").clone()
            out[f"{stem}.lora_B.weight"] = b_part.to(dtype or b_part.dtype).to("cpu").contiguous().clone()
    return out


def hf_target_modules(tensors: dict[str, Tensor]) -> list[str]:
    """The Hugging Face projection names (`q_proj`, …) the PEFT tensors cover."""
    return sorted({name.removesuffix(".lora_A.weight").rsplit(".", 1)[-1] for name in tensors
                   if name.endswith(".lora_A.weight")})


def peft_adapter_config(config: LoraConfig, tensors: dict[str, Tensor], base_model: str) -> dict[str, Any]:
    """PEFT's `adapter_config.json` for `tensors` trained with `config` on `base_model` (a path or a hub name)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": hf_target_modules(tensors),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_peft_adapter(out_dir: str | Path, tensors: dict[str, Tensor], config: LoraConfig,
                       base_model: str) -> Path:
    """Write `adapter_config.json` and `adapter_model.safetensors` into `out_dir`; returns it."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(peft_adapter_config(config, tensors, base_model), indent=2))
    return out


__all__ = ["PEFT_PREFIX", "hf_adapter_tensors", "hf_target_modules", "peft_adapter_config", "write_peft_adapter"]
