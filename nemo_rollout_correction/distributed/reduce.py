"""Fused collectives over `Partials`: one SUM all-reduce (plus at most one MAX) per reduction.

A step's metric partials are dozens of scalars and a few histogram vectors. Reducing them one
collective at a time costs dozens of latencies; here they travel together:

- every SUM entry (scalars and `[num_bins]` histograms) is flattened, in a fixed key order, into
  ONE float64 vector reduced with ONE SUM all-reduce;
- every MAX entry and every MIN entry (negated, so it becomes a MAX) form a second, short vector.
  It either rides inside the SUM all-reduce in per-rank slots (`extremes="slots"`: each rank writes
  its extremes into its own slot and zeros elsewhere; the SUM then delivers every rank's values
  unchanged, since x + 0 = x exactly, and the max / min is taken locally) or takes one MAX
  all-reduce of its own (`extremes="max"`). `"auto"` uses slots while they at most double the
  payload, so a metric reduction is ONE collective at the sizes that matter and two beyond.

The key order and shapes come from a `PartialsSchema` that every rank derives from the config
alone, never from its data: a rank whose data produced no value for some entry (no valid token,
no sequence it owns, no microbatch at all) contributes the identity (0 for SUM, -inf for MAX,
+inf for MIN), so the flattened vectors line up on every rank and the collectives cannot deadlock
on mismatched sizes.

Also here: the flat all-gather that the context-parallel sequence reduction uses. Every
collective takes an explicit group; none runs over the default (WORLD) group.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from nemo_rollout_correction.core.stats import Partials
from nemo_rollout_correction.distributed.tensor_gather import collective_device

ExtremesMode = Literal["auto", "slots", "max"]
EXTREMES_MODES: tuple[str, ...] = get_args(ExtremesMode)

__all__ = [
    "EXTREMES_MODES",
    "ExtremesMode",
    "PartialsSchema",
    "all_gather_flat",
    "all_reduce_partials",
    "partials_device",
    "use_slots",
]


@dataclass(frozen=True)
class PartialsSchema:
    """The names, kinds and shapes of a set of partials, in the fixed order they travel in.

    sums: `(name, shape)` pairs (`()` for scalars, `(num_bins,)` for histograms), sorted by name.
    maxs, mins: names of the MAX and MIN entries (scalars), sorted.
    """

    sums: tuple[tuple[str, tuple[int, ...]], ...]
    maxs: tuple[str, ...]
    mins: tuple[str, ...]

    @classmethod
    def of(cls, partials: Partials) -> PartialsSchema:
        """The schema of `partials` (keys sorted; MAX / MIN entries must be scalars)."""
        for kind, table in (("MAX", partials.maxs), ("MIN", partials.mins)):
            for name, value in table.items():
                if value.dim() != 0:
                    raise ValueError(f"{kind} partial {name!r} has shape {tuple(value.shape)}; only scalars "
                                     "can be fused (per-sequence vectors are reduced over CP, not dp x cp)")
        return cls(
            sums=tuple(sorted((name, tuple(value.shape)) for name, value in partials.sums.items())),
            maxs=tuple(sorted(partials.maxs)),
            mins=tuple(sorted(partials.mins)),
        )

    def union(self, other: PartialsSchema) -> PartialsSchema:
        """Both schemas' entries (a name in both must have the same shape)."""
        sums = dict(self.sums)
        for name, shape in other.sums:
            if sums.setdefault(name, shape) != shape:
                raise ValueError(f"SUM partial {name!r} has shapes {sums[name]} and {shape}")
        return PartialsSchema(tuple(sorted(sums.items())), tuple(sorted({*self.maxs, *other.maxs})),
                              tuple(sorted({*self.mins, *other.mins})))

    @property
    def num_sum_elements(self) -> int:
        """Length of the flattened SUM vector."""
        total = 0
        for _, shape in self.sums:
            size = 1
            for dim in shape:
                size *= dim
            total += size
        return total

    @property
    def num_extremes(self) -> int:
        """Number of MAX plus MIN entries."""
        return len(self.maxs) + len(self.mins)

    def check(self, partials: Partials) -> None:
        """Raise RuntimeError if `partials` has an entry the schema lacks or a different shape.

        Such an entry would make ranks flatten different layouts (a silent mis-reduction or a
        deadlock), so it is an internal error, not something to reduce anyway.
        """
        shapes = dict(self.sums)
        for name, value in partials.sums.items():
            if name not in shapes:
                raise RuntimeError(f"SUM partial {name!r} is not in the reduction schema {sorted(shapes)}")
            if tuple(value.shape) != shapes[name]:
                raise RuntimeError(f"SUM partial {name!r} has shape {tuple(value.shape)}, schema says "
                                   f"{shapes[name]}")
        for kind, table, names in (("MAX", partials.maxs, self.maxs), ("MIN", partials.mins, self.mins)):
            for name, value in table.items():
                if name not in names or value.dim() != 0:
                    raise RuntimeError(f"{kind} partial {name!r} (shape {tuple(value.shape)}) is not a scalar "
                                       f"of the reduction schema {list(names)}")

    def flatten_sums(self, partials: Partials, out: Tensor) -> None:
        """Write the SUM entries into `out[:num_sum_elements]` (absent entries as 0)."""
        offset = 0
        for name, shape in self.sums:
            size = _numel(shape)
            value = partials.sums.get(name)
            if value is None:
                out[offset:offset + size] = 0.0
            else:
                out[offset:offset + size] = value.reshape(-1)
            offset += size

    def flatten_extremes(self, partials: Partials, out: Tensor, *, negate_mins: bool) -> None:
        """Write MAX entries then MIN entries into `out[:num_extremes]` (absent: -inf / +inf)."""
        for i, name in enumerate(self.maxs):
            value = partials.maxs.get(name)
            out[i] = float("-inf") if value is None else value
        base = len(self.maxs)
        for i, name in enumerate(self.mins):
            value = partials.mins.get(name)
            filled = float("inf") if value is None else value
            out[base + i] = -filled if negate_mins else filled

    def unflatten(self, sums: Tensor, maxs: Tensor, mins: Tensor) -> Partials:
        """Partials whose entries are views of the reduced vectors."""
        out = Partials()
        offset = 0
        for name, shape in self.sums:
            size = _numel(shape)
            out.sums[name] = sums[offset:offset + size].reshape(shape)
            offset += size
        out.maxs = {name: maxs[i] for i, name in enumerate(self.maxs)}
        out.mins = {name: mins[i] for i, name in enumerate(self.mins)}
        return out


