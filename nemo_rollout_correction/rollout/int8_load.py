"""The int8 refit inside a vLLM worker: new int8 weights and scales loaded into a running W8A8 engine in place.

Why not vLLM's own reload: on a compressed-tensors W8A8 int8 model (`rollout/int8.py`) `model.load_weights`
fails (the kernel replaced the parameters by plain ones without a `weight_loader`), and `reload_weights` returns
without error and leaves every logprob NaN (docs/rollout.md, "The NaN trap"): the CPU kernel's oneDNN handler
(`CPUInt8ScaledMMLinearKernel.process_weights_for_onednn`) keeps a raw pointer to the `weight_scale` tensor and
the reload restores the old scale tensors after re-processing (a dangling pointer), and the handler is built in
`torch.get_default_dtype()`, bfloat16 during the engine's first load but float32 during a reload.

What this does instead, per int8 linear layer (`plan_int8_load`, built once per buffer layout):

1. fresh int8 weight and float32 scale parameters of the layer's shapes on this worker, filled by the layer's own
   `weight_loader_v2` from the trainer's full tensors (vLLM's TP sharding and q/k/v, gate/up packing: exactly what
   loading a checkpoint does);
2. registered on the layer in place of the old ones, then the layer's own post-load step
   (`scheme.process_weights_after_loading`: the oneDNN handler, or the sgl kernel's packing) run under the
   model's dtype as default dtype, as at engine start. The new scale parameter stays registered on the layer, so
   the handler's pointer stays valid until the next refit replaces handler and scale together.

Every other tensor (embeddings, norms, the output layer) goes through its parameter's `weight_loader` (vocab
sharding under TP), and embedding-backed GEMMs are re-packed by the caller. `check_int8_layers` is the
verification: each int8 layer's live scale against the buffer's, and its kernel run on a fixed probe against an
int8 reference computed from the buffer (catches NaN, stale and wrongly scaled layers, naming them).
Imported by vLLM's workers: torch and vLLM only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from nemo_rollout_correction.rollout.shared_weights import TensorSlot, slot_view

SCALE_BITS = torch.int32
"""The float32 scales travel through the buffer as their int32 bit patterns (the buffer stores floating tensors
in the engine's dtype; a bfloat16 scale would not be the checkpoint's)."""
PROBE_ROWS = 4
PROBE_CHANNELS_PER_PART = 16
PROBE_TOLERANCE = 0.05
"""`check_int8_layers`: the kernel's output may differ from the reference by this fraction of the reference's
largest magnitude (activation codes rounding differently by one step); a wrong scale, stale or NaN weights do not."""


@dataclass
class Int8Layer:
    """One int8 linear layer of the worker's model and where its tensors lie in the buffer."""

    name: str
    module: Any
    parts: list[tuple[Any, TensorSlot, TensorSlot]]
    """(shard id or None, weight slot (int8), scale slot (int32 bits)) per packed part, in vLLM's fused order."""


@dataclass
class Int8Plan:
    layers: list[Int8Layer] = field(default_factory=list)
    copies: list[tuple[Any, TensorSlot]] = field(default_factory=list)
    """(parameter, slot) of every other tensor, loaded by the parameter's `weight_loader`."""
    skipped: list[str] = field(default_factory=list)
    """Slots no parameter takes by design (a tied output layer's copy)."""


