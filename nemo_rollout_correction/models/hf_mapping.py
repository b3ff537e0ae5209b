"""One declarative HF <-> Megatron-Core parameter table per architecture family, and the code it drives.

A `ParamMapping` row says: this Megatron parameter (a name, per decoder layer or global) is made of these
Hugging Face tensors, packed this way, and tensor parallelism splits it along this dimension. Loading
(`load_hf_weights`), export (`iter_hf_weights`, the refit payload) and the expected-name check
(`expected_hf_names`) are all derived from the rows of `mappings(arch)`; nothing else knows a name.

| Megatron name (per layer `L`)                      | Hugging Face name(s)                          | TP | pack    |
|----------------------------------------------------|-----------------------------------------------|----|---------|
| embedding.word_embeddings.weight `[V, H]`          | model.embed_tokens.weight                     | 0  | copy    |
| decoder.layers.L.input_layernorm.weight            | model.layers.L.input_layernorm.weight         | -  | copy    |
| decoder.layers.L.self_attention.linear_qkv.weight  | q_proj, k_proj, v_proj (`.weight`)            | 0  | qkv     |
| decoder.layers.L.self_attention.linear_qkv.bias    | q_proj, k_proj, v_proj (`.bias`; Qwen2)       | 0  | qkv     |
| decoder.layers.L.self_attention.q_layernorm.weight | self_attn.q_norm.weight (Qwen3)               | -  | copy    |
| decoder.layers.L.self_attention.k_layernorm.weight | self_attn.k_norm.weight (Qwen3)               | -  | copy    |
| decoder.layers.L.self_attention.linear_proj.weight | self_attn.o_proj.weight                       | 1  | copy    |
| decoder.layers.L.pre_mlp_layernorm.weight          | post_attention_layernorm.weight               | -  | copy    |
| decoder.layers.L.mlp.linear_fc1.weight             | mlp.gate_proj, mlp.up_proj (`.weight`)        | 0  | gate_up |
| decoder.layers.L.mlp.linear_fc2.weight             | mlp.down_proj.weight                          | 1  | copy    |
| decoder.final_layernorm.weight                     | model.norm.weight                             | -  | copy    |
| output_layer.weight (absent when tied)             | lm_head.weight                                | 0  | copy    |

Packing: `qkv` groups Megatron's fused QKV per KV head (for each KV head `g`: its `n_heads / n_kv` query
heads, its key head, its value head, `head_dim` rows each), so TP splits whole groups; `gate_up` stores each
rank's `[gate_r; up_r]`. Megatron's RoPE with `rotary_interleaved=False` is HF's `rotate_half` convention,
so q/k rows are copied without permutation. With the Transformer Engine spec the two per-layer norms live
inside the next linear layer (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`): the same rows
apply under those names (`TE_ALIASES`).

Reading: `SafetensorsCheckpoint` opens the checkpoint's safetensors files lazily (`safe_open`) and every row
reads only this rank's slice of each HF tensor (`get_slice`), so a rank never materialises the whole state
dict. A plain `Mapping[str, Tensor]` works too (tests, in-memory state dicts).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from nemo_rollout_correction.distributed.tensor_gather import gather_along_dim, group_size
from nemo_rollout_correction.models.hf_config import ModelArch
from nemo_rollout_correction.models.lora import adapter_of, is_adapter_param

PACKS = ("copy", "qkv", "gate_up")


@dataclass(frozen=True)
class ParamMapping:
    """One Megatron parameter and the Hugging Face tensors it is made of.

    `megatron` is the suffix after `decoder.layers.<L>.` when `per_layer`, else the full name; `hf` the HF
    names, with `{L}` standing for the global layer index. `tp_dim` is Megatron's tensor-parallel split
    dimension (None: replicated). `pack` is how several HF tensors form one Megatron tensor (`PACKS`).
    """

    megatron: str
    hf: tuple[str, ...]
    tp_dim: int | None
    pack: str = "copy"
    per_layer: bool = True

    def hf_names(self, layer: int | None) -> tuple[str, ...]:
        """The HF names of this row for the global layer index `layer` (None for global rows)."""
        return tuple(name.replace("{L}", str(layer)) for name in self.hf)


def _row(megatron: str, *hf: str, tp_dim: int | None = None, pack: str = "copy") -> ParamMapping:
    return ParamMapping(megatron, tuple(f"model.layers.{{L}}.{name}" for name in hf), tp_dim, pack)


def mappings(arch: ModelArch) -> tuple[ParamMapping, ...]:
    """The parameter table of `arch`'s family (rows present for this config only: biases, q/k norms, lm_head)."""
    rows = [
        ParamMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), 0, per_layer=False),
        ParamMapping("decoder.final_layernorm.weight", ("model.norm.weight",), None, per_layer=False),
        _row("input_layernorm.weight", "input_layernorm.weight"),
        _row("self_attention.linear_qkv.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
             "self_attn.v_proj.weight", tp_dim=0, pack="qkv"),
        _row("self_attention.linear_proj.weight", "self_attn.o_proj.weight", tp_dim=1),
        _row("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    ]
    if arch.is_moe:
        # Megatron's MoE layer (local spec, `SequentialMLP`): a replicated router and one gated MLP per expert.
        # Expert parallelism is 1 (checked in `hf_llama.transformer_config`), so local expert e is global expert e.
        # HF names: Qwen3-MoE `mlp.gate` + `mlp.experts.E.{gate,up,down}_proj`; Mixtral `block_sparse_moe.gate` +
        # `block_sparse_moe.experts.E.{w1,w3,w2}` (w1 = gate, w3 = up, w2 = down).
        moe, (gate, up, down) = (("block_sparse_moe", ("w1", "w3", "w2")) if arch.family == "mixtral" else
                                 ("mlp", ("gate_proj", "up_proj", "down_proj")))
        rows.append(_row("mlp.router.weight", f"{moe}.gate.weight"))
        for e in range(arch.num_experts):
            experts = f"{moe}.experts.{e}"
            rows += [_row(f"mlp.experts.local_experts.{e}.linear_fc1.weight", f"{experts}.{gate}.weight",
                          f"{experts}.{up}.weight", tp_dim=0, pack="gate_up"),
                     _row(f"mlp.experts.local_experts.{e}.linear_fc2.weight", f"{experts}.{down}.weight", tp_dim=1)]
    else:
        rows += [_row("mlp.linear_fc1.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", tp_dim=0, pack="gate_up"),
                 _row("mlp.linear_fc2.weight", "mlp.down_proj.weight", tp_dim=1)]
    if not arch.tie_word_embeddings:
        rows.append(ParamMapping("output_layer.weight", ("lm_head.weight",), 0, per_layer=False))
    if arch.qkv_bias:
        rows.append(_row("self_attention.linear_qkv.bias", "self_attn.q_proj.bias", "self_attn.k_proj.bias",
                         "self_attn.v_proj.bias", tp_dim=0, pack="qkv"))
    if arch.qk_norm:
        rows += [_row("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
                 _row("self_attention.k_layernorm.weight", "self_attn.k_norm.weight")]
    return tuple(rows)


# Transformer Engine spec names of the two per-layer norms -> their local-spec names.
TE_ALIASES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
              "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@functools.lru_cache(maxsize=8)
def _rows_by_name(arch: ModelArch) -> dict[tuple[bool, str], ParamMapping]:
    return {(row.per_layer, row.megatron): row for row in mappings(arch)}


def _lookup(arch: ModelArch, name: str, model: nn.Module) -> tuple[ParamMapping, int | None]:
    """The table row of Megatron parameter `name` and its global layer index (None for global rows)."""
    match = _LAYER.match(name)
    if match is None:
        if name == "output_layer.weight" and arch.tie_word_embeddings:  # last stage's copy of a tied embedding
            return ParamMapping(name, ("model.embed_tokens.weight",), 0, per_layer=False), None
        row = _rows_by_name(arch).get((False, name))
        layer = None
    else:
        row = _rows_by_name(arch).get((True, TE_ALIASES.get(match.group(2), match.group(2))))
        layer_module: Any = model.decoder.layers[int(match.group(1))]  # type: ignore[union-attr, index]
        layer = int(layer_module.layer_number) - 1  # pipeline stages offset local indices
    if row is None:
        raise KeyError(f"no Hugging Face mapping for Megatron parameter {name!r} ({arch.architecture})")
    return row, layer


# --- reading ----------------------------------------------------------------------------------------

class TensorSource(Protocol):
    """Where HF tensors come from: a name check and a read of one TP part."""

    def __contains__(self, name: object) -> bool: ...

    def read(self, name: str, dim: int | None = None, part: int = 0, parts: int = 1) -> Tensor:
        """Tensor `name`, or only its `part`-th of `parts` equal chunks along `dim` when `dim` is given."""
        ...


def _chunk_bounds(size: int, name: str, dim: int, part: int, parts: int) -> tuple[int, int]:
    if size % parts:
        raise ValueError(f"{name}: dimension {dim} of size {size} does not split into {parts} equal parts")
    step = size // parts
    return part * step, (part + 1) * step


class MappingSource:
    """A `TensorSource` over an in-memory state dict."""

    def __init__(self, tensors: Mapping[str, Tensor]) -> None:
        self.tensors = tensors

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def read(self, name: str, dim: int | None = None, part: int = 0, parts: int = 1) -> Tensor:
        """See `TensorSource.read`."""
        tensor = self.tensors[name]
        if dim is None:
            return tensor
        start, stop = _chunk_bounds(tensor.shape[dim], name, dim, part, parts)
        return tensor.narrow(dim, start, stop - start)


class SafetensorsCheckpoint:
    """A `TensorSource` over a checkpoint directory's safetensors files, reading slices with `get_slice`.

    Use as a context manager (it keeps the files open, memory-mapped, while loading).
    """

    def __init__(self, hf_dir: str | Path) -> None:
        self.hf_dir = Path(hf_dir)
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}
        self._file_of: dict[str, str] = {}
        index = self.hf_dir / "model.safetensors.index.json"
        if index.is_file():
            self._file_of = dict(json.loads(index.read_text())["weight_map"])
        else:
            files = sorted(self.hf_dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {self.hf_dir}")
            for file in files:
                for name in self._open(file.name).keys():  # noqa: SIM118 (safe_open has no __iter__)
                    self._file_of[name] = file.name

    def _open(self, file: str) -> Any:
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = self._stack.enter_context(safe_open(str(self.hf_dir / file), framework="pt",
                                                                      device="cpu"))
        return self._handles[file]

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def __contains__(self, name: object) -> bool:
        return name in self._file_of

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return sorted(self._file_of)

    def read(self, name: str, dim: int | None = None, part: int = 0, parts: int = 1) -> Tensor:
        """See `TensorSource.read`: only the requested chunk is read from disk."""
        if name not in self._file_of:
            raise KeyError(f"tensor {name!r} not found in {self.hf_dir}")
        handle = self._open(self._file_of[name])
        if dim is None:
            return handle.get_tensor(name)  # type: ignore[no-any-return]
        view = handle.get_slice(name)
        start, stop = _chunk_bounds(int(view.get_shape()[dim]), name, dim, part, parts)
        return view[(slice(None),) * dim + (slice(start, stop),)]  # type: ignore[no-any-return]


def _read_rows(source: TensorSource, row: ParamMapping, layer: int | None, arch: ModelArch, tp_rank: int,
               tp: int) -> Tensor:
    """This TP rank's shard of the Megatron tensor of `row`, reading only the HF chunks it needs.

    Every pack shards as "chunk `tp_rank` of `tp` of each HF tensor along the TP dim, then pack": q heads
    are stored group by group, so a chunk of q, k and v holds the same whole KV groups.
    """
    names = row.hf_names(layer)
    if row.tp_dim is None:
        return source.read(names[0])
    chunks = [source.read(name, row.tp_dim, tp_rank, tp) for name in names]
    if row.pack == "qkv":
        q, k, v = chunks
        return pack_qkv(q, k, v, arch.num_key_value_heads // tp, arch.heads_per_group, arch.head_dim)
    if row.pack == "gate_up":
        return torch.cat(chunks, dim=0)
    return chunks[0]


def pack_qkv(q: Tensor, k: Tensor, v: Tensor, groups: int, per: int, head_dim: int) -> Tensor:
    """Megatron's grouped QKV `[groups * (per + 2) * head_dim, ...]` from HF's q/k/v rows of `groups` KV heads."""
    rest = q.shape[1:]
    grouped = [q.reshape(groups, per * head_dim, *rest), k.reshape(groups, head_dim, *rest),
               v.reshape(groups, head_dim, *rest)]
    return torch.cat(grouped, dim=1).reshape(groups * (per + 2) * head_dim, *rest)


def unpack_qkv(qkv: Tensor, groups: int, per: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `pack_qkv`: HF's (q, k, v) rows from Megatron's grouped QKV of `groups` KV heads."""
    rest = qkv.shape[1:]
    q, k, v = torch.split(qkv.reshape(groups, (per + 2) * head_dim, *rest), [per * head_dim, head_dim, head_dim],
                          dim=1)
    return (q.reshape(groups * per * head_dim, *rest).contiguous(), k.reshape(groups * head_dim, *rest).contiguous(),
            v.reshape(groups * head_dim, *rest).contiguous())


def fused_qkv(q: Tensor, k: Tensor, v: Tensor, arch: ModelArch) -> Tensor:
    """Megatron's grouped QKV from HF's full q/k/v (weights or biases)."""
    return pack_qkv(q, k, v, arch.num_key_value_heads, arch.heads_per_group, arch.head_dim)


def split_qkv(qkv: Tensor, arch: ModelArch) -> tuple[Tensor, Tensor, Tensor]:
    """HF's (q, k, v) from Megatron's full (unsharded) grouped QKV."""
    return unpack_qkv(qkv, arch.num_key_value_heads, arch.heads_per_group, arch.head_dim)


@torch.no_grad()
def load_hf_weights(model: nn.Module, hf: TensorSource | Mapping[str, Tensor], arch: ModelArch, *,
                    tp_rank: int = 0, tp: int = 1) -> None:
    """Copy the HF weights `hf` into the (TP-sharded, possibly pipeline-staged) Megatron `model`.

    Every parameter of `model` is written from its table row, reading only this rank's slices; a parameter
    without a row or a missing HF tensor raises KeyError naming it, a shape mismatch ValueError naming the
    parameter and both shapes.
    """
    source: TensorSource = MappingSource(hf) if isinstance(hf, Mapping) else hf
    for name, param in model.named_parameters():
        if is_adapter_param(name):
            continue  # LoRA adapters (models/lora.py) are no Hugging Face weight
        row, layer = _lookup(arch, name, model)
        missing = [n for n in row.hf_names(layer) if n not in source]
        if missing:
            raise KeyError(f"{name}: Hugging Face tensor(s) {missing} missing from the checkpoint")
        value = _read_rows(source, row, layer, arch, tp_rank, tp)
        if value.shape != param.shape:
            raise ValueError(f"{name}: converted shape {tuple(value.shape)} != parameter shape {tuple(param.shape)}")
        param.copy_(value.to(param.dtype))


def _gather_full(param: Tensor, tp_group: Any) -> Tensor:
    """The unsharded value of a Megatron parameter (all-gather over TP when it is TP-sharded)."""
    if not getattr(param, "tensor_model_parallel", False) or group_size(tp_group) == 1:
        return param.detach()
    return gather_along_dim(param.detach(), int(param.partition_dim), tp_group)  # type: ignore[attr-defined]


def _unpack(row: ParamMapping, layer: int | None, full: Tensor, arch: ModelArch, tp: int) -> list[tuple[str, Tensor]]:
    names = row.hf_names(layer)
    if row.pack == "qkv":
        return list(zip(names, split_qkv(full, arch), strict=True))
    if row.pack == "gate_up":
        # gathered as [gate_0; up_0; gate_1; up_1; ...]: undo the per-rank interleave
        halves = [chunk.chunk(2, dim=0) for chunk in full.chunk(tp, dim=0)]
        return [(names[0], torch.cat([h[0] for h in halves], dim=0)), (names[1], torch.cat([h[1] for h in halves]))]
    return [(names[0], full)]


@torch.no_grad()
def iter_hf_weights(model: nn.Module, arch: ModelArch, *, tp_group: Any = None,
                    dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """Hugging Face (name, full tensor) pairs of this pipeline stage's parameters, TP shards gathered.

    Every TP rank must iterate (the gathers are collectives); all ranks get the same tensors. Used to
    refit the rollout engine after an optimizer step and to export a Hugging Face checkpoint. Tied
    models yield no `lm_head.weight` (vLLM and transformers tie it themselves). A linear with a LoRA adapter
    (models/lora.py) yields its merged weight `W + scale * B A` (each rank merges its own shard, then the shards
    are gathered as W's); the adapters themselves are not yielded.
    """
    tp = group_size(tp_group)
    for name, param in model.named_parameters():
        if name == "output_layer.weight" and arch.tie_word_embeddings:
            continue  # the last pipeline stage's copy of a tied embedding: the first stage exports it
        if is_adapter_param(name):
            continue
        row, layer = _lookup(arch, name, model)
        value: Tensor = param
        adapter = adapter_of(model, name)
        if adapter is not None:
            value = (param.detach().float() + adapter.delta()).to(param.dtype)
            for attr in ("tensor_model_parallel", "partition_dim"):  # sharded as W (`_gather_full` reads them)
                setattr(value, attr, getattr(param, attr, None))
        full = _gather_full(value, tp_group)
        if dtype is not None:
            full = full.to(dtype)
        yield from _unpack(row, layer, full, arch, tp)


def hf_tensors_of(model: nn.Module, arch: ModelArch, name: str, full: Tensor, tp: int) -> list[tuple[str, Tensor]]:
    """The Hugging Face (name, tensor) pairs of Megatron parameter `name` from its TP-gathered value `full` (the
    table row's unpacking: q/k/v split, the per-rank [gate; up] undone). Any trailing dimensions: a LoRA `B`
    (`[out, r]` in the weight's row layout) unpacks as its weight does."""
    row, layer = _lookup(arch, name, model)
    return _unpack(row, layer, full, arch, tp)


def expected_hf_names(arch: ModelArch) -> set[str]:
    """Every tensor name a full (all stages) export of `arch` yields."""
    names: set[str] = set()
    for row in mappings(arch):
        for layer in range(arch.num_layers) if row.per_layer else (None,):
            names.update(row.hf_names(layer))
    return names


__all__ = [
    "PACKS",
    "TE_ALIASES",
    "MappingSource",
    "ParamMapping",
    "SafetensorsCheckpoint",
    "TensorSource",
    "expected_hf_names",
    "fused_qkv",
    "hf_tensors_of",
    "iter_hf_weights",
    "load_hf_weights",
    "mappings",
    "pack_qkv",
    "split_qkv",
    "unpack_qkv",
]
