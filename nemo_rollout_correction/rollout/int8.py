"""INT8 W8A8 rollouts (`rollout.quantization=int8`): the trainer's weights as vLLM's compressed-tensors int8 layers.

What is quantized: every linear layer of the decoder blocks (q/k/v/o, gate/up/down: `is_quantized_linear`), with
symmetric int8 weights and one float32 scale per output channel (`quantize_per_channel`), and the activations
entering them quantized by vLLM per token at run time (dynamic, symmetric int8). The embeddings, the norms and the
output layer stay in the engine's dtype.

The format is compressed-tensors' `int-quantized` (what llm-compressor writes; written here without it):
`<layer>.weight` int8 [out, in] and `<layer>.weight_scale` float32 [out, 1], and a `quantization_config` in
config.json (`compressed_tensors_config`) that makes vLLM pick `CompressedTensorsW8A8Int8` with per-channel weights
and dynamic per-token activations (`CompressedTensorsConfig._is_dynamic_token_w8a8`); on CPU its oneDNN kernel
(`CPUInt8ScaledMMLinearKernel`).

Tensor parallelism: quantize the full weight, then shard. A per-output-channel scale depends only on its own row,
so for column-parallel layers (q/k/v, gate/up; split by output rows) quantizing a shard equals the shard of the
quantized full weight, and the scales shard with the rows; a row-parallel layer (o, down; split by input columns)
keeps the full per-channel scale of the full row, which a shard alone cannot know. vLLM's sharded layers load
exactly that from a full checkpoint (`shard_quantized` states it for a test).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

INT8_MAX = 127
"""Symmetric int8: the codes lie in [-127, 127] (-128 unused, so -q is always representable)."""
SCALE_SUFFIX = "_scale"
"""`<layer>.weight` -> `<layer>.weight_scale`, compressed-tensors' name of the per-channel scale."""
QUANTIZED_LINEAR = re.compile(r"(^|\.)layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")
"""The decoder blocks' linear layers (Hugging Face names of Llama-style dense models)."""


def is_quantized_linear(name: str) -> bool:
    """Whether the Hugging Face weight `name` is int8 in the engine (a decoder block's linear layer)."""
    return QUANTIZED_LINEAR.search(name) is not None


def scale_name(weight_name: str) -> str:
    """The name of `weight_name`'s per-channel scale (`...q_proj.weight` -> `...q_proj.weight_scale`)."""
    return weight_name + SCALE_SUFFIX


@torch.no_grad()
def quantize_per_channel(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8 of `weight` [out, in]: (codes int8 [out, in], scale float32 [out, 1]).

    scale = max |w| of the row / 127, codes = round(w / scale) in [-127, 127]; `codes * scale` approximates `w`
    to half a step per element. A row of zeros gets scale 1 and zero codes (no division by zero, exact).
    Computed in float32 whatever `weight`'s dtype (a bf16 trainer's weights are exact in float32).
    """
    if weight.dim() != 2:
        raise ValueError(f"per-channel int8 needs a 2-D weight [out, in], got shape {tuple(weight.shape)}")
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1, keepdim=True)  # (torch.aminmax, without the |w| copy, is 16x slower on CPU)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    scaled = w / scale  # the one float32 temporary: rounded and clamped in place
    codes = scaled.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def dequantize(codes: Tensor, scale: Tensor) -> Tensor:
    """float32 [out, in] of int8 `codes` [out, in] and per-channel `scale` [out, 1]."""
    return codes.to(torch.float32) * scale


def quantize_state(state: Iterable[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """The engine's int8 checkpoint of Hugging Face tensors: every `is_quantized_linear` weight as its int8 codes
    plus `<name>_scale`, every other tensor as it is (the caller casts those to the engine's dtype)."""
    out: dict[str, Tensor] = {}
    for name, tensor in state:
        if is_quantized_linear(name):
            out[name], out[scale_name(name)] = quantize_per_channel(tensor)
        else:
            out[name] = tensor
    return out


def shard_quantized(codes: Tensor, scale: Tensor, *, parallel: str, rank: int, size: int) -> tuple[Tensor, Tensor]:
    """TP rank `rank` of `size`'s part of a full quantized weight, as vLLM's sharded layer holds it.

    `parallel="column"` (q/k/v, gate/up): rows split, scales with them; `"row"` (o, down): columns split, the full
    per-channel scale kept. Shapes: `codes` [out, in], `scale` [out, 1].
    """
    if parallel == "column":
        rows = codes.shape[0] // size
        return codes[rank * rows:(rank + 1) * rows], scale[rank * rows:(rank + 1) * rows]
    if parallel == "row":
        cols = codes.shape[1] // size
        return codes[:, rank * cols:(rank + 1) * cols], scale
    raise ValueError(f"parallel must be 'column' or 'row', got {parallel!r}")


def compressed_tensors_config() -> dict[str, Any]:
    """config.json's `quantization_config`: int8 per-channel symmetric weights, int8 dynamic per-token symmetric
    activations on every Linear except the output layer (compressed-tensors' `int-quantized` format)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                            "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                      "dynamic": True},
                "output_activations": None,
                "format": "int-quantized",
            }
        },
    }


def check_int8_model(config: Mapping[str, Any], model_dir: str) -> None:
    """Refuse a model the int8 refit does not cover (ValueError naming `rollout.quantization`): MoE experts and
    architectures whose linear layers are not the Llama-style q/k/v/o, gate/up/down projections."""
    if any(key in config for key in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise ValueError(f"rollout.quantization=int8 supports dense models; {model_dir} has MoE experts "
                         "(allowed for MoE: rollout.quantization=none)")


def write_int8_checkpoint(source_dir: str | Path, out_dir: str | Path,
                          state: Mapping[str, Tensor] | None = None) -> Path:
    """Write the int8 compressed-tensors checkpoint of `state` (default: `source_dir`'s own safetensors weights,
    the weights the trainer starts from) into `out_dir`, with `source_dir`'s config (plus the
    `quantization_config`), generation config and tokenizer files. Returns `out_dir`."""
    from safetensors.torch import load_file, save_file

    source, out = Path(source_dir), Path(out_dir)
    config = json.loads((source / "config.json").read_text())
    check_int8_model(config, str(source))
    if state is None:
        files = sorted(source.glob("*.safetensors"))
        if not files:
            raise ValueError(f"rollout.quantization=int8: {source} has no *.safetensors weights to quantize")
        loaded: dict[str, Tensor] = {}
        for file in files:
            loaded.update(load_file(str(file)))
        state = loaded
    if not any(is_quantized_linear(name) for name in state):
        raise ValueError(f"rollout.quantization=int8: no decoder linear layer (q/k/v/o, gate/up/down_proj) among "
                         f"the weights of {source}; allowed models: Llama-style dense models")
    quantized = quantize_state(state.items())
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in quantized.items()}, str(out / "model.safetensors"))
    config["quantization_config"] = compressed_tensors_config()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for item in source.iterdir():  # tokenizer and generation config: everything but weights and config
        if item.is_file() and item.suffix != ".safetensors" and item.name not in ("config.json",) \
                and not item.name.endswith(".safetensors.index.json"):
            shutil.copy2(item, out / item.name)
    return out


__all__ = ["INT8_MAX", "check_int8_model", "compressed_tensors_config", "dequantize", "is_quantized_linear",
           "quantize_per_channel", "quantize_state", "scale_name", "shard_quantized", "write_int8_checkpoint"]