def _numel(shape: Iterable[int]) -> int:
    size = 1
    for dim in shape:
        size *= dim
    return size


def use_slots(schema: PartialsSchema, group_size: int, extremes: ExtremesMode) -> bool:
    """Whether the extremes ride in per-rank slots of the SUM all-reduce."""
    if extremes not in EXTREMES_MODES:
        raise ValueError(f"extremes must be one of {list(EXTREMES_MODES)}, got {extremes!r}")
    if schema.num_extremes == 0 or extremes == "max":
        return False
    if extremes == "slots":
        return True
    return group_size * schema.num_extremes <= max(schema.num_sum_elements, 4096)


def all_reduce_partials(
    partials: Partials,
    schema: PartialsSchema,
    *,
    group: ProcessGroup | None,
    group_size: int,
    group_rank: int,
    extremes: ExtremesMode = "auto",
    device: torch.device | None = None,
) -> Partials:
    """SUM / MAX / MIN-reduce `partials` over `group` in one or two collectives (see the module doc).

    partials: this rank's partials; every entry must be in `schema` (absent ones count as the
        identity). Every rank of `group` must pass the same schema and `extremes`.
    group_rank: this rank's index in `group` (selects its slot).
    device: where the flat buffers live; None = the partials' device, or for a rank without any
        partial the current CUDA device under NCCL and the CPU otherwise.
    Returns new Partials (float64) holding the group-wide values, identical on every rank; the
    input is not modified. With `group_size == 1` nothing is communicated.
    """
    schema.check(partials)
    device = device or partials_device(group, partials)
    num_sums, num_ext = schema.num_sum_elements, schema.num_extremes
    slots = group_size > 1 and use_slots(schema, group_size, extremes)
    length = num_sums + (group_size * num_ext if slots else 0)
    buffer = torch.zeros(length, dtype=torch.float64, device=device)
    schema.flatten_sums(partials, buffer)
    if group_size == 1:
        ext = torch.empty(num_ext, dtype=torch.float64, device=device)
        schema.flatten_extremes(partials, ext, negate_mins=False)
        return schema.unflatten(buffer, ext[:len(schema.maxs)], ext[len(schema.maxs):])
    if group is None:
        raise ValueError(f"a process group is needed to reduce over {group_size} ranks")
    if slots:
        start = num_sums + group_rank * num_ext
        schema.flatten_extremes(partials, buffer[start:start + num_ext], negate_mins=False)
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
        table = buffer[num_sums:].view(group_size, num_ext)
        n_max = len(schema.maxs)
        maxs = table[:, :n_max].amax(dim=0) if n_max else table.new_empty(0)
        mins = table[:, n_max:].amin(dim=0) if num_ext > n_max else table.new_empty(0)
        return schema.unflatten(buffer[:num_sums], maxs, mins)
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
    ext = torch.empty(num_ext, dtype=torch.float64, device=device)
    if num_ext:
        schema.flatten_extremes(partials, ext, negate_mins=True)
        dist.all_reduce(ext, op=dist.ReduceOp.MAX, group=group)
    n_max = len(schema.maxs)
    return schema.unflatten(buffer, ext[:n_max], -ext[n_max:])


def partials_device(group: ProcessGroup | None, partials: Partials) -> torch.device:
    """The device of `partials`, or where a rank with no partials must put its buffers."""
    for table in (partials.sums, partials.maxs, partials.mins):
        for value in table.values():
            return value.device
    return collective_device(group)


def all_gather_flat(local: Tensor, *, group: ProcessGroup | None, group_size: int) -> Tensor:
    """All-gather a tensor from every rank of `group`: returns `[group_size, *local.shape]`.

    Every rank must pass the same shape and dtype. One collective (`all_gather_single` where
    torch has it, else `all_gather_into_tensor`), none with `group_size == 1`.
    """
    if group_size == 1:
        return local.unsqueeze(0)
    if group is None:
        raise ValueError(f"a process group is needed to gather over {group_size} ranks")
    flat = local.contiguous().reshape(-1)
    out = torch.empty(group_size * flat.numel(), dtype=flat.dtype, device=flat.device)
    if flat.numel() == 0:  # same shape on every rank: all skip together
        return out.view(group_size, *local.shape)
    gather = getattr(dist, "all_gather_single", None)  # looked up per call: torch >= 2.10 name
    if gather is None:
        gather = dist.all_gather_into_tensor
    gather(out, flat, group=group)
    return out.view(group_size, *local.shape)
