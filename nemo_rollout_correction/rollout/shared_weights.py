"""The CPU refit's transport: the policy weights in one memory-mapped buffer shared with vLLM's workers.

The trainer process (which owns `VllmRolloutEngine`) and vLLM's worker processes (the engine core, and the
tensor-parallel workers) all map the same file on the node's shared memory (`/dev/shm`): the trainer copies
each new weight tensor into its slot, already cast to the engine's dtype, and every worker feeds views of the
slots to vLLM's `reload_weights`. Nothing is serialised or parsed: the per-step cost is one cast-and-copy on
the trainer side and vLLM's own loaders on the worker side. The buffer is created once (again only when the
set of tensors changes) and the file is unlinked as soon as every worker has mapped it, so nothing is left on
`/dev/shm` when a process dies.

Torch's shared-memory storages (`share_memory_()`) would need a pickled handle per storage through vLLM's RPC,
which carries msgpack; a named file mapped with `torch.from_file(shared=True)` needs just its path.

`checksum` is the refit verification's fingerprint of a tensor: an exact integer sum over its raw bits
(position-weighted), so the trainer and the engine get the same number whatever the reduction order.

Imported by vLLM's worker processes: keep it free of the trainer (torch only).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

_COPY_CHUNK = 16384  # elements: below torch's internal parallel grain size (32768), so copies stay single-threaded
_ALIGN = 64  # bytes: every slot starts on a cache line (and at any dtype's alignment)
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# The position weights cycle with this prime period, so swapped elements change the sum; small enough that
# 32-bit patterns x weight summed over millions of elements stay far inside int64.
_WEIGHT_PERIOD = 251


@dataclass(frozen=True)
class TensorSlot:
    """Where one named tensor lives in the buffer: `numel(shape) * itemsize(dtype)` bytes at `offset`."""

    name: str
    dtype: str
    """torch dtype name without the `torch.` prefix (`"bfloat16"`)."""
    shape: tuple[int, ...]
    offset: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)  # type: ignore[no-any-return]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.torch_dtype.itemsize

    def to_wire(self) -> list[object]:
        """A msgpack-friendly form (vLLM's RPC arguments)."""
        return [self.name, self.dtype, list(self.shape), self.offset]

    @classmethod
    def from_wire(cls, wire: Sequence[object]) -> TensorSlot:
        name, dtype, shape, offset = wire
        return cls(str(name), str(dtype), tuple(int(s) for s in shape), int(offset))  # type: ignore[attr-defined, call-overload]


# Projections vLLM fuses into one GEMM (q/k/v -> qkv_proj, gate/up -> gate_up_proj), in its fused order: laid
# out back to back, a fused weight is a view of the buffer (`stacked_view`), not a `torch.cat`.
_FUSED_ORDER = {"q_proj": "0", "k_proj": "1", "v_proj": "2", "gate_proj": "0", "up_proj": "1"}
_SCALES_LAST = "~scales"  # sorts after every module name: an int8 block's scales after all its weights


def _layout_key(name: str) -> tuple[str, ...]:
    parts = name.split(".")
    key = tuple(_FUSED_ORDER.get(part, part) for part in parts)
    if len(parts) >= 2 and parts[-1] == "weight_scale":
        # int8 (`rollout/int8.py`): `q_proj.weight_scale` would sit between `q_proj.weight` and `k_proj.weight`;
        # moved behind the block's weights, the int8 codes of q/k/v (gate/up) lie back to back as well
        key = (*key[:-2], _SCALES_LAST, key[-2])
    return key


def plan_slots(tensors: Mapping[str, Tensor], dtype: torch.dtype) -> tuple[list[TensorSlot], int]:
    """The slots of `tensors` (floating ones stored as `dtype`, the engine's), and the buffer's size in bytes.

    Ordered by name with the fused projections in vLLM's fused order (`_FUSED_ORDER`), whatever the order of
    `tensors`: a layout depends only on the set of tensors, their shapes and dtypes."""
    slots: list[TensorSlot] = []
    offset = 0
    for name in sorted(tensors, key=_layout_key):
        tensor = tensors[name]
        stored = dtype if tensor.is_floating_point() else tensor.dtype
        slot = TensorSlot(name, str(stored).removeprefix("torch."), tuple(tensor.shape), offset)
        slots.append(slot)
        offset += -(-slot.nbytes // _ALIGN) * _ALIGN
    return slots, max(offset, _ALIGN)


def map_file(path: str, nbytes: int) -> Tensor:
    """The `[nbytes]` uint8 tensor backed by the shared mapping of the file `path` (writes reach every mapper)."""
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def slot_view(buffer: Tensor, slot: TensorSlot) -> Tensor:
    """The tensor of `slot` inside `buffer` (a view: no copy)."""
    return buffer[slot.offset: slot.offset + slot.nbytes].view(slot.torch_dtype).view(slot.shape)


def stacked_view(buffer: Tensor, slots: Sequence[TensorSlot]) -> Tensor:
    """The 2-D slots stacked along dim 0 ([sum of rows, cols]): a view of `buffer` when they lie back to back,
    else a new tensor (`torch.cat`)."""
    first = slots[0]
    adjacent = all(prev.offset + prev.nbytes == nxt.offset for prev, nxt in itertools.pairwise(slots))
    if adjacent:
        rows = sum(s.shape[0] for s in slots)
        nbytes = rows * first.shape[1] * first.torch_dtype.itemsize
        return buffer[first.offset: first.offset + nbytes].view(first.torch_dtype).view(rows, first.shape[1])
    return torch.cat([slot_view(buffer, s) for s in slots], dim=0)


def iter_views(buffer: Tensor, slots: Sequence[TensorSlot]) -> Iterator[tuple[str, Tensor]]:
    """(name, view) of every slot, in order."""
    for slot in slots:
        yield slot.name, slot_view(buffer, slot)


class SharedWeightsBuffer:
    """The trainer side: owns the shared file's mapping and writes new weights into it."""

    def __init__(self, slots: list[TensorSlot], nbytes: int, directory: str) -> None:
        self.slots = slots
        self.nbytes = nbytes
        self.path: str | None = os.path.join(directory, f"nrc_refit_{os.getpid()}_{uuid.uuid4().hex[:12]}.bin")
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        try:
            self.buffer = map_file(self.path, nbytes)
        except Exception:
            self.unlink()
            raise
        self._by_name = {slot.name: slot for slot in slots}
        self._chunks: dict[str, list[Tensor]] = {}  # each slot's copy chunks (views of the buffer), made once

    def matches(self, tensors: Mapping[str, Tensor], dtype: torch.dtype) -> bool:
        """Whether `tensors` fit this buffer's slots exactly (same names, order, shapes and stored dtypes)."""
        return plan_slots(tensors, dtype)[0] == self.slots

    def write(self, tensors: Mapping[str, Tensor]) -> None:
        """Copy (and cast) every tensor into its slot.

        In chunks below torch's parallel grain size, so each copy runs on the calling thread: a memory-bound
        copy gains little from OpenMP, and on a loaded machine a 2-thread copy of SmolLM2's state measured 16 s
        against 1.4-3.1 s single-threaded (its threads wait for each other at every barrier). It also leaves the
        trainer's OpenMP pool alone when this runs beside training (async rollouts). The chunks go through one
        `torch._foreach_copy_` per tensor (`torch.split` views, the slots' cached), not a Python loop over
        thousands of slices: that loop's overhead was about half the write (0.71 s against 0.32 s for 30M
        elements, fp32 to bf16, on the loaded 2-core machine).
        """
        for name, tensor in tensors.items():
            targets = self._chunks.get(name)
            if targets is None:
                targets = self._chunks[name] = list(torch.split(self.view(name).reshape(-1), _COPY_CHUNK))
            torch._foreach_copy_(targets, list(torch.split(tensor.detach().reshape(-1), _COPY_CHUNK)))

    def view(self, name: str) -> Tensor:
        return slot_view(self.buffer, self._by_name[name])

    def unlink(self) -> None:
        """Remove the file's name (the mappings stay valid); idempotent."""
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.path = None


def checksum(tensor: Tensor, rows: Sequence[int] | None = None) -> int:
    """An exact fingerprint of `tensor`'s bits (of `tensor[rows]` when given): sum of bits x position weight.

    Integer arithmetic, so it does not depend on reduction order or thread count: equal tensors of the same
    dtype give equal sums on any process. Cost: linear in the elements read (a few hundred thousand here).
    """
    data = tensor.detach()
    if rows is not None:
        data = data.index_select(0, torch.tensor(list(rows), dtype=torch.int64, device=data.device))
    flat = data.contiguous().reshape(-1)
    bits = flat.view(_INT_VIEW[flat.element_size()]).to(torch.int64)
    weights = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device) % _WEIGHT_PERIOD + 1
    return int((bits * weights).sum())


__all__ = ["SharedWeightsBuffer", "TensorSlot", "checksum", "iter_views", "map_file", "plan_slots", "slot_view",
           "stacked_view"]
