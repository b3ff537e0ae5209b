"""The CPU refit's fast path inside a vLLM worker: the shared buffer's tensors go straight into the model.

vLLM's `reload_weights` (the general path, `worker_extension.nrc_reload_from_shared`) is layer-wise: for every
layer it restores the parameters on the meta device, materialises them, binds and runs each parameter's
`weight_loader` through a wrapper, re-runs the layer's post-load step and copies the result back into the
original tensors. For a model of dense layers on one CPU worker almost all of that is bookkeeping around three
operations, which this module does directly with a plan built once per buffer layout:

- a plain parameter (norms, embeddings) receives its slot with one `copy_` (same dtype: a memcpy);
- a linear layer (vLLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, its
  `packed_modules_mapping`) gets its fused weight as a view of the buffer when the trainer's slots lie
  back to back in the fused order (`plan_slots` keeps the state's order; otherwise one `torch.cat`), and
  vLLM's own CPU GEMM dispatch (`dispatch_cpu_unquantized_gemm`, what the layer's post-load step runs) packs
  it into the kernel's layout, a copy, so the buffer can be overwritten by the next refit;
- embedding-backed GEMMs (the output layer, tied or not) are re-packed after their weight changed.

The plan is refused (`NotDirect`, with the reason: the general path runs) for anything it does not know
exactly: tensor parallelism, quantized or MoE layers, a parameter without a slot of its shape, a slot no
parameter takes. So the fast path either loads every tensor the trainer sent or is not used.
Imported by vLLM's workers: torch and vLLM only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from nemo_rollout_correction.rollout.shared_weights import TensorSlot, slot_view, stacked_view


@dataclass
class DirectPlan:
    """Where every slot of one buffer layout goes in one worker's model (built by `plan_direct_load`)."""

    copies: list[tuple[Tensor, TensorSlot]] = field(default_factory=list)
    """(parameter, slot): copied in place (norms, embedding tables, biases)."""
    linears: list[tuple[torch.nn.Module, list[TensorSlot], list[TensorSlot]]] = field(default_factory=list)
    """(linear layer, its weight's slots in fused order, its bias's slots): the weight is re-packed."""
    embeddings: list[torch.nn.Module] = field(default_factory=list)
    """Embedding-backed layers whose packed GEMM is refreshed once their weight is copied."""


def _fused_rows(slots: Sequence[TensorSlot]) -> tuple[int, int] | None:
    """(rows, cols) of the slots stacked along dim 0, or None when their column counts or dtypes differ."""
    if any(len(s.shape) != 2 or s.shape[1] != slots[0].shape[1] or s.dtype != slots[0].dtype for s in slots):
        return None
    return sum(s.shape[0] for s in slots), slots[0].shape[1]


class NotDirect(Exception):
    """Why the fast path does not apply to a model and buffer layout (the general path runs instead)."""


