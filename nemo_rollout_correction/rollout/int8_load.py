"""The int8 refit inside a vLLM worker: new int8 weights and scales loaded into a running W8A8 engine in place.

Why not vLLM's own reload: on a compressed-tensors W8A8 int8 model (`rollout/int8.py`) `model.load_weights`
fails (the kernel replaced the parameters by plain ones without a `weight_loader`), and `reload_weights` returns
without error and leaves every logprob NaN (docs/rollout.md, "The NaN trap"): the CPU kernel's oneDNN handler
(`CPUInt8ScaledMMLinearKernel.process_weights_for_onednn`) keeps a raw pointer to the `weight_scale` tensor and
the reload restores the old scale tensors after re-processing (a dangling pointer), and the handler is built in
`torch.get_default_dtype()`, bfloat16 during the engine's first load but float32 during a reload.

What this does instead, per int8 linear layer (`plan_int8_load`, built once per buffer layout):

- at TP = 1 on vLLM's oneDNN kernel (no AMX; per-channel weights, dynamic symmetric activations: what
  `rollout/int8.py` writes), the layer's codes are its parts' slots stacked, a view of the buffer (the trainer
  lays q/k/v and gate/up codes out back to back), and `_build_onednn` does only what the kernel's post-load
  step needs for this configuration: a new float32 scale parameter registered on the layer, then the oneDNN
  handler built from the view (it packs its own copy). vLLM's full step would also copy the weight into a
  transposed parameter and compute an `azp_adj` column sum that symmetric activations never read;
- otherwise (TP > 1, the AMX sgl kernel) fresh int8 weight and float32 scale parameters of the layer's shapes on
  this worker, filled by the layer's own `weight_loader_v2` from the trainer's full tensors (vLLM's TP sharding
  and q/k/v, gate/up packing: exactly what loading a checkpoint does), registered on the layer in place of the
  old ones, then the layer's own post-load step (`scheme.process_weights_after_loading`) run under the model's
  dtype as default dtype, as at engine start.

Either way the new scale parameter stays registered on the layer, so the handler's pointer stays valid until
the next refit replaces handler and scale together.

Every other tensor (embeddings, norms, the output layer) goes through its parameter's `weight_loader` (vocab
sharding under TP), and embedding-backed GEMMs are re-packed by the caller. `check_int8_layers` is the
verification: each int8 layer's live scale against the buffer's, and its kernel run on a fixed probe against an
int8 reference computed from the buffer (catches NaN, stale and wrongly scaled layers, naming them); at TP = 1 it
reads the expected codes and scales from the buffer's views, a shard's through the loaders.
Imported by vLLM's workers: torch and vLLM only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from nemo_rollout_correction.rollout.shared_weights import TensorSlot, slot_view, stacked_view

SCALE_BITS = torch.int32
"""The float32 scales travel through the buffer as their int32 bit patterns (the buffer stores floating tensors
in the engine's dtype; a bfloat16 scale would not be the checkpoint's)."""
PROBE_ROWS = 4
PROBE_CHANNELS_PER_PART = 16
ONEDNN_PRIMITIVE_CACHE = 32
"""The oneDNN handler's primitive cache size, as vLLM's `process_weights_for_onednn` builds it."""
ONEDNN_PARAM_NAMES = ("weight", "weight_scale", "input_scale", "input_zero_point", "azp_adj")
"""The layer attributes the kernel reads (its `layer_param_names`), which `_build_onednn` sets."""
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
    whole: bool = False
    """The layer holds its parts whole, stacked in fused order (TP = 1): its codes are the parts' slots stacked,
    no loader needed (`_whole_tensors`)."""
    onednn: bool = False
    """Its kernel is vLLM's oneDNN one with per-channel weights and dynamic symmetric per-token activations: the
    load builds the handler itself (`_build_onednn`), without vLLM's post-load step's extra work."""


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


def _is_onednn_symmetric(module: Any) -> bool:
    """Whether `module`'s int8 kernel is vLLM's CPU oneDNN kernel (`CPUInt8ScaledMMLinearKernel` on its oneDNN
    method, not the AMX sgl one) with per-channel weight scales and dynamic symmetric per-token activations: the
    only configuration `_build_onednn` reproduces."""
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel

    kernel = getattr(module.scheme, "kernel", None)
    if not isinstance(kernel, CPUInt8ScaledMMLinearKernel):
        return False
    config = kernel.config
    method = getattr(getattr(kernel, "linear_method", None), "__func__", None)
    return (bool(config.is_channelwise) and bool(config.input_symmetric) and not config.is_static_input_scheme
            and method is CPUInt8ScaledMMLinearKernel._apply_weights_onednn
            and list(kernel.layer_param_names) == list(ONEDNN_PARAM_NAMES))


def _holds_parts_whole(module: Any, parts: list[tuple[Any, TensorSlot, TensorSlot]], tp_size: int) -> bool:
    """Whether the layer's local weight is its parts' full tensors stacked (TP = 1 and the shapes agree)."""
    sizes = [int(size) for size in module.output_partition_sizes]
    return (tp_size == 1 and sizes == [weight.shape[0] for _, weight, _ in parts]
            and all(weight.shape[1] == int(module.input_size_per_partition) and scale.shape == (weight.shape[0], 1)
                    for _, weight, scale in parts))


def plan_int8_load(model: torch.nn.Module, slots: list[TensorSlot], tied_output: bool, tp_size: int = 1) -> Int8Plan:
    """Where every slot goes in `model` (one worker's, of a `tp_size` engine); ValueError naming what does not fit
    (a slot nobody takes, a layer without its tensors)."""
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
        whole = _holds_parts_whole(module, parts, tp_size)
        plan.layers.append(Int8Layer(module_name, module, parts, whole, whole and _is_onednn_symmetric(module)))
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


def _whole_tensors(layer: Int8Layer, buffer: Tensor) -> tuple[Tensor, Tensor]:
    """A `whole` layer's int8 codes [out, in] (a view of the buffer when its parts lie back to back, which
    `plan_slots` arranges) and a new float32 scale tensor [out, 1] (a copy: never an alias of the buffer, which
    the next sync overwrites)."""
    codes = stacked_view(buffer, [weight for _, weight, _ in layer.parts])
    scales = torch.cat([slot_view(buffer, scale).view(torch.float32) for _, _, scale in layer.parts])
    return codes, scales


def _build_onednn(layer: Int8Layer, buffer: Tensor, model_dtype: torch.dtype) -> None:
    """What `CPUInt8ScaledMMLinearKernel.process_weights_for_onednn` ends with, for per-channel weights and
    dynamic symmetric activations, without the rest: the new scale registered on the layer, then the oneDNN
    handler built from the codes (it packs a copy of them and keeps a raw pointer to the scale), the unpacked
    weight dropped. vLLM's step also copies the weight into a fresh transposed parameter and computes the
    `azp_adj` term (a float32 column sum of every weight), which only asymmetric activations use: with symmetric
    ones the kernel's epilogue never reads it (`onednn_scaled_mm` without a zero point); it is dropped here."""
    from vllm import _custom_ops as ops

    module = layer.module
    codes, scales = _whole_tensors(layer, buffer)
    kernel = module.scheme.kernel
    module.weight_scale = torch.nn.Parameter(scales, requires_grad=False)  # registered first: the handler's pointer
    kernel.dnnl_handler = ops.create_onednn_scaled_mm(codes.t(), module.weight_scale, model_dtype, True, False,
                                                      ONEDNN_PRIMITIVE_CACHE)
    kernel.linear_method = kernel._apply_weights_onednn
    module.weight = None  # as vLLM leaves it: the handler holds the packed copy
    module.azp_adj = None


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
            count += 2 * len(layer.parts)
            if layer.onednn:
                _build_onednn(layer, buffer, model_dtype)
                continue
            weight, scale = _fresh_params(layer, buffer)
            module = layer.module
            module.weight = weight
            module.weight_scale = scale  # the handler built next points at this tensor: it stays registered here
            module.scheme.process_weights_after_loading(module)
    return count


