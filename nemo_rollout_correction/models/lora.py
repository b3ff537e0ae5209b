"""Low-rank adapters (LoRA) on Megatron-Core's tensor-parallel linears: `policy.lora` (docs/training.md, "LoRA").

`apply_lora(model, config)` freezes every parameter of a policy stage and attaches one `LoraAdapter` to each
targeted `ColumnParallelLinear` / `RowParallelLinear` of the decoder layers (`linear_qkv`, `linear_proj`,
`linear_fc1`, `linear_fc2`): the linear's output becomes `W x + scale * B (A x)`, `scale = alpha / rank`. Only
the adapters require gradients, so Megatron's DDP and `get_megatron_optimizer` (distributed optimizer included)
hold buffers and Adam state for them alone.

Tensor parallelism (the sharding of Megatron-Bridge's PEFT, written anew here), so that TP=2 equals TP=1:

| base linear     | A                                   | B                                      |
|-----------------|-------------------------------------|----------------------------------------|
| column-parallel | replicated `[r, in]`                | column-sharded `[out / tp, r]` (as W)  |
| row-parallel    | row-sharded `[r, in / tp]` (as W)   | replicated `[out, r]`                  |

Column: `h = A x` is computed in full on every rank; its gradient is all-reduced over TP
(`copy_to_tensor_model_parallel_region`: identity forward, all-reduce backward), since each rank's `B` shard sees
only its slice of the output: A's gradient and the input's gradient through the adapter are then whole on every
rank. Row: `A_r x_r` is a partial sum over the rank's input slice and is all-reduced over TP
(`reduce_from_tensor_model_parallel_region`, the reduction the base's output gets) before the replicated `B`.
Replicated parameters carry `tensor_model_parallel=False`, so Megatron counts them once in the gradient norm.

Initialisation: B is zero (the adapted model starts as the base model); A is Kaiming-uniform (PEFT's choice) from
a generator seeded by (`seed`, the linear's global name), drawn in full and then sliced, so every TP layout
starts from the same A. Sequence parallelism is refused (the adapter would need the base's sequence gathers).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

MEGATRON_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
HF_TARGETS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
              "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
"""Hugging Face projection -> the Megatron linear it lives in. q/k/v share the fused `linear_qkv` and gate/up the
fused `linear_fc1`: naming one of them adapts the whole fused linear (all of q, k, v; both gate and up)."""
_ROW_PARALLEL = {"linear_proj", "linear_fc2"}
_PARENT = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp", "linear_fc2": "mlp"}


def _key(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


def _refuse(key: str, value: object, allowed: str) -> None:
    raise ValueError(f"policy.lora.{key}={value!r} is not allowed: {allowed}")


@dataclass(frozen=True)
class LoraConfig:
    """`policy.lora`: low-rank adapters on the policy's linears (rank 0: off, full fine-tuning)."""

    rank: int = _key(0, "LoRA rank r; 0 trains all weights (no adapters).")
    alpha: float = _key(16.0, "LoRA alpha: the adapter's output is scaled by alpha / rank.")
    dropout: float = _key(0.0, "Dropout on the adapter's input during training, in [0, 1).")
    target_modules: list[str] = field(default_factory=lambda: list(MEGATRON_TARGETS), metadata={"help": (
        "Linears to adapt, by Megatron name (linear_qkv, linear_proj, linear_fc1, linear_fc2) or Hugging Face name "
        "(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; q/k/v adapt the fused linear_qkv, gate/up "
        "the fused linear_fc1).")})

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            _refuse("rank", self.rank, "must be an integer >= 0 (0 turns LoRA off)")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            _refuse("alpha", self.alpha, "must be a finite number > 0")
        if not 0.0 <= self.dropout < 1.0:
            _refuse("dropout", self.dropout, "must be in [0, 1)")
        if self.enabled and not self.target_modules:
            _refuse("target_modules", self.target_modules, "name at least one linear when rank > 0")
        self.megatron_targets()  # unknown names fail here, at config time

    @property
    def enabled(self) -> bool:
        """Whether adapters are trained (rank > 0)."""
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / rank: the factor on `B A x`."""
        return self.alpha / self.rank

    def megatron_targets(self) -> tuple[str, ...]:
        """The Megatron linears `target_modules` names, in `MEGATRON_TARGETS` order; ValueError on an unknown name."""
        chosen: set[str] = set()
        for name in self.target_modules:
            if name in MEGATRON_TARGETS:
                chosen.add(name)
            elif name in HF_TARGETS:
                chosen.add(HF_TARGETS[name])
            else:
                _refuse("target_modules", name, f"allowed: Megatron names {list(MEGATRON_TARGETS)} or Hugging "
                        f"Face names {list(HF_TARGETS)}")
        return tuple(t for t in MEGATRON_TARGETS if t in chosen)


def _copy_to(x: Tensor, group: Any) -> Tensor:
    """Megatron's identity-forward, all-reduce-backward TP mapping (identity at TP = 1)."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    out: Tensor = copy_to_tensor_model_parallel_region(x, group=group)
    return out