def plan_direct_load(model: torch.nn.Module, slots: Sequence[TensorSlot], tp_size: int) -> DirectPlan:
    """The fast-path plan for `slots` (Hugging Face names) into `model`; raises `NotDirect` saying why not."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )
    from vllm.platforms import current_platform

    if tp_size != 1 or not current_platform.is_cpu():
        raise NotDirect(f"tensor parallel size {tp_size} or not a CPU worker")
    by_name = {slot.name: slot for slot in slots}
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    plan = DirectPlan()
    claimed: set[str] = set()
    seen_params: set[int] = set()

    def take(name: str, shape: tuple[int, ...] | None = None) -> TensorSlot | None:
        slot = by_name.get(name)
        if slot is None or (shape is not None and tuple(slot.shape) != tuple(shape)):
            return None
        claimed.add(name)
        return slot

    for module_name, found in model.named_modules():
        module: Any = found  # vLLM's layers (their attributes are untyped here)
        own = list(module.named_parameters(recurse=False))
        is_linear, is_embedding = isinstance(found, LinearBase), isinstance(found, VocabParallelEmbedding)
        if is_linear:
            if not isinstance(module.quant_method, UnquantizedLinearMethod) or not hasattr(module, "cpu_linear"):
                raise NotDirect(f"{module_name}: {type(module.quant_method).__name__} without a CPU GEMM")
            prefix, _, short = module_name.rpartition(".")
            parts = [f"{prefix}.{sub}" if prefix else sub for sub in packed.get(short, [short])]
            weights = [take(f"{part}.weight") for part in parts]
            if any(w is None for w in weights):
                raise NotDirect(f"{module_name}: no slot for every one of {parts}")
            weight_slots = [w for w in weights if w is not None]
            # vLLM's MoE router (`GateLinear`, a ReplicatedLinear) keeps no partition sizes: such a layer is
            # refused here, like the experts (their fused w13/w2 parameters have no slot of their shape).
            sizes: tuple[Any, Any] = (getattr(module, "output_size_per_partition", None),
                                      getattr(module, "input_size_per_partition", None))
            if None in sizes:
                raise NotDirect(f"{module_name}: {type(found).__name__} has no partition sizes (an MoE router?)")
            fused = _fused_rows(weight_slots)
            if fused != (int(sizes[0]), int(sizes[1])):
                raise NotDirect(f"{module_name}: the slots stack to {fused}")
            bias_slots: list[TensorSlot] = []
            if getattr(module, "bias", None) is not None:
                biases = [take(f"{part}.bias") for part in parts]
                if any(b is None for b in biases):
                    raise NotDirect(f"{module_name}: no bias slot for every one of {parts}")
                bias_slots = [b for b in biases if b is not None]
                if sum(b.shape[0] for b in bias_slots) != module.bias.shape[0]:
                    raise NotDirect(f"{module_name}: the bias slots do not stack to the bias")
                seen_params.add(id(module.bias))
            plan.linears.append((module, weight_slots, bias_slots))
            continue
        if is_embedding:
            if not isinstance(module.quant_method, UnquantizedEmbeddingMethod):
                raise NotDirect(f"{module_name}: {type(module.quant_method).__name__}")
            weight: Any = module.weight
            if id(weight) not in seen_params:  # a tied output layer shares the embedding's parameter
                rows = int(module.shard_indices.org_vocab_end_index - module.shard_indices.org_vocab_start_index)
                slot = take(f"{module_name}.weight", (rows, int(weight.shape[1])))
                if slot is None or slot.torch_dtype != weight.dtype:
                    raise NotDirect(f"{module_name}.weight: no slot of shape ({rows}, {weight.shape[1]}) and "
                                    f"dtype {weight.dtype}")
                plan.copies.append((weight.data[:rows], slot))
                seen_params.add(id(weight))
            elif f"{module_name}.weight" in by_name:  # a tied output layer's copy: vLLM's loaders skip it too
                claimed.add(f"{module_name}.weight")
            if hasattr(module, "cpu_linear"):
                plan.embeddings.append(module)
            continue
        for param_name, param in own:
            if id(param) in seen_params:
                continue
            slot = take(f"{module_name}.{param_name}", tuple(param.shape))
            if slot is None or slot.torch_dtype != param.dtype:
                raise NotDirect(f"{module_name}.{param_name}: no slot of shape {tuple(param.shape)} and dtype "
                                f"{param.dtype}")
            plan.copies.append((param.data, slot))
            seen_params.add(id(param))
    if claimed != set(by_name):  # a tensor the trainer sent that no parameter would take
        raise NotDirect(f"no parameter takes {sorted(set(by_name) - claimed)[:5]}")
    return plan


@torch.no_grad()
def run_direct_load(plan: DirectPlan, buffer: Tensor) -> int:
    """Load the buffer's weights into the model along `plan`; returns the tensors loaded."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    count = 0
    for target, slot in plan.copies:
        target.copy_(slot_view(buffer, slot))
        count += 1
    for module, weight_slots, bias_slots in plan.linears:
        fused = stacked_view(buffer, weight_slots)
        if bias_slots:
            bias: Any = module.bias
            bias.data.copy_(torch.cat([slot_view(buffer, s) for s in bias_slots]))
        # vLLM's CPU post-load step for an unquantized linear layer: pack the weight for the GEMM kernel it
        # picks (oneDNN or sgl), a copy, then drop the unpacked weight (remove_weight=True).
        module.weight = torch.nn.Parameter(fused, requires_grad=False)
        dispatch_cpu_unquantized_gemm(module, remove_weight=True)
        if module.weight.numel() and module.weight.data_ptr() == fused.data_ptr():
            # the kernel reads the weight itself (torch fallback): never let it alias the buffer
            module.weight = torch.nn.Parameter(fused.clone(), requires_grad=False)
        count += len(weight_slots) + len(bias_slots)
    for module in plan.embeddings:
        dispatch_cpu_unquantized_gemm(module, remove_weight=False)
    return count


__all__ = ["DirectPlan", "NotDirect", "plan_direct_load", "run_direct_load"]