def is_int8_layer(module: Any) -> bool:
    """Whether `module` is a vLLM linear layer with compressed-tensors W8A8 int8."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import CompressedTensorsW8A8Int8

    return isinstance(module, LinearBase) and isinstance(getattr(module, "scheme", None), CompressedTensorsW8A8Int8)


def _shard_ids(module: Any, count: int) -> list[Any]:
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    if isinstance(module, QKVParallelLinear):
        return ["q", "k", "v"][:count]
    if isinstance(module, MergedColumnParallelLinear):
        return list(range(count))
    return [None] * count


def plan_int8_load(model: torch.nn.Module, slots: list[TensorSlot], tied_output: bool) -> Int8Plan:
    """Where every slot goes in `model`; ValueError naming what does not fit (a slot nobody takes, a layer
    without its tensors)."""
    by_name = {slot.name: slot for slot in slots}
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    plan = Int8Plan()
    claimed: set[str] = set()
    for module_name, module in model.named_modules():
        if not is_int8_layer(module):
            continue
        prefix, _, short = module_name.rpartition(".")
        names = [f"{prefix}.{sub}" if prefix else sub for sub in packed.get(short, [short])]
        missing = [n for n in names if f"{n}.weight" not in by_name or f"{n}.weight_scale" not in by_name]
        if missing:
            raise ValueError(f"int8 refit: no int8 weight and scale for {missing} of layer {module_name}")
        ids = _shard_ids(module, len(names))
        parts = [(sid, by_name[f"{n}.weight"], by_name[f"{n}.weight_scale"]) for sid, n in zip(ids, names, strict=True)]
        claimed.update(f"{n}.{what}" for n in names for what in ("weight", "weight_scale"))
        plan.layers.append(Int8Layer(module_name, module, parts))
    params = dict(model.named_parameters())
    for name, slot in by_name.items():
        if name in claimed:
            continue
        param = params.get(name)
        if param is None:
            if name == "lm_head.weight" and tied_output:  # vLLM's loaders skip it too (the embedding is it)
                plan.skipped.append(name)
                continue
            raise ValueError(f"int8 refit: no parameter of the engine takes {name!r}")
        plan.copies.append((param, slot))
    return plan


def _part_tensors(buffer: Tensor, weight: TensorSlot, scale: TensorSlot) -> tuple[Tensor, Tensor]:
    return slot_view(buffer, weight), slot_view(buffer, scale).view(torch.float32)


def _fresh_params(layer: Int8Layer, buffer: Tensor) -> tuple[Any, Any]:
    """New int8 weight and float32 scale parameters of `layer`'s local shapes, filled by its `weight_loader_v2`."""
    from vllm.model_executor.parameter import ChannelQuantScaleParameter, ModelWeightParameter

    module = layer.module
    rows = sum(int(s) for s in module.output_partition_sizes)
    cols = int(module.input_size_per_partition)
    loader = module.weight_loader_v2
    weight = ModelWeightParameter(data=torch.empty(rows, cols, dtype=torch.int8), input_dim=1, output_dim=0,
                                  weight_loader=loader)
    scale = ChannelQuantScaleParameter(data=torch.empty(rows, 1, dtype=torch.float32), output_dim=0,
                                       weight_loader=loader)
    for shard_id, weight_slot, scale_slot in layer.parts:
        codes, scales = _part_tensors(buffer, weight_slot, scale_slot)
        extra = () if shard_id is None else (shard_id,)
        loader(weight, codes, *extra)
        loader(scale, scales, *extra)
    return weight, scale


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set to `dtype` inside (the int8 kernel builds its handler in it)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@torch.no_grad()
def run_int8_load(plan: Int8Plan, buffer: Tensor, model_dtype: torch.dtype) -> int:
    """Load the buffer into the model along `plan`; returns the tensors loaded."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    count = 0
    for param, slot in plan.copies:
        loader = getattr(param, "weight_loader", default_weight_loader)
        loader(param, slot_view(buffer, slot))
        count += 1
    with default_dtype(model_dtype):
        for layer in plan.layers:
            weight, scale = _fresh_params(layer, buffer)
            module = layer.module
            module.weight = weight
            module.weight_scale = scale  # the handler built next points at this tensor: it stays registered here
            module.scheme.process_weights_after_loading(module)
            count += 2 * len(layer.parts)
    return count


def _reference_output(x: Tensor, codes: Tensor, scale: Tensor) -> Tensor:
    """What W8A8 with dynamic symmetric per-token activations computes: [rows, out] float64 of `x` [rows, in],
    int8 `codes` [out, in], `scale` [out, 1]."""
    x64 = x.to(torch.float64)
    x_scale = x64.abs().amax(dim=1, keepdim=True) / 127.0
    x_codes = torch.round(x64 / x_scale).clamp(-127, 127)
    return (x_codes @ codes.to(torch.float64).T) * x_scale * scale.to(torch.float64).T


def probe_channels(part_sizes: list[int], per_part: int = PROBE_CHANNELS_PER_PART) -> Tensor:
    """The output channels whose probe outputs are compared with the reference: up to `per_part` of each packed
    part (q, k, v; gate, up; one part for o and down) of sizes `part_sizes`, at a fixed stride from its first to
    its last channel (int64 [channels], indices into the layer's local output)."""
    picked: list[Tensor] = []
    start = 0
    for size in part_sizes:
        count = min(per_part, size)
        picked.append(start + torch.linspace(0, size - 1, count).round().long())
        start += size
    return torch.cat(picked)


@torch.no_grad()
def check_int8_layers(plan: Int8Plan, buffer: Tensor, model_dtype: torch.dtype) -> dict[str, Any]:
    """Every int8 layer's live state against the buffer: {"checked": layers, "bad": [(layer, why), ...]}.

    Its `weight_scale` must equal the buffer's (exactly, every channel: stale or wrongly scaled otherwise), and
    its kernel (`scheme.apply_weights`) on a fixed probe [PROBE_ROWS, in] must give finite outputs on every output
    channel and, on `probe_channels` (up to PROBE_CHANNELS_PER_PART of each packed part), outputs within
    `PROBE_TOLERANCE` of the int8 reference of the buffer's codes and scales (the kernel's own copy of the
    weights: NaN after a dangling scale pointer, stale codes). Why a sample of channels: the kernel's copy is
    rebuilt from the whole layer at once (`run_int8_load`), so a stale or corrupted copy shows on every part,
    and the reference of all channels in float64 was most of the verification's time (605 ms of 0.6 s on
    SmolLM2-135M; docs/rollout.md)."""
    generator = torch.Generator().manual_seed(1234)
    bad: list[tuple[str, str]] = []
    for layer in plan.layers:
        module = layer.module
        expected_weight, expected_scale = _fresh_params(layer, buffer)
        live_scale = module.weight_scale.data
        if live_scale.shape != expected_scale.shape or not torch.equal(live_scale, expected_scale.data):
            diff = (live_scale.float() - expected_scale.data).abs().max().item() \
                if live_scale.shape == expected_scale.shape else float("nan")
            bad.append((layer.name, f"weight_scale differs from the trainer's (max |diff| {diff:.3g}): stale or "
                                    "wrongly scaled"))
            continue
        x = torch.randn(PROBE_ROWS, expected_weight.shape[1], generator=generator).to(model_dtype)
        got = module.scheme.apply_weights(module, x, None)
        if not torch.isfinite(got).all():
            bad.append((layer.name, "the kernel's output on a probe is not finite (NaN/inf int8 weights or scales)"))
            continue
        channels = probe_channels([int(size) for size in module.output_partition_sizes])
        want = _reference_output(x, expected_weight.data[channels], expected_scale.data[channels])
        err = (got[:, channels].to(torch.float64) - want).abs().max().item()
        bound = PROBE_TOLERANCE * want.abs().max().item()
        if err > bound:
            bad.append((layer.name, f"the kernel's output on a probe is off by {err:.3g} (allowed {bound:.3g}): "
                                    "its int8 weights are not the trainer's (stale or wrongly scaled)"))
    return {"checked": len(plan.layers), "bad": bad}


__all__ = ["Int8Plan", "check_int8_layers", "is_int8_layer", "plan_int8_load", "probe_channels", "run_int8_load"]