def _reduce_from(x: Tensor, group: Any) -> Tensor:
    """Megatron's all-reduce-forward, identity-backward TP mapping (identity at TP = 1)."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    out: Tensor = reduce_from_tensor_model_parallel_region(x, group=group)
    return out


def _seeded_a(seed: int, name: str, rank: int, in_features: int) -> Tensor:
    """A `[rank, in_features]` Kaiming-uniform (a = sqrt(5), PEFT's init) from a generator seeded by (seed, name)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF)
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on fan_in = in_features
    return (torch.rand(rank, in_features, generator=gen, dtype=torch.float64) * 2 - 1).mul_(bound).float()


class LoraAdapter(nn.Module):
    """`scale * B (A x)` for one tensor-parallel linear (module docstring for the sharding).

    `a`: `[r, in]` (column base) or `[r, in / tp]` (row base); `b`: `[out / tp, r]` (column) or `[out, r]` (row).
    `forward(x)` takes the base linear's input (`[seq, batch, in]` or its TP slice) and returns a tensor shaped as
    the base's output on this rank.
    """

    def __init__(self, kind: Literal["column", "row"], a_full: Tensor, out_local: int, *, scale: float,
                 dropout: float, tp_group: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
        from megatron.core.utils import get_pg_rank, get_pg_size

        tp_rank, tp_size = int(get_pg_rank(tp_group)), int(get_pg_size(tp_group))
        self.tp_group = tp_group
        self.kind = kind
        self.scale = scale
        self.rank = int(a_full.shape[0])
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        a = a_full if kind == "column" else a_full.chunk(tp_size, dim=1)[tp_rank]
        self.a = nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
        self.b = nn.Parameter(torch.zeros(out_local, self.rank, device=device, dtype=dtype))
        sharded = self.b if kind == "column" else self.a
        set_tensor_model_parallel_attributes(sharded, True, 0 if kind == "column" else 1, 1)
        replicated = self.a if kind == "column" else self.b
        replicated.tensor_model_parallel = False  # type: ignore[attr-defined]

    def forward(self, x: Tensor) -> Tensor:
        h = torch.nn.functional.linear(self.dropout(x), self.a)
        h = _copy_to(h, self.tp_group) if self.kind == "column" else _reduce_from(h, self.tp_group)
        return torch.nn.functional.linear(h, self.b) * self.scale

    @torch.no_grad()
    def delta(self) -> Tensor:
        """`scale * B A` in this rank's layout of the base weight (`[out / tp, in]` or `[out, in / tp]`)."""
        return (self.b.float() @ self.a.float()).mul_(self.scale)


def _adapted_linears(model: nn.Module, targets: tuple[str, ...]) -> Iterator[tuple[str, str, nn.Module]]:
    """(module name, Megatron target, module) of each decoder-layer linear named in `targets`."""
    for name, module in model.named_modules():
        parts = name.split(".")
        if len(parts) == 5 and parts[0] == "decoder" and parts[1] == "layers" and parts[4] in targets \
                and parts[3] == _PARENT[parts[4]]:
            yield name, parts[4], module


def apply_lora(model: nn.Module, config: LoraConfig, *, seed: int = 1234) -> list[str]:
    """Freeze `model` (one policy stage) and attach a `LoraAdapter` to every targeted linear; returns their names.

    Call it after the base weights are loaded and before `build_policy_optimizer`. The global layer index names
    each adapter's seed, so every pipeline and TP layout draws the same A. Raises ValueError for what the adapters
    cannot cover: sequence parallelism, a Transformer Engine linear, an MoE model's expert linears.
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if not config.enabled:
        raise ValueError("apply_lora needs policy.lora.rank > 0")
    model_config: Any = getattr(model, "config", None)
    if model_config is not None and getattr(model_config, "sequence_parallel", False):
        raise ValueError("policy.lora with sequence parallelism is not supported (the adapters do not gather the "
                         "sequence); turn one of them off")
    if model_config is not None and getattr(model_config, "num_moe_experts", None):
        raise ValueError("policy.lora on an MoE model is not supported (adapters cover the dense decoder linears)")
    for param in model.parameters():
        param.requires_grad_(False)
    targets = config.megatron_targets()
    attached: list[str] = []
    for name, target, linear in list(_adapted_linears(model, targets)):
        row = target in _ROW_PARALLEL
        expected = RowParallelLinear if row else ColumnParallelLinear
        if type(linear) is not expected:
            raise ValueError(f"policy.lora: {name} is a {type(linear).__name__}, not Megatron's {expected.__name__} "
                             "(the Transformer Engine layer spec is not supported with LoRA)")
        if (not row and linear.gather_output) or (row and not linear.input_is_parallel):
            raise ValueError(f"policy.lora: {name} gathers its output or takes an unsplit input; not supported")
        from megatron.core.utils import get_pg_size

        weight: Any = linear.weight
        tp_size = int(get_pg_size(linear.tp_group))
        in_full = weight.shape[1] * (tp_size if row else 1)
        out_local = weight.shape[0]
        layer = int(linear_layer_number(model, name))
        global_name = f"decoder.layers.{layer}.{_PARENT[target]}.{target}"
        adapter = LoraAdapter("row" if row else "column", _seeded_a(seed, global_name, config.rank, in_full),
                              out_local, scale=config.scale, dropout=config.dropout, tp_group=linear.tp_group,
                              dtype=weight.dtype, device=weight.device)
        gated = target == "linear_fc1" and bool(getattr(model_config, "gated_linear_unit", False))
        _attach(linear, adapter, gated=gated)
        attached.append(name)
    if not attached:
        raise ValueError(f"policy.lora.target_modules={list(config.target_modules)} matched no linear of the model")
    return attached


def linear_layer_number(model: nn.Module, module_name: str) -> int:
    """The global (0-based) decoder layer index of `decoder.layers.<i>.…` on this pipeline stage."""
    layer: Any = model.decoder.layers[int(module_name.split(".")[2])]  # type: ignore[union-attr, index]
    return int(layer.layer_number) - 1


def _attach(linear: nn.Module, adapter: LoraAdapter, *, gated: bool = False) -> None:
    """Register `adapter` as `linear.lora` and add its output to the linear's (Megatron returns (out, bias)).

    `gated`: a SwiGLU `linear_fc1`, whose rows are each rank's `[gate_r; up_r]`: its B is checkpointed with the
    same split into gate and up as W (Megatron's `MLP.sharded_state_dict` does it for W and the bias only)."""
    linear.lora = adapter
    original = linear.forward

    def forward(input_: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        out, bias = original(input_, *args, **kwargs)
        return out + adapter(input_), bias

    linear.forward = forward

    # Checkpoints: Megatron's linear marks only `weight` (and a column bias) as TP-sharded and would save every
    # other entry of its state dict, the adapters included, as replicated: one TP rank's B (column) or A (row)
    # shard would stand for all. The adapter's sharded tensor is declared along W's TP axis.
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    axes = {"weight": 1, "lora.a": 1} if adapter.kind == "row" else {"weight": 0, "bias": 0, "lora.b": 0}

    def sharded_state_dict(prefix: str = "", sharded_offsets: Any = (), metadata: Any = None) -> Any:
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        state = linear.state_dict(prefix="", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets, tp_group=linear.tp_group,
                                                  dp_cp_group=(metadata or {}).get("dp_cp_group"))
        if gated:
            out[f"{prefix}lora.b"] = apply_swiglu_sharded_factory(
                out[f"{prefix}lora.b"], sharded_offsets, (metadata or {}).get("singleton_local_shards", False))
        return out

    linear.sharded_state_dict = sharded_state_dict  # type: ignore[assignment]


def adapter_of(model: nn.Module, param_name: str) -> LoraAdapter | None:
    """The adapter attached to the linear owning weight `param_name` (`….linear_qkv.weight`), else None."""
    if not param_name.endswith(".weight"):
        return None
    owner = model.get_submodule(param_name.removesuffix(".weight"))
    adapter = getattr(owner, "lora", None)
    return adapter if isinstance(adapter, LoraAdapter) else None


def is_adapter_param(name: str) -> bool:
    """Whether the parameter `name` belongs to a LoRA adapter (`….lora.a`, `….lora.b`)."""
    return ".lora." in name


def adapters(model: nn.Module) -> Iterator[tuple[str, LoraAdapter]]:
    """(linear name, adapter) of every adapter attached to `model`."""
    for name, module in model.named_modules():
        if isinstance(module, LoraAdapter):
            yield name.removesuffix(".lora"), module


def has_lora(model: nn.Module) -> bool:
    """Whether any adapter is attached."""
    return any(True for _ in adapters(model))


__all__ = ["HF_TARGETS", "MEGATRON_TARGETS", "LoraAdapter", "LoraConfig", "adapter_of", "adapters", "apply_lora",
           "has_lora", "is_adapter_param", "linear_layer_number"]