def _expected(layer: Int8Layer, buffer: Tensor) -> tuple[Tensor, Tensor]:
    """The int8 codes [out, in] and float32 scales [out, 1] `layer` should hold on this worker: a whole layer's
    read from the buffer's views (no copy of its codes), a shard's through the layer's own loaders, as loaded."""
    if layer.whole:
        return _whole_tensors(layer, buffer)
    weight, scale = _fresh_params(layer, buffer)
    return weight.data, scale.data


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
        expected_codes, expected_scale = _expected(layer, buffer)
        live_scale = module.weight_scale.data
        if live_scale.shape != expected_scale.shape or not torch.equal(live_scale, expected_scale):
            diff = (live_scale.float() - expected_scale).abs().max().item() \
                if live_scale.shape == expected_scale.shape else float("nan")
            bad.append((layer.name, f"weight_scale differs from the trainer's (max |diff| {diff:.3g}): stale or "
                                    "wrongly scaled"))
            continue
        x = torch.randn(PROBE_ROWS, expected_codes.shape[1], generator=generator).to(model_dtype)
        got = module.scheme.apply_weights(module, x, None)
        if not torch.isfinite(got).all():
            bad.append((layer.name, "the kernel's output on a probe is not finite (NaN/inf int8 weights or scales)"))
            continue
        channels = probe_channels([int(size) for size in module.output_partition_sizes])
        want = _reference_output(x, expected_codes[channels], expected_scale[channels])
        err = (got[:, channels].to(torch.float64) - want).abs().max().item()
        bound = PROBE_TOLERANCE * want.abs().max().item()
        if err > bound:
            bad.append((layer.name, f"the kernel's output on a probe is off by {err:.3g} (allowed {bound:.3g}): "
                                    "its int8 weights are not the trainer's (stale or wrongly scaled)"))
    return {"checked": len(plan.layers), "bad": bad}


__all__ = ["Int8Plan", "check_int8_layers", "is_int8_layer", "plan_int8_load", "probe_channels", "run_int8_load"]
